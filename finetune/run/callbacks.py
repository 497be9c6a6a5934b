"""Trainer callbacks: every log and eval event appended to metrics.jsonl (main process),
each rank's finetune state kept in every checkpoint and restored on resume, and every
checkpoint sealed with a manifest once all ranks have written it."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

from transformers import TrainerCallback

from finetune import compat
from finetune.fileio.atomic import write_atomic
from finetune.rundir import checkpoint_state, checkpoints
from finetune.run.preemption import StopOnSignal
from finetune.rundir.paths import metrics_records as _records


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsFile(TrainerCallback):
    """metrics.jsonl. A record written by `write` (not logged through the Trainer: exact
    match) goes to `also` as well, the trackers, which see only the Trainer's logs."""

    def __init__(self, path: Path, also: Callable[[dict], None] | None = None):
        self.path = path
        self.also = also

    def write(self, record: dict) -> None:
        self._append(record)
        if self.also is not None:
            self.also(record)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self._append({"step": state.global_step, "epoch": state.epoch,
                          "time": round(time.time(), 3), **logs})

    def _append(self, record: dict) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")


def read_metrics(path: Path) -> list[dict]:
    return _records(path)[0]


def truncate_metrics(path: Path, step: int | None) -> list[str]:
    """Resuming from checkpoint-<step>: forget what an attempt logged after it, and the
    end-of-attempt records at it (from its train_runtime summary on: the evaluation after
    training), so the file reads like one uninterrupted run; starting from scratch (None):
    forget everything. Returns a note for each line dropped as damaged."""
    if not path.exists():
        return []
    records, dropped = _records(path)
    kept, ended = [], False
    for record in records if step is not None else []:
        ended = ended or (record["step"] == step and "train_runtime" in record)
        if record["step"] < step or (record["step"] == step and not ended):
            kept.append(record)
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return dropped


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class LossWindow:
    """The Trainer logs the mean loss of the steps since its last log, and a resumed
    Trainer starts that window afresh: stopped at step 7 with logging_steps 5, its log at
    step 10 would average steps 8-10, not 6-10. So every checkpoint keeps each rank's open
    window (loss sum and first step), and a resume reopens it: every logged loss equals
    the uninterrupted run's. The window is private to the Trainer (compat.loss_window)."""

    state_part = "loss_window"

    def __init__(self, trainer):
        self.trainer = trainer

    def state_to_save(self) -> dict:
        loss_sum, since = compat.loss_window(self.trainer)
        return {"sum": loss_sum.detach().cpu().clone(), "since": since}

    def restore_state(self, saved: dict | None, own: bool) -> None:
        if saved is not None and own:  # else another number of processes: a fresh window
            compat.set_loss_window(self.trainer, saved["sum"], int(saved["since"]))


class TrainingTime:
    """A run's wall time over its attempts: this attempt's since it started, plus what the
    checkpoint it resumed from had counted. Time a killed attempt spent after its last
    checkpoint is not counted, as its steps are not: the time the run's steps took."""

    state_part = "elapsed"

    def __init__(self, started: float):
        self.started, self.earlier = started, 0.0

    def seconds(self) -> float:
        return self.earlier + time.time() - self.started

    def state_to_save(self) -> dict[str, float]:
        return {"seconds": self.seconds()}

    def restore_state(self, saved: dict[str, Any] | None, own: bool) -> None:
        self.earlier = float(saved["seconds"]) if saved else 0.0  # rank 0's when not own


class ResumeState(TrainerCallback):
    """Each checkpoint keeps this rank's finetune state (checkpoint_state.py): the open
    logging window, the run's time so far (TrainingTime), and the trainer's own part where
    it has one (GRPO's generation
    window, PPO's rollout: a trainer with a `state_part` name, state_to_save() and
    restore_state(saved, own)). Written when the Trainer saves, before SealCheckpoints
    seals the checkpoint; restored as training begins (the Trainer has then loaded the
    checkpoint's weights, optimizer and state, and taken no step)."""

    def __init__(self, resume_from: Path | None, elapsed: TrainingTime):
        self.resume_from = resume_from
        self.elapsed = elapsed
        self.trainer = None  # set once the trainer exists

    def _parts(self) -> list:
        parts = [LossWindow(self.trainer), self.elapsed]
        if hasattr(self.trainer, "state_part"):
            parts.append(self.trainer)
        return parts

    def on_save(self, args, state, control, **kwargs):
        checkpoint = checkpoints.directory(args.output_dir, state.global_step)
        checkpoint_state.save(checkpoint, args.process_index,
                              {part.state_part: part.state_to_save() for part in self._parts()})

    def on_train_begin(self, args, state, control, **kwargs):
        if self.resume_from is None:
            return
        saved, own = checkpoint_state.load(self.resume_from, args.process_index), True
        if saved is None and args.process_index != 0:  # more processes than wrote it
            saved, own = checkpoint_state.load(self.resume_from, 0), False
        for part in self._parts():
            part.restore_state((saved or {}).get(part.state_part), own)


class NothingLeftToTrain(Exception):
    """Raised out of trainer.train() by EndAtLastStep: the run ends at its checkpoint."""


class EndAtLastStep(TrainerCallback):
    """Resumed from a checkpoint at (or past) the run's last step, transformers' Trainer
    would still take one more step: its epoch loop checks the step count only after a step
    (DefaultFlowCallback.on_step_end). When training begins, the Trainer has loaded the
    checkpoint (weights, optimizer, its state) and knows the run's max_steps, epochs
    included: with no step left, leave train() there, before any step."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step and state.global_step >= state.max_steps:  # resumed there
            raise NothingLeftToTrain(state.global_step, state.max_steps)


class SealCheckpoints(TrainerCallback):
    """After the Trainer wrote checkpoint-<step> (on every rank), rank 0 writes its
    manifest, then deletes checkpoints beyond save_total_limit: only sealed ones, never
    the newest. Rotation is ours, not the Trainer's, whose rotation runs before a
    checkpoint is sealed and could leave nothing complete to resume from."""

    def __init__(self, run_dir: Path, manifest_extra: dict[str, Any], save_total_limit: int | None,
                 stop: StopOnSignal):
        self.run_dir = run_dir
        self.extra = manifest_extra
        self.limit = save_total_limit
        self.stop = stop

    def on_save(self, args, state, control, **kwargs):
        checkpoint = checkpoints.directory(args.output_dir, state.global_step)
        _barrier()  # every rank's files (shards, RNG states) are written
        if state.is_world_process_zero:
            extra = dict(self.extra)
            if self.stop.stopping:
                extra["saved_on"] = self.stop.received or "a signal on another rank"
            checkpoints.write_manifest(checkpoint, state.global_step, extra)
            # TRL writes its draft model card into checkpoints/ before every save ("a
            # fine-tuned version of [None]"): not a fact of this run (finetune push writes
            # the run's own card).
            (Path(args.output_dir) / "README.md").unlink(missing_ok=True)
            if self.stop.stopping:
                write_atomic(self.run_dir / checkpoints.STOPPED, json.dumps(
                    {"step": state.global_step, "checkpoint": str(checkpoint),
                     "signal": extra["saved_on"], "time": round(time.time(), 3)}) + "\n")
            best = state.best_model_checkpoint
            checkpoints.rotate(Path(args.output_dir), self.limit,
                               {Path(best).resolve()} if best else set())
        _barrier()  # no rank exits before the checkpoint is sealed
        if self.stop.stopping:
            self.stop.done()
        return control
