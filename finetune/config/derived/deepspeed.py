"""Experiment -> DeepSpeed config. Batch size, accumulation, clipping and precision are
"auto": transformers fills them from the training arguments, which stay the one source
of truth. A hand-written file is read safely and used as it is (config/rules/deepspeed_file.py
checks it against the experiment). Torch-free."""

from __future__ import annotations

import json
from typing import Any

from finetune.config.schema import DeepSpeedSection, Experiment
from finetune.config.secrets import CREDENTIALS
from finetune.errors import RunError

MAX_BYTES = 1024 * 1024
# Sections finetune reads, each a JSON object when present.
SECTIONS = ("zero_optimization", "zero_optimization.offload_optimizer", "bf16", "fp16")


def _strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [text for key, sub in value.items() for text in (str(key), *_strings(sub))]
    if isinstance(value, list):
        return [text for sub in value for text in _strings(sub)]
    return [value] if isinstance(value, str) else []


def read(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """(config, None), or (None, why it cannot be used)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_BYTES + 1)
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror or exc}"
    if len(raw) > MAX_BYTES:
        return None, f"{path} is more than {MAX_BYTES:,} bytes; not a DeepSpeed config"
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deeply
        return None, f"cannot read {path} as JSON: {str(exc) or type(exc).__name__}"
    if not isinstance(config, dict):
        return None, f"{path}: a DeepSpeed config is a JSON object, not {type(config).__name__}"
    if any(CREDENTIALS.search(text) for text in _strings(config)):
        return None, (f"{path} holds credentials in a URL (user:password@); they would be "
                      "copied into the run directory's deepspeed.json: give them through the "
                      "environment instead")
    for dotted in SECTIONS:
        node: Any = config
        for key in dotted.split("."):
            node = node.get(key, {}) if isinstance(node, dict) else node
        if not isinstance(node, dict):
            return None, f"{path}: {dotted} must be a JSON object, not {type(node).__name__}"
    return config, None


def _offload(device: str, nvme_path: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        spec["nvme_path"] = nvme_path
    return spec


def deepspeed_config(ds: DeepSpeedSection, tensor_parallel: int = 1) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage >= 1 and ds.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(ds.offload_optimizer, ds.nvme_path)
    if ds.zero_stage >= 2:
        zero.update(overlap_comm=True, contiguous_gradients=True, reduce_bucket_size="auto")
    if ds.zero_stage == 3:
        if ds.offload_params != "none":
            zero["offload_param"] = _offload(ds.offload_params, ds.nvme_path)
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto",
                    stage3_gather_16bit_weights_on_model_save=ds.save_16bit_model)
    config: dict[str, Any] = {
        "zero_optimization": zero,
        # The Trainer's optimizer is used (no "optimizer" section); allow it with offload.
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
    if tensor_parallel > 1:
        # vocab_parallel_lm_head false: DeepSpeed would otherwise shard a tied output head
        # by vocabulary and leave its logits ungathered, which only its own loss reads;
        # the trainers' losses, token accuracy and entropy need the whole vocabulary.
        config["tensor_parallel"] = {"autotp_size": tensor_parallel,
                                     "vocab_parallel_lm_head": False}
        # Despite its name, the flag that makes a save gather the AutoTP shards into
        # whole weights (accelerate's get_state_dict); without it final/ holds no model.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return config


def deepspeed_dict(experiment: Experiment) -> dict[str, Any]:
    """The DeepSpeed config of a run: the user's file when given, else the generated one."""
    spec = experiment.distributed.deepspeed
    if spec.config_file:
        config, why = read(spec.config_file)  # checked by validate
        if why:
            raise RunError(f"distributed.deepspeed.config_file: {why}")
        return config
    return deepspeed_config(spec, experiment.distributed.tensor_parallel)
