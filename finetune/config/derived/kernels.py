"""What a machine can run, for the choices `auto` makes: its GPU's compute capability and
native bf16, whether flash-attn imports, whether torch's varlen kernel takes what
finetune_varlen passes, and which model types Liger patches.

`installed()` reads it torch-free from what is installed (validate, render, estimate on a
login node: the GPU is not known there and is assumed Ampere or newer); the worker and
`finetune env` measure it on the GPU itself (hardware.py `measure_kernels`), so a
fallback is decided where the hardware is seen, and said in the start summary.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

# Flash attention kernels (flash-attn 2, torch's varlen kernel) need Ampere or newer.
FLASH_CAPABILITY = (8, 0)
# What torch's varlen_attn must take for `auto` to pick finetune_varlen: window_size,
# for causal and sliding-window attention (torch 2.10's has only is_causal). What else
# its signature lacks, the glue makes up for (model/varlen.py Kernel.call: a scale is
# folded into the queries, kv heads repeated without enable_gqa).
VARLEN_NEEDS = ("window_size",)
NOT_INSTALLED = "flash_attn is not installed"


@dataclass(frozen=True)
class Kernels:
    flash_attn: str | None           # why flash_attn cannot run here; None: it can
    varlen: str | None               # why torch's varlen kernel cannot run finetune_varlen
    liger: frozenset[str] | None     # model types liger-kernel patches; None: not usable
    liger_broken: str | None = None  # why an installed liger-kernel is not usable
    gpu: str | None = None           # the GPU's name, where measured
    capability: tuple[int, int] | None = None  # None: not measured (assumed Ampere or newer)
    bf16: bool | None = None         # the GPU computes bf16 natively; None: not measured

    @property
    def flash_capable(self) -> str | None:
        """Why this GPU runs no flash kernel, or None (unmeasured: assumed it does)."""
        if self.capability is None or self.capability >= FLASH_CAPABILITY:
            return None
        major, minor = self.capability
        return (f"{self.gpu or 'this GPU'} has compute capability {major}.{minor}; flash "
                f"attention kernels need {FLASH_CAPABILITY[0]}.{FLASH_CAPABILITY[1]} (Ampere)")

    def liger_patches(self, model_type: str | None) -> bool:
        """use_liger_kernel changes this model: Liger patches only the architectures it
        knows (others train unchanged, logits and all)."""
        return self.liger is not None and model_type in self.liger


@lru_cache(maxsize=1)
def installed() -> Kernels:
    """What the installed packages offer, read without importing torch."""
    flash = None if find_spec("flash_attn") is not None else NOT_INSTALLED
    return Kernels(flash_attn=flash, varlen=varlen_problem(varlen_parameters(_torch_varlen())),
                   liger=liger_model_types())


def _package_file(package: str, *parts: str) -> Path | None:
    """A file of an installed package, found without importing it."""
    try:
        spec = find_spec(package)
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root).joinpath(*parts)
        if path.is_file():
            return path
    return None


def _torch_varlen() -> Path | None:
    return _package_file("torch", "nn", "attention", "varlen.py")


def _function_parameters(path: Path, name: str) -> frozenset[str] | None:
    """The parameter names of a module-level function, read from the source."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            args = node.args
            return frozenset(a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs))
    return None


def varlen_parameters(path: Path | None) -> frozenset[str] | None:
    """torch.nn.attention.varlen.varlen_attn's parameters; None: torch has none (< 2.10)."""
    return None if path is None else _function_parameters(path, "varlen_attn")


def varlen_problem(parameters: frozenset[str] | None) -> str | None:
    """Why finetune_varlen cannot call torch's varlen kernel with these parameters."""
    if parameters is None:
        return f"torch {_version('torch')} has no torch.nn.attention.varlen (needs 2.11)"
    missing = [name for name in VARLEN_NEEDS if name not in parameters]
    if missing:
        return (f"torch {_version('torch')}'s varlen_attn takes no {', '.join(missing)} "
                "(needs torch 2.11)")
    return None


def liger_model_types(path: Path | None = None) -> frozenset[str] | None:
    """The model types liger-kernel patches (its MODEL_TYPE_TO_APPLY_LIGER_FN, read from
    the source: importing it imports torch and triton). None: liger is not installed;
    empty: installed, but the table was not found (nothing is assumed patched)."""
    path = path or _package_file("liger_kernel", "transformers", "monkey_patch.py")
    if path is None:
        return None
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return frozenset()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "MODEL_TYPE_TO_APPLY_LIGER_FN"
                   for t in targets):
                return frozenset(k.value for k in node.value.keys
                                 if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return frozenset()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "(not installed)"
