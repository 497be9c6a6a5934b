"""`distributed.device: auto`, resolved on the machine that starts the processes, before
any file is rendered: the Accelerate file's precision and the processes' device follow
from it. Torch-free and cheap (no CUDA initialisation): NVIDIA GPUs only.

- CUDA_VISIBLE_DEVICES set to "" or to a list starting with a negative or otherwise
  invalid entry hides every GPU (CUDA stops at the first invalid entry): cpu.
- else a GPU listed by the driver in /proc/driver/nvidia/gpus/, or by `nvidia-smi -L`
  (when on PATH; 10 s at most): cuda.
- else cpu.
`finetune launch` and `finetune render` resolve here; `finetune slurm` renders on a login
node and leaves auto for `finetune launch` on each compute node. If torch then sees no GPU
(a CPU-only build next to a driver), the processes stop with an error naming
distributed.device; set it to cpu to train there anyway."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Mapping

PROC_GPUS = Path("/proc/driver/nvidia/gpus")
_VISIBLE_ENTRY = re.compile(r"[0-9]+|(?:GPU|MIG)-[0-9A-Za-z/-]+")


def _hidden(env: Mapping[str, str]) -> bool:
    mask = env.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return False
    first = mask.split(",")[0].strip()
    return not _VISIBLE_ENTRY.fullmatch(first)


def _nvidia_smi(env: Mapping[str, str]) -> int:
    found = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if not found:
        return 0
    try:
        result = subprocess.run([found, "-L"], capture_output=True, text=True, timeout=10,
                                errors="replace")
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in result.stdout.splitlines()) \
        if result.returncode == 0 else 0


def probe_device(env: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """("cuda" or "cpu", why) for this machine."""
    if _hidden(env):
        return "cpu", f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} hides every GPU"
    try:
        listed = len(list(PROC_GPUS.iterdir()))
    except OSError:
        listed = 0
    if listed:
        return "cuda", f"{listed} NVIDIA GPU(s) in {PROC_GPUS}"
    listed = _nvidia_smi(env)
    if listed:
        return "cuda", f"nvidia-smi lists {listed} GPU(s)"
    return "cpu", "no NVIDIA GPU: none in /proc/driver/nvidia, none from nvidia-smi"


def resolved_overrides(device: str) -> tuple[list[str], str | None]:
    """Overrides that resolve `device` here, and the line that says so."""
    if device != "auto":
        return [], None
    found, why = probe_device()
    return [f"distributed.device={found}"], \
        f"finetune: distributed.device auto -> {found} on this machine ({why})"
