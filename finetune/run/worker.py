"""What runs on every rank: build tokenizer, data, model and adapters from the experiment
(build.py, shared with `finetune eval`), hand them to the method's trainer, train,
evaluate before and after (evaluation.py), save."""

from __future__ import annotations

import gc
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

from transformers import TrainerCallback

from finetune.rundir import checkpoints
from finetune.hub import upload
from finetune.report import trackers
from finetune.run.build import method_trainer, starting_model, tokenizer_and_data, without_redacted
from finetune.model.hardware import checkpointing_decision, resolve_hardware
from finetune.model.load import count_parameters, tied_parameters
from finetune.model.peft import embed_base
from finetune.run.callbacks import (EndAtLastStep, MetricsFile, NothingLeftToTrain, ResumeState,
                                   SealCheckpoints, TrainingTime, read_metrics,
                                   truncate_metrics)
from finetune.config.derived import attention
from finetune.config.derived.effective import attention_choice
from finetune.config.schema import Experiment
from finetune.errors import RunError
from finetune.run.evaluation import evaluate
from finetune.rundir.fingerprint import fingerprint, layout
from finetune.run.launched import apply_cpu_threads, parallel_note, rank_of
from finetune.methods import Job
from finetune.run.preemption import Preempted, StopOnSignal
from finetune.run.noise import hide_tied_keys_on_resume
from finetune.report.plots import write_loss_plot
from finetune.report.summary import (attention_name, end_summary, environment, logged_before,
                             start_summary, write_json)
from finetune.rundir.resume import ResumePlan


FSDP_NEEDS_CUDA = ("distributed.strategy fsdp needs CUDA devices and this run is on the CPU: "
                   "accelerate runs FSDP only on accelerators; on CPU use ddp or deepspeed")


def _evaluate(trainer, job: Job, metrics: MetricsFile, when: str) -> dict[str, Any]:
    results, scored = evaluate(trainer, job)
    if scored is not None and trainer.is_world_process_zero():
        metrics.write({"step": trainer.state.global_step, "when": when,
                       "eval_exact_match": scored["exact_match"],
                       "exact_match_samples": scored["samples"],
                       "exact_match_examples": scored["examples"]})
    return results


class EvaluateAsTrainingBegins(TrainerCallback):
    """Under FSDP the Trainer shards model and optimizer together inside train(). An
    evaluate() before train() prepares the model alone (transformers' evaluation_loop):
    FSDP2 refuses that, and FSDP1 then trains with no optimizer. So there the evaluation
    before training runs as training begins: everything prepared, no step taken yet."""

    def __init__(self, evaluate: Callable[[], dict[str, Any]]):
        self.evaluate = evaluate
        self.results: dict[str, Any] = {}  # filled in once train() has begun

    def on_train_begin(self, args, state, control, **kwargs):
        self.results.update(self.evaluate())


def _evaluate_before(trainer, job: Job, metrics: MetricsFile) -> dict[str, Any]:
    def evaluate() -> dict[str, Any]:
        return _evaluate(trainer, job, metrics, "before")

    if not trainer.is_fsdp_enabled:
        return evaluate()
    first = EvaluateAsTrainingBegins(evaluate)
    trainer.add_callback(first)
    return first.results


def _start_attempt(run_dir: Path, plan: ResumePlan) -> None:
    """Rank 0, before anything is trained: report where this attempt starts, move damaged
    checkpoints aside, drop incomplete ones, and make metrics.jsonl end where the
    checkpoint does."""
    for note in plan.notes:
        print(f"finetune: {note}", flush=True)
    for path, to in plan.damaged:
        try:
            path.rename(to)
        except OSError as exc:
            raise RunError(f"cannot move the damaged {path} aside to {to}: {exc.strerror}; "
                           "move it away yourself and run again") from None
    for path in plan.incomplete:
        shutil.rmtree(path, ignore_errors=True)
    (run_dir / checkpoints.STOPPED).unlink(missing_ok=True)
    for note in truncate_metrics(run_dir / "metrics.jsonl",
                                 plan.step if plan.checkpoint else None):
        print(f"finetune: {note}", flush=True)


def _end_progress_line(trainer) -> None:
    """Training that fails leaves the Trainer's progress bar mid-line on stderr: close it,
    so the error starts a line of its own (`error:` lines are what people and scripts
    look for)."""
    from transformers.trainer_callback import ProgressCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
            callback.training_bar.close()
            callback.training_bar = None


def _save_final(trainer, tokenizer, run_dir: Path, main: bool,
                embedded_base: Path | None = None) -> Path:
    """final/ appears whole or not at all: written aside, then renamed by rank 0.
    embedded_base: the init-model/ of a random-init adapter run, placed in final/ so the
    adapter loads on its own (model/peft.py embed_base)."""
    final, staging = run_dir / "final", run_dir / ".final.partial"
    for path in (final, staging):  # every rank: the same answer before anyone waits
        if os.path.lexists(path) and not path.is_dir():
            raise RunError(f"cannot save the final model: {path} is not a directory. Move it "
                           "away and run again: the run continues from its last checkpoint")
    if main:
        shutil.rmtree(staging, ignore_errors=True)
    trainer.args.distributed_state.wait_for_everyone()
    if trainer.is_fsdp_enabled:
        # From a sharded state dict the Trainer's save_model writes no weights at all; the
        # final model is whole, gathered to rank 0 (every rank takes part).
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    try:
        trainer.save_model(str(staging))
        trainer.args.distributed_state.wait_for_everyone()  # every rank's part is written
        if main:
            _leave_out_other_adapters(trainer, staging)
            tokenizer.save_pretrained(str(staging))
            if embedded_base is not None:
                embed_base(staging, embedded_base)
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
    except OSError as exc:
        raise RunError(f"cannot write the final model ({exc.filename or staging}: "
                       f"{exc.strerror or exc}); run again to continue from the last "
                       "checkpoint") from None
    return final


def _leave_out_other_adapters(trainer, staging: Path) -> None:
    """final/ is the trained adapter: under (Q)LoRA TRL's dpo, kto, grpo and rloo keep
    their reference as a frozen copy of the starting adapter, an adapter named `ref`, and
    PEFT saves every adapter but `default` into a subfolder of its name. Checkpoints keep
    it (a resumed run loads it back from there). The Trainer's save_model, the one place
    that gathers the weights under FSDP and ZeRO-3, offers no choice of adapters, so the
    others' subfolders are taken out of final/ before it appears."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    for name in getattr(model, "peft_config", {}):
        if name != "default":
            shutil.rmtree(staging / name, ignore_errors=True)


def _write_results(run_dir: Path, summary: dict[str, Any], plot_title: str | None) -> None:
    """summary.json first: it marks the run finished, and a loss curve that cannot be
    drawn (loss.png a directory, say) is only a warning."""
    write_json(run_dir / "summary.json", summary)
    if plot_title is None:
        return
    try:
        write_loss_plot(run_dir, plot_title)
    except RunError as exc:
        print(f"finetune: warning: no loss curve: {exc}", file=sys.stderr, flush=True)


def train(experiment: Experiment, run_dir: Path, plan: ResumePlan,
          launched: float | None = None) -> dict[str, Any]:
    started = time.time()
    # What the imports built lives as long as the process: frozen, it is skipped by every
    # full collection (accelerate runs gc.collect() at each free_memory): ~0.5 s a run.
    gc.freeze()
    rank = rank_of(os.environ)
    stop = StopOnSignal(rank, experiment.preemption.save_timeout)
    if rank == 0:
        _start_attempt(run_dir, plan)
    experiment = without_redacted(experiment)
    hw = resolve_hardware(experiment)
    if experiment.distributed.strategy == "fsdp" and hw.device != "cuda":
        raise RunError(FSDP_NEEDS_CUDA)  # device auto on a machine without CUDA
    threads = apply_cpu_threads(os.environ) if hw.device == "cpu" else None
    tokenizer, data = tokenizer_and_data(experiment, run_dir, launched or started)
    checkpointing, checkpointing_note = checkpointing_decision(experiment, hw)
    args, model = starting_model(experiment, hw, tokenizer, run_dir, rank, run_dir,
                                 checkpointing)

    # Before the Trainer is built: its integrations read where to log as it builds them.
    tracking = trackers.start(experiment, run_dir, plan.step if plan.checkpoint else None,
                              rank == 0)
    metrics = MetricsFile(run_dir / "metrics.jsonl", tracking.log)
    seal = SealCheckpoints(run_dir, {"fingerprint": fingerprint(experiment),
                                     "layout": layout(experiment)},
                           experiment.training.get("save_total_limit"), stop)
    elapsed = TrainingTime(started)
    resume_state = ResumeState(plan.checkpoint, elapsed)
    job = Job(experiment=experiment, run_dir=run_dir, hardware=hw, tokenizer=tokenizer,
              model=model, data=data, args=args,
              callbacks=[metrics, stop, resume_state, seal, EndAtLastStep()],
              notes=[n for n in (parallel_note(experiment, hw.device), *hw.notes,
                                 attention.note(experiment.model.attn_implementation,
                                                *attention_choice(experiment, hw.device,
                                                                  hw.precision, hw.kernels)),
                                 checkpointing_note, threads) if n] + data.notes)
    trainer = method_trainer(job)
    resume_state.trainer = trainer
    if plan.checkpoint is not None:
        hide_tied_keys_on_resume(tied_parameters(trainer.model))
    main = trainer.is_world_process_zero()
    if main:
        write_json(run_dir / "environment.json",
                   environment(hw.device, hw.precision, attention_name(trainer.model)))
        write_json(run_dir / "training_args.json", args.to_dict())
        print(start_summary(job, *count_parameters(trainer.model)), flush=True)

    # A resumed run was evaluated before training by its first attempt.
    before = _evaluate_before(trainer, job, metrics) \
        if experiment.evaluation.before_training and plan.checkpoint is None else {}
    try:
        trainer.train(resume_from_checkpoint=str(plan.checkpoint) if plan.checkpoint else None)
    except NothingLeftToTrain:
        trainer.is_in_train = False  # as train() leaves it: evaluation casts as after training
        if main:
            print(f"finetune: {plan.checkpoint.name} is at step {trainer.state.global_step} "
                  f"and the run has {trainer.state.max_steps}: nothing left to train; "
                  "evaluating it and saving it as the final model", flush=True)
    except Exception as exc:
        _end_progress_line(trainer)
        if _disk_full(exc, run_dir):
            raise RunError(_disk_full_message(run_dir)) from exc
        raise
    if stop.stopping:
        tracking.end("KILLED")  # the next attempt resumes its runs
        _leave_process_group()
        step = trainer.state.global_step
        raise Preempted(stop.received or "a signal on another rank", step,
                        str(checkpoints.directory(args.output_dir, step)))
    stop.done()
    after = _evaluate(trainer, job, metrics, "after")

    random_adapter = experiment.peft.type != "none" and experiment.model.init == "random"
    final_dir = _save_final(trainer, tokenizer, run_dir, main,
                            run_dir / "init-model" if random_adapter else None) \
        if experiment.output.save_final else None
    summary = {"name": experiment.name, "method": experiment.method,
               "seconds": round(elapsed.seconds(), 2), "global_step": trainer.state.global_step,
               "before": before or logged_before(read_metrics(run_dir / "metrics.jsonl")),
               "after": after,
               "train": next((r for r in reversed(trainer.state.log_history)
                              if "train_loss" in r), {}),
               "final_model": str(final_dir) if final_dir else None}
    if main:
        _write_results(run_dir, summary, f"{experiment.name} ({experiment.method})"
                       if experiment.output.plot else None)
        print(end_summary(run_dir, summary["seconds"], time.time() - started,
                          summary["before"], after, final_dir),
              flush=True)
        tracking.finish(summary)
    _leave_process_group()
    if main and experiment.training.get("push_to_hub") and final_dir is not None:
        upload.push(run_dir)  # the run is complete and every other process has left
    return summary


def _disk_full(exc: BaseException, run_dir: Path) -> bool:
    """Savers word a full disk differently (torch.save: "unexpected pos ..."): ENOSPC
    anywhere in the chain, or a save cut short with the disk all but full, is a full disk."""
    import errno

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    saving = bool(checkpoints.scan(run_dir / "checkpoints").incomplete)
    return saving and shutil.disk_usage(run_dir).free < 64 * 2**20


def _disk_full_message(run_dir: Path) -> str:
    found = checkpoints.scan(run_dir / "checkpoints")
    partial = ", ".join(p.name for p, _ in found.incomplete) or "a checkpoint"
    kept = (f"the last complete checkpoint, {found.newest}, is intact" if found.newest
            else "no checkpoint was complete yet")
    return (f"no space left on the device of {run_dir} while writing {partial}: {kept}. "
            "Free some space (the incomplete checkpoint is removed on the next start) and "
            "run the same command again to continue.")


def _leave_process_group() -> None:
    """Leave torch.distributed together and explicitly: left to interpreter exit, gloo's
    threads occasionally abort a rank (SIGABRT) after a complete run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
