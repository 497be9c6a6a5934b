"""Shared test helpers. Everything runs offline: the tiny model and data are bundled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Offline, quiet, one thread per process: the CI machine has 2 cores.
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                  OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "configs" / "quickstart"
TINY_MODEL = QUICKSTART / "tiny-llama"
DATA = QUICKSTART / "data"
# The smallest valid experiment: sft on the tiny model and the quickstart data.
MINIMAL_SFT = f"""\
method: sft
model:
  name_or_path: {TINY_MODEL}
  init: random
data:
  train: {DATA}/sft_train.jsonl
"""


def run_cli(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `finetune ARGS` as a user would, in a subprocess."""
    return subprocess.run([sys.executable, "-m", "finetune", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture
def online(monkeypatch):
    """As a user with network: offline, a hub id missing from the local caches is refused
    (config/models.py), and the example configs name hub models and data."""
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)


@pytest.fixture
def write(tmp_path):
    """write("name.yaml", text) -> path, in the test's own directory."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    return _write
