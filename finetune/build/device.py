"""Device and precision, resolved once per run from the experiment and the hardware."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune.config.schema import Experiment
from finetune.errors import RunError


@dataclass(frozen=True)
class Hardware:
    device: str      # "cpu" or "cuda"
    precision: str   # "bf16", "fp16" or "fp32"

    @property
    def dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.precision]


def resolve_hardware(experiment: Experiment) -> Hardware:
    cuda = torch.cuda.is_available()
    device = experiment.distributed.device
    if device == "auto":
        device = "cuda" if cuda else "cpu"
    elif device == "cuda" and not cuda:
        raise RunError("distributed.device is cuda, but no CUDA device is visible here")

    precision = experiment.precision
    bf16_ok = device == "cpu" or torch.cuda.is_bf16_supported()
    if precision == "auto":
        precision = "fp32" if device == "cpu" else ("bf16" if bf16_ok else "fp16")
    elif precision == "fp16" and device == "cpu":
        raise RunError("precision fp16 needs a CUDA device; this run is on the CPU "
                       "(use fp32, or bf16)")
    elif precision == "bf16" and not bf16_ok:
        name = torch.cuda.get_device_name()
        raise RunError(f"precision bf16 is not supported by {name}; use fp16 or auto")
    return Hardware(device=device, precision=precision)
