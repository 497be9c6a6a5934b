"""The GPU lane: every test under tests/gpu is marked `cuda` and `slow`, and skipped, with
the reason, where no CUDA GPU is visible. The CPU suite pays only for collecting them: the
check runs once, at collection, and only when a test of this folder was collected.

    python -m pytest -m cuda tests/gpu -q --durations=0    # on a GPU machine
    bash tools/gpu/lane.sh lane                            # the same, set up as the lane

The figures the tests measure (exact match, losses, memory, attention chosen) are printed at
the end of the run, and written as JSON to $FINETUNE_GPU_FIGURES when it is set (lane.sh
sets it), for docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from .helpers import run

HERE = Path(__file__).resolve().parent
FIGURES: dict[str, dict] = {}

# What the machine offers, asked in a fresh process: the fixture initialises no CUDA in
# the pytest process (which would hold a context's GPU memory from then on).
FACTS = r"""
import importlib.util, json, torch
out = {"torch": torch.__version__, "count": torch.cuda.device_count(),
       "name": torch.cuda.get_device_name(0),
       "capability": list(torch.cuda.get_device_capability(0)),
       "bf16": torch.cuda.is_bf16_supported(including_emulation=False)}
try:
    import flash_attn  # noqa: F401
    out["flash_attn"] = True
except Exception:
    out["flash_attn"] = False
try:
    from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    out["varlen_attn"] = True
except ImportError:
    out["varlen_attn"] = False
for module in ("bitsandbytes", "liger_kernel"):
    out[module] = importlib.util.find_spec(module) is not None
print(json.dumps(out))
"""


def _no_cuda() -> str | None:
    """Why the GPU tests cannot run here, or None."""
    try:
        import torch
    except ImportError as exc:
        return f"torch does not import ({exc})"
    if not torch.cuda.is_available():
        return f"no CUDA GPU visible (torch {torch.__version__}: torch.cuda.is_available() " \
               "is False)"
    return None


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    ours = [item for item in items if HERE in Path(item.path).parents]
    if not ours:
        return
    why = _no_cuda()
    skip = pytest.mark.skip(reason=f"{why}: tests/gpu runs on a CUDA machine "
                                   "(docs/benchmarks.md, GPU lane)") if why else None
    for item in ours:
        item.add_marker(pytest.mark.cuda)
        item.add_marker(pytest.mark.slow)
        if skip:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu(tmp_path_factory) -> dict:
    """torch, GPU name, count and capability, bf16, and which optional kernels import."""
    result = run([sys.executable, "-c", FACTS], tmp_path_factory.mktemp("facts"), 120)
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    FIGURES["machine"] = facts
    return facts


@pytest.fixture
def figures(request):
    """figures(key=value, ...): recorded under the test's name for the end of the run."""

    def record(**values):
        FIGURES.setdefault(request.node.name, {}).update(values)

    return record


def pytest_terminal_summary(terminalreporter):
    if not FIGURES:
        return
    terminalreporter.section("GPU lane figures")
    for name, values in FIGURES.items():
        terminalreporter.write_line(f"{name}: {json.dumps(values, default=str)}")
    target = os.environ.get("FINETUNE_GPU_FIGURES")
    if target:
        Path(target).write_text(json.dumps(FIGURES, indent=1, default=str) + "\n")
        terminalreporter.write_line(f"(written to {target})")
