"""What the online methods built on TRL's generating trainers (grpo: GRPOTrainer, rloo:
RLOOTrainer) share: the preparation of their prompts, their reward sources, their
reference model without PEFT, and the exact resume of their generation window. Both
trainers render a prompt (with its pictures, for a vision-language model) the same way,
keep the same generation state and load the reference the same way (trl 1.16), so one
implementation serves both.

Prompts: every prompt is rendered and counted against the context; a text model's is
refused when too long (data/prompts.py), a vision-language model's, with its pictures
expanded to their image tokens, dropped and counted (methods/vision_lengths.py), after
its contents are put in parts as GRPOTrainer renders them (_in_parts; distill's prompts
too, prepared here).

Rewards: the reward model of rewards.model first (if any), then the Python functions of
rewards.functions in order, weighted by rewards.weights (the config's reward_weights,
set here: finetune owns that field). Each function is wrapped so that one that raises,
or returns something other than one number (or None) per completion, stops the run with
an error naming it (rewards.functions[i]). None keeps TRL's meaning: "this function does
not score this completion" (multi-task rewards); the weighted sum skips it, and a
completion no function scores gets advantage 0.

Reference model (beta > 0): under LoRA/QLoRA TRL keeps a frozen copy of the starting
adapter (equal to the adapter-disabled base for a fresh adapter). Without PEFT it
reloads the policy from its config's name_or_path, which is empty for `model.init:
random`: we point it at the run's init-model/ (the starting weights, saved by rank 0)
while the trainer is built (compat.grpo_reference_from), and pass the model's revision.

Exact resume: the trainer generates completions for steps_per_generation x
num_iterations micro-steps at once and keeps them in memory, counting micro-steps; a
resumed trainer starts with neither, so a checkpoint that falls inside a generation
window would be continued with fresh, different completions. Every checkpoint therefore
also holds, per rank, the micro-step count, the buffer and the open window of the
trainer's own metrics (reward, kl, ... averaged at each log), read and set through
compat.grpo_generation: the method's part of finetune's state record
(checkpoint_state.py), written when the Trainer saves and restored as training begins,
so a resumed run continues bitwise like an uninterrupted one. A checkpoint of another
layout (processes, batch, accumulation, generation window) or without the part
continues as TRL would, from freshly generated completions, but with the micro-step
where the uninterrupted run would have it, so later windows stay aligned.

Exact order: TRL's RepeatSampler (grpo, rloo and distill) draws every epoch's order from
one generator seeded once, so a run resumed from a checkpoint in a later epoch would
replay the first epoch's order. EpochOrder reseeds it from seed + epoch (the Trainer
calls set_epoch before every epoch, resumed or not).
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch
from trl.trainer.utils import RepeatSampler

from finetune import compat
from finetune.data.images import IMAGES
from finetune.data.prompts import checked_prompts, completion_budget, prompt_limit
from finetune.errors import ConfigError, RunError
from finetune.methods import Job, vision_lengths
from finetune.methods.sft_vision import refuse_images
from finetune.model.vision import as_parts, is_processor
from finetune.model.rewards import (reward_call_error, reward_functions, reward_model,
                                    reward_problem, reward_weights, unique_names)


def prepare_prompts(splits, tokenizer, experiment):
    """The method's `prepare` (see the module doc)."""
    if not is_processor(tokenizer):
        refuse_images(splits, experiment)
        return checked_prompts(splits, tokenizer, experiment)
    sizes = experiment.vision  # for a hub model (config/rules/vision.py: a local one)
    if sizes is not None and (sizes.max_pixels, sizes.min_pixels) != (None, None):
        raise ConfigError([f"vision.max_pixels, vision.min_pixels: not supported for "
                           f"{experiment.method} yet (its trainer opens the pictures "
                           "itself): fit the pictures ahead"])
    limit = prompt_limit(experiment)
    setting, budget = completion_budget(experiment)
    kept = lambda rows, split: None if rows is None else vision_lengths.kept_prompts(
        _in_parts(rows), split, tokenizer, limit, setting, budget, splits.notes)
    # The rows stay rows (splits.tokenized would keep a second copy of eval as eval_rows)
    return replace(splits, train=kept(splits.train, "train"), eval=kept(splits.eval, "eval"))


def _in_parts(rows):
    """A VLM's prompts with every content in parts (model/vision.as_parts): TRL 1.16's
    GRPOTrainer turns text contents into parts itself, RLOOTrainer only in a batch with
    pictures, and a processor whose chat template reads parts alone would fail on its
    other batches. Parts of two shapes are typed as JSON objects, each kept as written
    (as the data reader types them: data/llava_rows.py)."""
    from datasets import Features, Json, List

    if not isinstance(rows.features.get("prompt"), List) or \
            not isinstance(rows.features["prompt"].feature, dict):
        return rows  # not messages: kept_prompts refuses them naming the row
    turn = {**rows.features["prompt"].feature, "content": List(Json())}
    count = IMAGES in rows.column_names
    return rows.map(lambda row: {"prompt": as_parts(row["prompt"], len(row[IMAGES] or [])
                                                    if count else 0)},
                    features=Features({**rows.features, "prompt": List(turn)}),
                    desc="prompts in parts")


def checked_reward(function, where: str):
    """The user's function, raising RunError naming `where` when it fails or returns
    something unusable. Keeps the name (TRL's metric key rewards/<name>/...) and
    async-ness (TRL awaits async functions)."""

    def check(output, completions):
        problem = reward_problem(output, len(completions), allow_none=True)
        if problem:
            raise RunError(f"{where}: {problem}")
        return output.tolist() if isinstance(output, torch.Tensor) else list(output)

    if inspect.iscoroutinefunction(function) or \
            inspect.iscoroutinefunction(getattr(function, "__call__", None)):
        @functools.wraps(function)
        async def wrapper(*args, completions, **kwargs):
            try:
                output = await function(*args, completions=completions, **kwargs)
            except RunError:
                raise
            except Exception as exc:
                raise reward_call_error(exc, where) from exc
            return check(output, completions)
    else:
        @functools.wraps(function)
        def wrapper(*args, completions, **kwargs):
            try:
                output = function(*args, completions=completions, **kwargs)
            except RunError:
                raise
            except Exception as exc:
                raise reward_call_error(exc, where) from exc
            return check(output, completions)
    return wrapper


class EpochSampler(RepeatSampler):
    """RepeatSampler whose shuffled order is a function of seed and epoch alone."""

    def set_epoch(self, epoch: int) -> None:
        if self.shuffle and self.seed is not None:
            self.generator.manual_seed(self.seed + epoch)


class EpochOrder:
    """Mixin for a TRL trainer sampling with RepeatSampler: the same order per epoch
    whether the run was resumed or not (see the module doc)."""

    def _get_train_sampler(self, dataset=None):
        s = super()._get_train_sampler(dataset)
        return EpochSampler(s.data_source, s.mini_repeat_count, s.batch_size, s.repeat_count,
                            s.shuffle, s.seed)


class GenerationState(EpochOrder):
    """Mixin for a TRL generating trainer whose checkpoints carry its generation window
    (see the module doc) as its `state_part` of finetune's state record
    (callbacks.ResumeState)."""

    state_part: str  # the method's name

    def _layout(self) -> dict[str, int]:
        args = self.args
        return {"world_size": args.world_size,
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "steps_per_generation": args.steps_per_generation,
                "num_iterations": args.num_iterations,
                "num_generations": args.num_generations}

    def state_to_save(self) -> dict:
        window = compat.grpo_generation(self)
        buffer = window.buffer
        if buffer is not None:
            buffer = [{k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
                       for k, v in part.items()} for part in buffer]
        return {"layout": self._layout(), "step": window.step,
                "global_step": self.state.global_step, "buffer": buffer,
                "metrics": {k: list(v) for k, v in window.metrics.items()}}

    def restore_state(self, saved: dict | None, own: bool) -> None:
        usable = saved is not None and own and saved["layout"] == self._layout() and \
            saved["global_step"] == self.state.global_step
        if usable:
            device = self.accelerator.device
            buffer = saved["buffer"]
            if buffer is not None:
                buffer = [{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                           for k, v in part.items()} for part in buffer]
            compat.set_grpo_generation(self, compat.GenerationWindow(
                int(saved["step"]), buffer, {k: list(v) for k, v in saved["metrics"].items()}))
            return
        # Another layout (or no state for this rank): continue as TRL does, generating
        # afresh from the current prompts, with the micro-step where an uninterrupted run
        # would have it.
        step = self.state.global_step * self.args.gradient_accumulation_steps
        compat.set_grpo_generation(self, compat.GenerationWindow(step, None, None))
        generate_every = self.args.steps_per_generation * self.args.num_iterations
        if self.args.process_index == 0 and step % generate_every:
            name = self.state_part.upper()
            why = "was written with another batch layout" if saved is not None else \
                f"has no {name} generation state"
            print(f"finetune: the checkpoint at step {self.state.global_step} {why}: {name} "
                  "regenerates the completions of the current generation window, so this "
                  "resume is not bitwise exact", flush=True)


@contextmanager
def _reference_source(job: Job):
    """Without PEFT and with beta > 0, TRL builds the reference by reloading the policy
    from its config's name_or_path; make that the starting weights."""
    spec = job.experiment
    # TRL loads it with the policy's dtype and attention; revision and remote code are ours.
    extra = {k: v for k, v in (("revision", spec.model.revision if spec.model.init != "random"
                                else None),
                               ("trust_remote_code", spec.model.trust_remote_code)) if v}
    if extra:
        job.args.model_init_kwargs = {**(job.args.model_init_kwargs or {}), **extra}
    if spec.model.init == "random":
        with compat.grpo_reference_from(job.model.config, str(job.run_dir / "init-model")):
            yield
    else:
        yield


def _reward_sources(job: Job) -> tuple[list, list, list[str]]:
    """(reward functions, their processing classes, their metric names) as TRL takes
    them; sets the config's reward_weights from rewards.weights."""
    spec = job.experiment
    functions = reward_functions(spec)  # ConfigError naming rewards.functions[i]
    funcs, processors, names = [], [], []
    if spec.rewards.model is not None:
        model, tokenizer = reward_model(spec, job.hardware.model_dtype(spec, "reward"))
        funcs.append(model)
        processors.append(tokenizer)
        names.append("reward_model")
    for i, (name, function) in enumerate(zip(spec.rewards.functions, functions)):
        funcs.append(checked_reward(function, f"rewards.functions[{i}] ({name})"))
        processors.append(None)
        names.append(name.rpartition(":")[2])
    job.args.reward_weights = reward_weights(spec)
    return funcs, processors, names


def build_online_trainer(job: Job, trainer_class):
    """`trainer_class` (a GenerationState over GRPOTrainer or RLOOTrainer) built on the
    job's model, data and reward sources."""
    spec = job.experiment
    if job.args.use_vllm:
        raise ConfigError([f"training.use_vllm: not supported by finetune's {spec.method} "
                           "(generation runs in the trainer)"])
    funcs, processors, names = _reward_sources(job)
    needs_reference = job.args.beta != 0.0 and spec.peft.type == "none"
    with _reference_source(job) if needs_reference else nullcontext():
        trainer = trainer_class(
            model=job.model, reward_funcs=funcs, args=job.args, train_dataset=job.data.train,
            eval_dataset=job.data.eval, processing_class=job.tokenizer,
            reward_processing_classes=processors, callbacks=job.callbacks)
    # Metric keys rewards/<name>/mean: the function's name, "reward_model" for the model.
    trainer.reward_func_names = unique_names(names)
    return trainer
