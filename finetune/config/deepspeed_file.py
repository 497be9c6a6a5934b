"""A hand-written DeepSpeed JSON (distributed.deepspeed.config_file): read safely and
checked against the experiment, whose training arguments stay the source of truth for
batch, accumulation, clipping and precision. Torch-free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune.config.schema import Experiment
from finetune.config.secrets import CREDENTIALS
from finetune.config.trl_fields import training_value

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


def contradictions(config: dict[str, Any], experiment: Experiment, where: str,
                   precision: str | None = None) -> list[str]:
    """Values in a hand-written DeepSpeed config (as `read` returned it) that disagree
    with the experiment."""
    found = []

    def ours(key: str):
        return training_value(experiment.method, experiment.training, key)

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
