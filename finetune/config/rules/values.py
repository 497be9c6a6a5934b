"""Ranges of the training values TRL and transformers would refuse (or silently misuse)
only when training starts, checked at validate instead; and what a run needs from the
machine (the chosen attention's package here; trackers and the hub in integrations.py),
found without importing them."""

from __future__ import annotations

import math
from typing import Any, Iterator

from finetune.config import trl_fields
from finetune.config.derived import attention
from finetune.config.rules import integrations
from finetune.config.derived.effective import value as effective_value
from finetune.config.rules.integrations import installed
from finetune.config.schema import Experiment
from finetune.config.script_values import MAX_LENGTH

Problem = tuple[tuple, str]

# key -> the smallest value allowed (a value of None means "unset" and is accepted).
AT_LEAST = {
    "per_device_train_batch_size": 1,  # 0: the dataloader fails at step 1
    "per_device_eval_batch_size": 1,
    "gradient_accumulation_steps": 1,  # 0: a division by zero when training starts
    "eval_accumulation_steps": 1,
    "max_length": 1,  # negative: Python slicing keeps the last N tokens without a word
    "max_prompt_length": 1,
    "max_completion_length": 1,
    "max_new_tokens": 1,
    "generation_batch_size": 1,
    "num_generations": 1,
    "steps_per_generation": 1,
    "learning_rate": 0,
    "weight_decay": 0,
    "warmup_steps": 0,
    "max_grad_norm": 0,
    "dataloader_num_workers": 0,
    "save_total_limit": 0,
}
# Lengths and batch sizes become int32/int64 tensor shapes; past MAX_LENGTH none is real.
AT_MOST = {key: MAX_LENGTH for key in (
    "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
    "max_length", "max_prompt_length", "max_completion_length", "max_new_tokens",
    "generation_batch_size", "num_generations")}
# Steps between logs, saves and evaluations: 0 stops TrainingArguments at train start.
POSITIVE = ("logging_steps", "save_steps", "eval_steps")
SEED_MAX = 2**32 - 1
INT64 = (-2**63, 2**63 - 1)  # what torch and numpy hold; the Trainer turns steps into tensors  # numpy's seeds; transformers' set_seed seeds numpy too

def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole(value: Any) -> bool:
    """A whole number; never int(value), which raises on infinity and NaN."""
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _ranges(training: dict[str, Any]) -> Iterator[Problem]:
    for key, value in training.items():
        if not _number(value):
            continue
        loc = ("training", key)
        if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
            yield loc, "must fit in 64 bits (between -2**63 and 2**63 - 1)"
        elif isinstance(value, float) and not math.isfinite(value):
            yield loc, f"must be a finite number, got {value}"
        elif key in POSITIVE and value <= 0:
            yield loc, f"must be more than 0, got {value}"
        elif key in AT_LEAST and value < AT_LEAST[key]:
            yield loc, f"must be at least {AT_LEAST[key]}, got {value}"
        elif key in AT_MOST and value > AT_MOST[key]:
            yield loc, f"must be at most {AT_MOST[key]:,}, got {value:,}"
        elif key in ("seed", "data_seed") and not 0 <= value <= SEED_MAX:
            yield loc, f"must be between 0 and 2**32 - 1, got {value}"
        elif key in ("num_train_epochs",) and value <= 0 and training.get("max_steps", -1) <= 0:
            yield loc, f"must be more than 0 (or set training.max_steps), got {value}"
        elif key == "warmup_ratio" and not 0 <= value <= 1:
            yield loc, f"must be between 0 and 1, got {value}"
    for key in POSITIVE:
        value = training.get(key)
        # (a non-finite value is reported above, once)
        if _number(value) and math.isfinite(value) and value > 1 and not _whole(value):
            yield ("training", key), f"must be a whole number when above 1, got {value}"


def _schedule(exp: Experiment) -> Iterator[Problem]:
    """Cross-field checks of TrainingArguments.__post_init__ (transformers 5)."""
    def value(key: str) -> Any:
        return effective_value(exp, key)

    evaluates = value("eval_strategy") not in ("no", None)
    if value("lr_scheduler_type") in ("reduce_lr_on_plateau", "greedy") and not evaluates:
        yield ("training", "lr_scheduler_type"), \
            f"{value('lr_scheduler_type')} needs evaluation: set training.eval_strategy"
    if value("load_best_model_at_end") and value("save_strategy") != "best" and \
            value("eval_strategy") != value("save_strategy"):
        yield ("training", "load_best_model_at_end"), "needs training.save_strategy equal to " \
            f"training.eval_strategy ({value('save_strategy')} vs {value('eval_strategy')})"
    # (on CUDA, finetune's speed defaults give the loader workers when none are set)
    workers = exp.training.get("dataloader_num_workers")
    if value("dataloader_prefetch_factor") is not None and \
            (workers == 0 or (workers is None and exp.distributed.device == "cpu")):
        yield ("training", "dataloader_prefetch_factor"), "needs dataloader_num_workers > 0"


def _generation_batches(exp: Experiment) -> Iterator[Problem]:
    """GRPOConfig.__post_init__'s batch arithmetic: a generation batch holds whole groups
    of num_generations completions of one prompt. Only a config class with generation
    batches has these fields."""
    if "num_generations" not in trl_fields.fields_of(exp.method):
        return

    def value(key: str) -> Any:
        return effective_value(exp, key)

    keys = ("per_device_train_batch_size", "gradient_accumulation_steps",
            "generation_batch_size", "steps_per_generation", "num_generations",
            "per_device_eval_batch_size", "num_generations_eval")
    got = {key: value(key) for key in keys}
    if not all(v is None or (_number(v) and _whole(v) and v >= 1) for v in got.values()):
        return  # types and ranges are reported on their own
    world = exp.distributed.world_size
    step = got["per_device_train_batch_size"] * world
    generation, steps = got["generation_batch_size"], got["steps_per_generation"]
    if value("auto_find_batch_size"):
        yield ("training", "auto_find_batch_size"), f"not supported by {exp.method} (a batch " \
                                                    "holds whole groups of num_generations)"
    if generation is not None and steps is not None:
        yield ("training", "generation_batch_size"), "give it or steps_per_generation, not both"
        return
    if generation is None:
        generation = step * (steps or got["gradient_accumulation_steps"])
    elif generation % step:
        yield ("training", "generation_batch_size"), f"{generation} is not a multiple of " \
            f"the global batch ({step} = per_device_train_batch_size x {world} processes)"
    groups = got["num_generations"]
    if groups is not None and groups < 2:
        yield ("training", "num_generations"), "at least 2: advantages compare completions"
    elif groups is not None and generation % groups:
        yield ("training", "num_generations"), f"must divide the generation batch of " \
            f"{generation} completions (per_device_train_batch_size x processes x steps)"
    eval_groups = got["num_generations_eval"] or groups
    evaluates = value("eval_strategy") not in ("no", None)
    if evaluates and eval_groups and (got["per_device_eval_batch_size"] * world) % eval_groups:
        yield ("training", "per_device_eval_batch_size"), f"x {world} processes must be a " \
            f"multiple of the {eval_groups} generations per prompt"


def _kl_batches(exp: Experiment) -> Iterator[Problem]:
    """KTOConfig's KL term (every loss_type but apo_zero_unpaired): KTOTrainer pairs each
    row's prompt with the previous row's completion inside blocks of
    per_device_train_batch_size rows, fixed when it prepares the data, and reads those
    blocks back as its batches in order. A block of one pairs a row with itself, and
    another sampler or batch size breaks the pairing (TRL refuses both when training
    starts). Only KTOConfig has desirable_weight."""
    if "desirable_weight" not in trl_fields.fields_of(exp.method):
        return

    def value(key: str) -> Any:
        return effective_value(exp, key)

    loss = value("loss_type")
    if loss == "apo_zero_unpaired":
        return
    why = f"loss_type {loss} estimates its KL term from mismatched prompt/completion " \
          "pairs within each per-device batch"
    batch = value("per_device_train_batch_size")
    if _number(batch) and batch == 1:
        yield ("training", "per_device_train_batch_size"), f"at least 2: {why} (with one " \
            "row the only pair is the row itself); or loss_type apo_zero_unpaired, which " \
            "has no KL term"
    if value("train_sampling_strategy") != "sequential":
        yield ("training", "train_sampling_strategy"), f"must be sequential: {why}, paired " \
            "in the order the rows are prepared (finetune shuffles the rows once, with the " \
            "data seed, instead)"
    if value("auto_find_batch_size"):
        yield ("training", "auto_find_batch_size"), f"not supported: {why}, paired for " \
            "blocks of the configured per_device_train_batch_size"


def _attention(exp: Experiment) -> Iterator[Problem]:
    missing = attention.missing_package(exp.model.attn_implementation, installed)
    if missing:
        yield ("model", "attn_implementation"), missing


def check(exp: Experiment) -> list[Problem]:
    return [*_ranges(exp.training), *_schedule(exp), *_generation_batches(exp),
            *_kl_batches(exp), *integrations.check(exp), *_attention(exp)]
