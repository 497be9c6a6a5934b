"""Device and precision, resolved once per run from the experiment and the hardware."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from finetune.config.effective import checkpointing_setting, model_precision, resolve_precision
from finetune.config.schema import Experiment
from finetune.errors import ConfigError, RunError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Hardware:
    device: str      # "cpu" or "cuda"
    precision: str   # "bf16", "fp16" or "fp32"
    memory: int = 0  # bytes for one process: its GPU's, or its share of the host's

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype."""
        return DTYPES[self.precision]

    def model_dtype(self, experiment: Experiment, role: str) -> torch.dtype:
        """The dtype a model of the run is loaded in: role policy, reference, teacher, reward or
        value (the rule: config/effective.py model_precision)."""
        return DTYPES[model_precision(role, experiment.peft.type, self.precision)]


def resolve_hardware(experiment: Experiment) -> Hardware:
    cuda = torch.cuda.is_available()
    device = experiment.distributed.device
    if device == "auto":
        device = "cuda" if cuda else "cpu"
    elif device == "cuda" and not cuda:
        raise RunError("distributed.device is cuda, but no CUDA device is visible here")

    bf16_ok = device == "cpu" or torch.cuda.is_bf16_supported()
    precision = resolve_precision(experiment, device, bf16_ok)
    # What auto becomes always runs here; a precision set by hand may not.
    if precision == "fp16" and device == "cpu":
        raise RunError("precision fp16 needs a CUDA device; this run is on the CPU "
                       "(use fp32, or bf16)")
    if precision == "bf16" and not bf16_ok:
        name = torch.cuda.get_device_name()
        raise RunError(f"precision bf16 is not supported by {name}; use fp16 or auto")
    return Hardware(device=device, precision=precision,
                    memory=_memory(device, experiment.distributed.per_machine))


def _memory(device: str, per_machine: int) -> int:
    if device == "cuda":
        index = int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1)
        return torch.cuda.get_device_properties(index).total_memory
    import psutil

    return psutil.virtual_memory().total // max(per_machine, 1)


def checkpointing_decision(experiment: Experiment, hw: Hardware) -> tuple[bool | None, str | None]:
    """training.activation_checkpointing auto: (on, why) from the run's own memory estimate
    against this device; (None, None) when the experiment decides itself. Without an
    estimate (an architecture the estimator does not know) it stays on, the safe side."""
    from finetune.estimate import estimate

    if checkpointing_setting(experiment) != "auto":
        return None, None
    try:
        found = estimate(experiment, gpus=experiment.distributed.world_size,
                         gpu_memory=hw.memory, device=hw.device, precision=hw.precision)
    except ConfigError as exc:
        return True, ("activation checkpointing on (auto): no memory estimate for this "
                      f"model ({exc.problems[0]})")
    return found.settings.checkpointing, found.checkpointing_note
