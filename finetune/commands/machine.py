"""What this machine offers a run: `finetune env` (named as `accelerate env`, `trl env`).
Versions, the GPUs, and what a run here with every setting auto would use (device,
precision, attention, Liger, bitsandbytes, flash-attn), each with its reason, and the pip
command for what is missing or broken. `--json` gives the same facts, for bug reports.

Torch-free at import: the CLI builds every parser at start. `facts()` gathers the
torch-free facts first, imports torch only when it is installed, and reports a torch that
fails to import instead of raising. The decisions are the run's own functions
(launch/probe.py, config/derived/effective.py and attention.py, model/hardware.py), not
copies."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from importlib import metadata
from types import SimpleNamespace
from typing import Any, Mapping

GPU_EXTRA = 'pip install -e ".[gpu]"'  # liger-kernel and bitsandbytes (pyproject.toml)
FLASH_INSTALL = "MAX_JOBS=4 pip install flash-attn --no-build-isolation"
# A flash-attn built for another torch: build it again, not from pip's cached wheel.
FLASH_REBUILD = f"pip uninstall -y flash-attn && {FLASH_INSTALL} --no-cache-dir"
# resolve_precision reads only an experiment's precision: one that leaves it auto.
AUTO = SimpleNamespace(precision="auto")
# The decisions as they print, with their labels.
SHOWN = {"device": "device", "precision": "precision", "attention": "attention",
         "liger": "liger-kernel", "bitsandbytes": "bitsandbytes", "flash_attn": "flash-attn"}


def add_commands(commands) -> None:
    env = commands.add_parser(
        "env", help="show versions, GPUs and what a run here would use",
        description="Print the versions of finetune and its stack, this machine's GPUs, "
                    "and what a run here with every setting auto would use (device, "
                    "precision, attention, Liger, bitsandbytes, flash-attn) and why, with "
                    "the pip command for anything missing or broken.")
    env.add_argument("--json", action="store_true",
                     help="print the same facts as one JSON object (for bug reports)")
    env.set_defaults(func=command)


def command(args) -> int:
    found = facts()
    print(json.dumps(found, indent=1) if args.json else render(found))
    return 0  # a machine without GPUs is a normal answer


def facts(env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    from finetune import __version__
    from finetune.launch.probe import probe_device
    from finetune.report.summary import PACKAGES

    device, why = probe_device(env)
    found: dict[str, Any] = {
        "finetune": __version__, "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "driver": _driver(env), "device": _entry(device, why)}
    found.update(_torch(found["packages"]["torch"]))
    problem = torchvision_problem()
    found["torchvision"] = _entry(None, problem, problem and TORCHVISION_FIX)
    found.update(_choices(found))
    return found


TORCHVISION_FIX = ("install the torchvision built for the installed torch (docs/install.md: "
                   "bash setup.sh --cuda or --torch-index URL installs the pair), or pip "
                   "uninstall torchvision")


def torchvision_problem() -> str | None:
    """Why torchvision, installed, does not import (it was built for another torch), else
    None. transformers imports an installed torchvision wherever it loads an image
    processor or its Trainer, so then every command that loads a model or data fails."""
    import importlib
    import importlib.util

    from finetune.errors import first_line

    version = _version("torchvision")
    if version is None or importlib.util.find_spec("torchvision") is None:
        return None
    try:
        importlib.import_module("torchvision")
    except Exception as exc:  # noqa: BLE001 - a build for another torch raises anything
        return (f"torchvision {version} is installed but does not import beside torch "
                f"{_version('torch')} ({type(exc).__name__}: {first_line(exc)}), and "
                "transformers imports it wherever it loads a model or data: "
                f"{TORCHVISION_FIX}")
    return None


def _entry(value: Any, why: str | None, fix: str | None = None) -> dict[str, Any]:
    return {"value": value, "why": why, "fix": fix}


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _driver(env: Mapping[str, str]) -> str | None:
    """The NVIDIA driver's version, from nvidia-smi when it is on PATH (a hung driver
    answers nothing: 10 s at most)."""
    found = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if not found:
        return None
    try:
        result = subprocess.run([found, "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10, errors="replace")
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = result.stdout.split()
    return lines[0] if result.returncode == 0 and lines else None


def _torch(version: str | None) -> dict[str, Any]:
    """torch's build and the GPUs it sees: the first import of torch, and only if installed."""
    from finetune.errors import first_line

    if version is None:
        return {"torch": {"build": None, "error": "torch is not installed",
                          "fix": "pip install -e ."}, "gpus": []}
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken install raises anything
        return {"torch": {"build": None, "error": f"torch does not import "
                          f"({type(exc).__name__}: {first_line(exc)})", "fix": None},
                "gpus": []}
    build = (f"CUDA {torch.version.cuda}" if torch.version.cuda else
             f"ROCm {torch.version.hip}" if torch.version.hip else "CPU build")
    gpus = []
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name,
                     "capability": f"{props.major}.{props.minor}",
                     "memory_gib": round(props.total_memory / 2**30, 1)})
    return {"torch": {"build": build, "error": None, "fix": None}, "gpus": gpus}


def _choices(found: dict[str, Any]) -> dict[str, Any]:
    """What auto decides here; on a GPU, measured on GPU 0 (hardware.measure_kernels)."""
    from finetune.config.derived.attention import resolve
    from finetune.config.derived.effective import resolve_precision
    from finetune.config.derived.kernels import installed

    device, torch_ok = found["device"]["value"], found["torch"]["error"] is None
    measured = device == "cuda" and bool(found["gpus"])
    if measured:
        from finetune.model.hardware import measure_kernels

        kernels = measure_kernels(0)
    else:
        kernels = installed()
    features = {"liger": _liger(found, kernels, measured),
                "bitsandbytes": _bitsandbytes(found, torch_ok),
                "flash_attn": _flash_attn(kernels, measured)}
    if device == "cuda" and not measured:
        return {**_unseen(found), **features}
    precision = resolve_precision(AUTO, device, kernels.bf16 is not False)
    name, why = resolve("auto", device, precision, True, kernels)
    return {"precision": _entry(precision, _precision_why(precision, kernels)),
            "attention": _entry(name or "sdpa", _attention_why(name, why, device)), **features}


def _unseen(found: dict[str, Any]) -> dict[str, Any]:
    """The driver lists a GPU that torch does not see: runs with device auto stop."""
    problem = found["torch"]["error"] or (
        f"torch {found['packages']['torch']} is a CPU build" if found["torch"]["build"]
        == "CPU build" else "torch sees no GPU (torch.cuda.is_available() is False)")
    unknown = _entry(None, f"not known: {problem}")
    return {"device": _entry("cuda", f"{found['device']['why']}; but {problem}, so runs with "
                             "distributed.device auto stop", "bash setup.sh --cuda"),
            "precision": unknown, "attention": unknown}


def _precision_why(precision: str, kernels) -> str:
    if precision == "fp32":
        return "the CPU computes in fp32"
    gpu, (major, minor) = kernels.gpu, kernels.capability
    native = "computes bf16 natively" if precision == "bf16" else "has no native bf16"
    return f"{gpu} {native} (compute capability {major}.{minor})"


def _attention_why(name: str | None, why: str | None, device: str) -> str:
    """Why auto chose it, for an sft run on padding-free batches: resolve's reason when it
    passed over a kernel, else the usual one."""
    if why:
        return why
    if name == "flash_attention_2":
        return "flash-attn imports and this GPU runs it"
    if name and device == "cpu":
        return "its reference kernel on the CPU (one sdpa per sequence, no dense mask)"
    if name:
        return "PyTorch's flash varlen kernel (no flash-attn needed)"
    return "transformers' default"


def _usable(usable: bool, why: str, fix: str | None = None) -> dict[str, Any]:
    return {"usable": usable, "why": why, "fix": fix}


def _liger(found, kernels, measured: bool) -> dict[str, Any]:
    from finetune.config.derived.kernels import installed

    version, types = found["packages"]["liger-kernel"], installed().liger
    if version is None or types is None:
        return _usable(False, "not installed (sft's fused kernels on CUDA)", GPU_EXTRA)
    patches = f"liger-kernel {version} patches {len(types)} model types"
    if not measured:
        return _usable(False, f"{patches}; runs use it on CUDA only")
    if kernels.liger_broken:  # measure_kernels tried it: installed, but does not import
        return _usable(False, kernels.liger_broken,
                       "pip install --force-reinstall --no-deps liger-kernel")
    return _usable(True, f"{patches} (use_liger_kernel is on by default for sft)")


def _bitsandbytes(found, torch_ok: bool) -> dict[str, Any]:
    if found["packages"]["bitsandbytes"] is None:
        return _usable(False, "not installed (peft.type qlora needs it)", GPU_EXTRA)
    if not torch_ok:
        return _usable(False, "bitsandbytes needs torch, which does not import")
    import logging

    from finetune.model.hardware import import_problem

    # On CPUs with AVX512-BF16 it logs at import that a faster 4-bit kernel is missing.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    problem = import_problem("bitsandbytes")
    if problem:
        return _usable(False, problem, "pip install --force-reinstall --no-deps bitsandbytes")
    return _usable(True, "imports: peft.type qlora can run")


def _flash_attn(kernels, measured: bool) -> dict[str, Any]:
    from finetune.config.derived.kernels import NOT_INSTALLED, installed

    if measured and kernels.flash_capable:  # no flash kernel runs here: nothing to install
        return _usable(False, kernels.flash_capable)
    if installed().flash_attn == NOT_INSTALLED:
        return _usable(False, "not installed (optional: without it sft runs PyTorch's "
                              "flash varlen kernel)", FLASH_INSTALL)
    if not measured:
        return _usable(False, "installed; runs use it on CUDA only")
    if kernels.flash_attn:  # measure_kernels imported it: built for another torch
        return _usable(False, kernels.flash_attn, FLASH_REBUILD)
    return _usable(True, "imports: attention auto takes flash_attention_2")


def render(found: dict[str, Any]) -> str:
    """The facts on one screen."""
    torch = found["torch"]
    lines = [f"finetune {found['finetune']}, Python {found['python']}, {found['platform']}"]
    vision = found["torchvision"]
    for name, version in found["packages"].items():
        note = f" ({torch['build'] or torch['error']})" if name == "torch" and version else ""
        if name == "torchvision" and vision["why"]:
            note = " (does not import: it was built for another torch)"
        lines += _line(name, f"{version or 'not installed'}{note}",
                       torch["fix"] if name == "torch" else
                       vision["fix"] if name == "torchvision" else None)
    lines.append(f"GPUs, NVIDIA driver {found['driver'] or 'unknown (no nvidia-smi answered)'}")
    lines += [f"  {g['index']}  {g['name']}, compute capability {g['capability']}, "
              f"{g['memory_gib']} GiB" for g in found["gpus"]] or \
        [f"  none that torch sees{' (' + torch['error'] + ')' if torch['error'] else ''}"]
    lines.append("A run here with every setting auto (sft, padding-free batches):")
    for key, label in SHOWN.items():
        item = found[key]
        head = item["value"] if "value" in item else ("yes" if item["usable"] else "no")
        lines += _line(label, f"{head or '?'}: {item['why']}", item["fix"])
    return "\n".join(lines)


def _line(label: str, text: str, fix: str | None) -> list[str]:
    return [f"  {label:<14}{text}"] + ([f"  {'':<14}fix: {fix}"] if fix else [])
