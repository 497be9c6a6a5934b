"""Device and precision, resolved once per run from the experiment and the hardware."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Mapping

import torch

from finetune.config.derived.effective import (checkpointing_setting, model_precision,
                                               resolve_precision)
from finetune.config.derived.kernels import Kernels, installed
from finetune.config.schema import Experiment
from finetune.errors import ConfigError, RunError, first_line

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Hardware:
    device: str      # "cpu" or "cuda"
    precision: str   # "bf16", "fp16" or "fp32"
    memory: int = 0  # bytes for one process: its GPU's, or its share of the host's
    index: int | None = None  # this process's GPU (LOCAL_RANK among the visible ones)
    kernels: Kernels = field(default_factory=installed)  # what this machine runs
    notes: tuple[str, ...] = ()  # what auto chose in place of the usual, and why

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype."""
        return DTYPES[self.precision]

    def model_dtype(self, experiment: Experiment, role: str) -> torch.dtype:
        """The dtype a model of the run is loaded in: role policy, reference, teacher, reward or
        value (the rule: config/derived/effective.py model_precision)."""
        return DTYPES[model_precision(role, experiment.peft.type, self.precision)]

    @property
    def torch_device(self) -> torch.device:
        """Where this process computes: its own GPU, or the CPU."""
        return torch.device("cuda", self.index) if self.device == "cuda" else torch.device("cpu")


def local_gpu(env: Mapping[str, str], visible: int) -> int:
    """This process's GPU: its LOCAL_RANK among the visible GPUs (a launcher starts one
    process per GPU of a machine; CUDA_VISIBLE_DEVICES renumbers them from 0)."""
    return int(env.get("LOCAL_RANK", 0)) % max(visible, 1)


def measure_kernels(index: int) -> Kernels:
    """What GPU `index` and the installed packages run, tried for real: the compute
    capability, native bf16, and whether flash_attn and liger-kernel import (a build for
    another torch is found by find_spec, and fails only when imported)."""
    props = torch.cuda.get_device_properties(index)
    found = installed()
    flash = found.flash_attn if found.flash_attn is not None else import_problem("flash_attn")
    liger_broken = None if found.liger is None else import_problem("liger_kernel.transformers")
    return replace(found, gpu=props.name, capability=(props.major, props.minor),
                   bf16=torch.version.hip is not None or props.major >= 8, flash_attn=flash,
                   liger=None if liger_broken else found.liger, liger_broken=liger_broken)


def import_problem(module: str) -> str | None:
    """None if `module` imports, else why not, in one line."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a broken build raises anything
        return (f"{module.split('.')[0]} is installed but does not import "
                f"({type(exc).__name__}: {first_line(exc)}); reinstall it for torch "
                f"{torch.__version__}")
    return None


def resolve_hardware(experiment: Experiment, env: Mapping[str, str] = os.environ) -> Hardware:
    cuda = torch.cuda.is_available()
    device = experiment.distributed.device
    if device == "auto":
        device = "cuda" if cuda else "cpu"
    elif device == "cuda" and not cuda:
        raise RunError("distributed.device is cuda, but no CUDA device is visible here")
    if device == "cpu":
        precision = resolve_precision(experiment, device)
        if precision == "fp16":
            raise RunError("precision fp16 needs a CUDA device; this run is on the CPU "
                           "(use fp32, or bf16)")
        import psutil

        memory = psutil.virtual_memory().total // max(experiment.distributed.per_machine, 1)
        return Hardware(device=device, precision=precision, memory=memory)

    index = local_gpu(env, torch.cuda.device_count())
    kernels = measure_kernels(index)
    # auto takes bf16 only where the GPU computes it natively: torch's is_bf16_supported()
    # also counts emulation (pre-Ampere GPUs), which is slow and runs no flash kernel.
    precision = resolve_precision(experiment, device, kernels.bf16)
    notes = []
    if experiment.precision == "auto" and precision == "fp16":
        notes.append(f"precision fp16 (auto): {kernels.gpu} has no native bf16 (compute "
                     f"capability {kernels.capability[0]}.{kernels.capability[1]})")
    if kernels.liger_broken:
        notes.append(f"use_liger_kernel off: {kernels.liger_broken}")
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=True):
        raise RunError(f"precision bf16 is not supported by {kernels.gpu}; use fp16 or auto")
    return Hardware(device=device, precision=precision,
                    memory=torch.cuda.get_device_properties(index).total_memory, index=index,
                    kernels=kernels, notes=tuple(notes))


def checkpointing_decision(experiment: Experiment, hw: Hardware) -> tuple[bool | None, str | None]:
    """training.activation_checkpointing auto: (on, why) from the run's own memory estimate
    against this device; (None, None) when the experiment decides itself. Without an
    estimate (an architecture the estimator does not know) it stays on, the safe side."""
    from finetune.estimate import estimate

    if checkpointing_setting(experiment) != "auto":
        return None, None
    try:
        found = estimate(experiment, gpus=experiment.distributed.world_size,
                         gpu_memory=hw.memory, device=hw.device, precision=hw.precision,
                         kernels=hw.kernels)
    except ConfigError as exc:
        return True, ("activation checkpointing on (auto): no memory estimate for this "
                      f"model ({exc.problems[0]})")
    return found.settings.checkpointing, found.checkpointing_note
