"""What the GPU tests share: the CLI in a subprocess with a hang timeout that kills the whole
process group (`finetune launch` has workers), and OBSERVE, the CLI run in a process that
records what only the process itself can see."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import QUICKSTART

SFT = QUICKSTART / "sft.yaml"
TINY_CONFIG = json.loads((QUICKSTART / "tiny-llama" / "config.json").read_text())
CUDA = "distributed.device=cuda"
_RECORDS = itertools.count()

# The CLI itself, in this process: `python -c OBSERVE RECORD.json finetune-arguments...`.
# Nothing is patched into what runs; it records, into RECORD.json at exit:
# - max_memory_allocated: torch.cuda.max_memory_allocated() of the process (0 where CUDA
#   was never used): what `finetune estimate` is held to, and proof a command ran on CUDA;
# - linear: every torch.nn.Linear of the model as Trainer.train starts (name, class, its
#   weight's class, dtype and device): what QLoRA really trains on.
OBSERVE = r"""
import atexit, json, sys
import torch
import transformers

record_file, argv = sys.argv[1], sys.argv[2:]
seen = {}

def write():
    seen["max_memory_allocated"] = (torch.cuda.max_memory_allocated()
                                    if torch.cuda.is_initialized() else 0)
    with open(record_file, "w") as f:
        json.dump(seen, f)

atexit.register(write)
train = transformers.Trainer.train

def observed_train(self, *args, **kwargs):
    seen["linear"] = [
        {"name": name, "class": f"{type(m).__module__}.{type(m).__qualname__}",
         "weight": type(m.weight).__name__, "dtype": str(m.weight.dtype),
         "device": m.weight.device.type}
        for name, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)]
    return train(self, *args, **kwargs)

transformers.Trainer.train = observed_train
from finetune.cli import main
sys.exit(main(argv))
"""


def run(command: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """`command` in its own process group; past `timeout` (a hang: every command here
    takes a fraction of it) the whole group is killed and the test fails with the output."""
    process = subprocess.Popen([str(c) for c in command], cwd=cwd, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"hung: no end after {timeout} s: {' '.join(map(str, command))}\n"
                    f"{stdout[-2000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def finetune(*args, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """`python -m finetune ARGS`, as a user runs it; exit 0 asserted."""
    result = run([sys.executable, "-m", "finetune", *args], cwd, timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def observed(*args, cwd: Path, timeout: int) -> tuple[subprocess.CompletedProcess, dict]:
    """The CLI under OBSERVE; exit 0 asserted. (result, the record)."""
    record = Path(cwd) / f"observed-{next(_RECORDS)}.json"
    result = run([sys.executable, "-c", OBSERVE, record, *args], cwd, timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, json.loads(record.read_text())


def losses(run_dir: Path) -> list[float]:
    """The training loss of every logged step (metrics.jsonl)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def finite(values) -> bool:
    return all(isinstance(v, float) and math.isfinite(v) for v in values)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
