"""What a checkpoint's training depended on, and what changed since. Torch-free.

A checkpoint is only worth resuming from with the experiment that wrote it: another model,
data, method, seed or global batch would silently make a different run. Data is its
settings and the content of every local training file (data/files.content_digest): a file
replaced at the same path is a change. The fingerprint
holds those settings; the layout (processes, per-device batch, accumulation) is kept apart,
since the same global batch over another layout continues the same data order. Everything
else (logging, saving, evaluation, total steps, output) may change between attempts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune.config import inputs
from finetune.config.derived.effective import class_default, record, value
from finetune.config.rules import is_local
from finetune.config.schema import Experiment
from finetune.data.files import content_digest, list_data_files
from finetune.errors import DataError

# With the sections the run's method owns (its record). dpo is recorded for every method,
# as fingerprints always held it (its ref_model is None elsewhere): dropping it would make
# every earlier checkpoint differ.
SECTIONS = ("method", "model", "tokenizer", "peft", "precision", "dpo")
DATA_KEYS = ("train", "eval_fraction", "format", "weight_column")
LAYOUT_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps")
CONTENT = "data content "  # + a training file's path
# Data settings added after fingerprints were first written: recorded only when set, so
# an earlier checkpoint (which has none of them) still matches an experiment without them.
LATER_SOURCE_KEYS = ("data_files", "weight")
LATER_DATA_KEYS = ("seed",)
# Training keys that do not change which samples are seen or what a step computes.
HARMLESS_PREFIXES = ("logging_", "save_", "eval_", "hub_", "push_to_hub", "log_level",
                     "dataloader_num_workers", "dataloader_pin_memory",
                     "dataloader_persistent_workers", "dataloader_prefetch_factor",
                     "dataset_num_proc")  # preparation's processes: the same rows
HARMLESS = {"max_steps", "num_train_epochs", "report_to", "run_name", "disable_tqdm",
            "per_device_eval_batch_size", "eval_strategy", "load_best_model_at_end",
            "metric_for_best_model", "greater_is_better", "prediction_loss_only",
            "batch_eval_metrics", "include_for_metrics", "include_num_input_tokens_seen",
            "skip_memory_metrics", "ddp_timeout", "torch_empty_cache_steps", "project",
            "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "do_eval",
            "do_predict", "do_train", "eval_packing", "eval_do_concat_batches",
            "eval_use_gather_object", "eval_accumulation_steps", "eval_delay",
            "restore_callback_states_from_checkpoint", *LAYOUT_KEYS}


def harmless(key: str) -> bool:
    return key in HARMLESS or key.startswith(HARMLESS_PREFIXES)


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, sub in value.items():
            flat.update(_flatten(sub, f"{prefix}.{key}"))
        return flat
    return {prefix: value}


def layout(experiment: Experiment) -> dict[str, int]:
    result = {"processes": experiment.distributed.world_size,
              **{key: value(experiment, key) for key in LAYOUT_KEYS}}
    # A tensor-parallel group trains on one batch: only data parallel groups add rows.
    result["global_batch"] = (experiment.distributed.data_parallel
                              * result["per_device_train_batch_size"]
                              * result["gradient_accumulation_steps"])
    return result


def _training_files(experiment: Experiment) -> list[Path]:
    """The local files training reads (a directory: its data files, as data/load.py)."""
    files = []
    for loc, path in inputs.values(experiment, "data"):
        if loc[1] != "train" or not is_local(path):
            continue  # eval data; a hub dataset: its id and revision are in data.train
        try:
            files += list_data_files(Path(path))
        except DataError:
            files.append(Path(path))  # reading the data reports what is wrong
    return files


def fingerprint(experiment: Experiment) -> dict[str, Any]:
    dumped = experiment.model_dump(mode="json")
    flat: dict[str, Any] = {}
    for section in dict.fromkeys(SECTIONS + record(experiment).sections):
        flat.update(_flatten(dumped[section], section))
    dumped["data"]["train"] = [{k: v for k, v in source.items()
                                if not (k in LATER_SOURCE_KEYS and v is None)}
                               for source in dumped["data"]["train"]]
    if dumped["vision"] is not None:  # what of a VLM trains; absent from older checkpoints
        flat.update(_flatten(dumped["vision"], "vision"))
    for key in DATA_KEYS:
        flat.update(_flatten(dumped["data"][key], f"data.{key}"))
    for key in LATER_DATA_KEYS:
        if dumped["data"][key] is not None:
            flat[f"data.{key}"] = dumped["data"][key]
    if any(source.max_samples is not None for source in experiment.data.train):
        # max_samples kept the first rows before it kept a seeded sample: a checkpoint
        # written then saw other rows.
        flat["data.max_samples keeps"] = "a seeded random sample"
    for path in _training_files(experiment):
        flat[f"{CONTENT}{path}"] = content_digest(path)
    # One process and DDP write the same checkpoints; sharded strategies their own.
    strategy = experiment.distributed.strategy
    flat["checkpoint format"] = "plain" if strategy in ("none", "ddp") else strategy
    if strategy == "deepspeed":
        flat["distributed.deepspeed.zero_stage"] = experiment.distributed.deepspeed.zero_stage
        if experiment.distributed.tensor_parallel > 1:  # its optimizer states are AutoTP shards
            flat["distributed.tensor_parallel"] = experiment.distributed.tensor_parallel
    if strategy == "fsdp":  # another version or state-dict type reads other files
        for key in ("version", "state_dict_type"):
            flat[f"distributed.fsdp.{key}"] = getattr(experiment.distributed.fsdp, key)
    for key in sorted(experiment.training):
        if not harmless(key):
            flat[f"training.{key}"] = experiment.training[key]
    flat["global batch"] = layout(experiment)["global_batch"]
    return flat


def _default(method: str, key: str) -> Any:
    """The value a key has when it is not set: the method's default for training keys."""
    if key == "distributed.tensor_parallel":
        return 1
    if key.startswith("training."):
        try:
            return class_default(method, key.removeprefix("training."))
        except KeyError:  # a hand-edited fingerprint: no method, or a key its class lacks
            pass
    return "<not set>"


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One readable line per setting that differs: `key: old -> new`."""
    lines = []
    # A checkpoint written before finetune recorded data content has none to compare.
    recorded = any(key.startswith(CONTENT) for key in old)
    for key in sorted(set(old) | set(new)):
        if key.startswith(CONTENT) and not recorded:
            continue
        before = old.get(key, _default(str(old.get("method")), key))
        after = new.get(key, _default(str(new.get("method")), key))
        if before != after:
            lines.append(f"{key}: {before!r} -> {after!r}")
    return lines


def layout_note(old: dict[str, int], new: dict[str, int]) -> str | None:
    """What changes when the same global batch is spread over another layout."""
    if old == new:
        return None
    spell = lambda l: (f"{l['processes']} process(es) x batch {l['per_device_train_batch_size']}"
                       f" x accumulation {l['gradient_accumulation_steps']}")
    note = (f"the checkpoint was written by {spell(old)}; this run is {spell(new)} (global "
            f"batch {new['global_batch']} either way). The data continues from the same "
            "sample, but sums are reduced in another order, so numbers differ from an "
            "uninterrupted run at rounding level")
    if old["processes"] != new["processes"]:
        note += ("; random streams (dropout) restart, as the checkpoint's per-process RNG "
                 "states do not map onto other processes")
    return note
