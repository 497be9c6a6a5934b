"""Experiment -> DeepSpeed JSON. Batch size, accumulation, clipping and precision are
"auto": transformers fills them from the training arguments, which stay the one source
of truth. A hand-written file is checked against the experiment instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune.config.schema import DeepSpeedSection, Experiment
from finetune.config.trl_fields import training_value


def _offload(device: str, nvme_path: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        spec["nvme_path"] = nvme_path
    return spec


def deepspeed_config(ds: DeepSpeedSection) -> dict[str, Any]:
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
    return {
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


def deepspeed_dict(experiment: Experiment) -> dict[str, Any]:
    """The DeepSpeed config of a run: the user's file when given, else the generated one."""
    spec = experiment.distributed.deepspeed
    if spec.config_file:
        return json.loads(Path(spec.config_file).read_text())
    return deepspeed_config(spec)


def contradictions(config: dict[str, Any], experiment: Experiment, where: str,
                   precision: str | None = None) -> list[str]:
    """Values in a hand-written DeepSpeed config that disagree with the experiment."""
    found = []

    def ours(key: str):
        return training_value(experiment.method, experiment.training, key)

    def differs(key: str, theirs: Any, ours: Any, owner: str) -> None:
        if theirs not in (None, "auto") and theirs != ours:
            found.append(f"{where}: {key} is {theirs!r}, but the experiment's {owner} is {ours!r}")

    stage = config.get("zero_optimization", {}).get("stage")
    differs("zero_optimization.stage", stage, experiment.distributed.deepspeed.zero_stage,
            "distributed.deepspeed.zero_stage")
    differs("train_micro_batch_size_per_gpu", config.get("train_micro_batch_size_per_gpu"),
            ours("per_device_train_batch_size"), "training.per_device_train_batch_size")
    differs("gradient_accumulation_steps", config.get("gradient_accumulation_steps"),
            ours("gradient_accumulation_steps"), "training.gradient_accumulation_steps")
    differs("gradient_clipping", config.get("gradient_clipping"),
            ours("max_grad_norm"), "training.max_grad_norm")
    offload = config.get("zero_optimization", {}).get("offload_optimizer", {})
    if offload.get("device", "none") != "none" and "optimizer" not in config and \
            config.get("zero_force_ds_cpu_optimizer", True) is not False:
        found.append(f"{where}: optimizer offload without zero_force_ds_cpu_optimizer: false "
                     "silently replaces training.optim with DeepSpeedCPUAdam; add that key")
    precision = precision or experiment.precision
    if precision != "auto":
        for kind in ("bf16", "fp16"):
            enabled = config.get(kind, {}).get("enabled")
            differs(f"{kind}.enabled", enabled, precision == kind, f"precision ({precision})")
    return found
