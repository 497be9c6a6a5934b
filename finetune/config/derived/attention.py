"""Which attention a run uses, decided without importing torch: the names transformers
accepts, `auto` resolved for the device, and whether the choice runs padding-free batches
without a dense mask (the speed defaults and the estimate depend on that)."""

from __future__ import annotations

import re

from finetune.config.derived.kernels import NOT_INSTALLED, Kernels
from finetune.errors import shown

# finetune's own attention function (model/varlen.py), registered with transformers'
# AttentionInterface before a model is built: PyTorch's flash varlen kernel, no install.
VARLEN = "finetune_varlen"
# What transformers 5.x accepts by name (`["eager"] + ALL_ATTENTION_FUNCTIONS.valid_keys()`;
# tests/test_attention.py compares this with the installed transformers).
TRANSFORMERS_NAMES = ("eager", "sdpa", "flex_attention", "flash_attention_2",
                      "flash_attention_3", "flash_attention_4", "paged|eager")
NAMES = ("auto", VARLEN, *TRANSFORMERS_NAMES)
# A kernel from the hub, as transformers matches it (integrations/hub_kernels.is_kernel):
# org/repo, optionally @revision and :function.
HUB_KERNEL = re.compile(r"[^/:@\s]+/[^/:@\s]+(?:@[^/:@\s]+)?(?::[^/:@\s]+)?")
# Implementations that take a flattened batch's cu_seqlens to a varlen kernel instead of
# building a (tokens x tokens) mask.
_VARLEN_NAMES = ("flash_attention_2", "flash_attention_3", "flash_attention_4", VARLEN)


def check_name(name: str) -> str | None:
    """None if transformers (or finetune) can run `name`, else the problem."""
    if name in NAMES or HUB_KERNEL.fullmatch(name):
        return None
    return (f"{shown(name)} is not an attention implementation: use one of {', '.join(NAMES)}, "
            "or a hub kernel id (org/repo[@revision][:function], needs `pip install kernels`)")


def resolve(choice: str, device: str, precision: str, flattened: bool,
            kernels: Kernels) -> tuple[str | None, str | None]:
    """(implementation, why): model.attn_implementation with `auto` decided for the
    device and what it can run (config/derived/kernels.py). why: the reason, when auto passed over
    a kernel that was there but cannot run, or finetune_varlen set by hand runs without
    torch's kernel; else None (`note` makes it the start summary's line). flattened: the
    run would train padding-free or packed batches, given a varlen kernel for them.
    - CUDA in 16 bits, a GPU of compute capability 8.0 or newer: flash-attention 2 when
      flash_attn imports; else, for flattened batches, PyTorch's own flash varlen kernel
      (finetune_varlen) when torch's takes what it passes;
    - CPU, flattened batches: finetune_varlen with its reference kernel (one sdpa per
      sequence), faster than the dense mask sdpa would build (docs/benchmarks.md);
    - otherwise None: transformers' default, sdpa."""
    if choice == VARLEN and device == "cuda":
        unable = kernels.flash_capable or kernels.varlen or (
            precision == "fp32" and "precision fp32 (the kernel computes in 16 bits)")
        return choice, unable and ("on its reference kernel (one sdpa per sequence, "
                                   f"slow): {unable}")
    if choice != "auto":
        return choice, None
    if device == "cpu":
        return (VARLEN if flattened else None), None
    if precision not in ("bf16", "fp16"):
        return None, None
    if kernels.flash_capable is not None:
        return None, kernels.flash_capable
    if kernels.flash_attn is None:
        return "flash_attention_2", None
    broken = None if kernels.flash_attn == NOT_INSTALLED else kernels.flash_attn
    if not flattened:
        return None, broken
    if kernels.varlen is None:
        return VARLEN, broken
    return None, "; ".join(reason for reason in (broken, kernels.varlen) if reason) + \
        "; flattened batches are padded"


def note(choice: str, implementation: str | None, why: str | None) -> str | None:
    """resolve()'s reason as the start summary's line."""
    if why is None:
        return None
    return f"attention {label(implementation)} ({'auto' if choice == 'auto' else 'set'}): {why}"


def runs_varlen(implementation: str | None) -> bool:
    """Padding-free and packed batches reach a varlen kernel (no dense mask): flash
    attention, finetune's varlen function, or a hub kernel (transformers routes those
    through its flash-attention path)."""
    if implementation is None:
        return False
    return implementation in _VARLEN_NAMES or HUB_KERNEL.fullmatch(implementation) is not None


def label(implementation: str | None) -> str:
    return implementation or "sdpa"


# The module each implementation imports and its pip package; without it, transformers
# falls back to a hub build when the `kernels` package is installed.
PACKAGES = {"flash_attention_2": ("flash_attn", "flash-attn"),
            "flash_attention_3": ("flash_attn_interface", "flash-attn-3"),
            "flash_attention_4": ("flash_attn", "flash-attn-4")}


def missing_package(name: str, installed) -> str | None:
    """What to install for `name` when it cannot run (installed: module name -> bool)."""
    if name in PACKAGES and not installed(PACKAGES[name][0]) and not installed("kernels"):
        module, package = PACKAGES[name]
        return (f"{name} needs {module}, which is not installed: pip install {package} "
                "(or pip install kernels, for its hub build)")
    if name not in PACKAGES and HUB_KERNEL.fullmatch(name) and not installed("kernels"):
        return "a hub kernel needs the kernels package: pip install kernels"
    return None
