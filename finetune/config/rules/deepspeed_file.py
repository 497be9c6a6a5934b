"""A hand-written DeepSpeed JSON (distributed.deepspeed.config_file), as config/derived/deepspeed.py
reads it, checked against the experiment, whose training arguments stay the source of
truth for batch, accumulation, clipping and precision. Torch-free."""

from __future__ import annotations

from typing import Any

from finetune.config.derived.deepspeed import read
from finetune.config.derived.effective import value
from finetune.config.schema import Experiment


def contradictions(config: dict[str, Any], experiment: Experiment, where: str,
                   precision: str | None = None) -> list[str]:
    """Values in a hand-written DeepSpeed config (as `read` returned it) that disagree
    with the experiment."""
    found = []

    def ours(key: str):
        return value(experiment, key)

    def differs(key: str, theirs: Any, ours: Any, owner: str) -> None:
        if theirs not in (None, "auto") and theirs != ours:
            found.append(f"{where}: {key} is {theirs!r}, but the experiment's {owner} is {ours!r}")

    zero = config.get("zero_optimization", {})
    differs("zero_optimization.stage", zero.get("stage"),
            experiment.distributed.deepspeed.zero_stage, "distributed.deepspeed.zero_stage")
    differs("train_micro_batch_size_per_gpu", config.get("train_micro_batch_size_per_gpu"),
            ours("per_device_train_batch_size"), "training.per_device_train_batch_size")
    differs("gradient_accumulation_steps", config.get("gradient_accumulation_steps"),
            ours("gradient_accumulation_steps"), "training.gradient_accumulation_steps")
    differs("gradient_clipping", config.get("gradient_clipping"),
            ours("max_grad_norm"), "training.max_grad_norm")
    tensor = config.get("tensor_parallel", {})
    tp = experiment.distributed.tensor_parallel
    autotp = tensor.get("autotp_size", 1) if isinstance(tensor, dict) else 1
    if autotp != tp:
        found.append(f"{where}: tensor_parallel.autotp_size is {autotp!r}, but the "
                     f"experiment's distributed.tensor_parallel is {tp}")
    if tp > 1 and zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
        found.append(f"{where}: tensor parallelism needs zero_optimization."
                     "stage3_gather_16bit_weights_on_model_save: true (it gathers the shards "
                     "into the whole model that final/ and the checkpoints hold)")
    offload = zero.get("offload_optimizer", {})
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


def problems(experiment: Experiment, path: str, precision: str | None = None) -> list[str]:
    """Why the file cannot run this experiment: unreadable, or contradicting it."""
    config, why = read(path)
    return [why] if why else contradictions(config, experiment, path, precision)
