"""Shared test helpers. Everything runs offline: the tiny model and data are bundled."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# Offline, quiet, one thread per process: the CI machine has 2 cores and runs 2 tests at
# a time (pytest-xdist); more threads than cores made runs 10-50x slower.
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                  OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
MAX_WORKERS = 4  # `-n auto`: tests start 2-process runs; more workers only oversubscribe

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


def free_port() -> int:
    """A TCP port nothing listens on now, for a launch's main_process_port: tests run in
    parallel (pytest-xdist), so no two may share a fixed port. The kernel picks it from
    the ephemeral range; a run binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def jsonl(tmp_path: Path, name: str, rows: list) -> Path:
    """A JSON Lines data file of `rows` in the test's directory."""
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def turn(role: str, content) -> dict:
    """One chat message."""
    return {"role": role, "content": content}


def run_cli(*args: str, cwd: Path, timeout: int = 600,
            cold: bool = False) -> subprocess.CompletedProcess:
    """Run `finetune ARGS` as a user would, in a process of its own: forked from a warm
    interpreter started with the test's environment (tests/warm.py: the same process, less
    ~8 s of imports), or a cold `python -m finetune` with cold=True, with --cold-cli, or
    where no warm interpreter starts."""
    args = tuple(str(arg) for arg in args)
    # A torch-free command starts cold in ~1 s: it forks from a warm interpreter already
    # up for this environment, and never waits ~8 s for one to start (an `online` test).
    warm = None if cold else warm_interpreter(start=not args or args[0] not in TORCH_FREE)
    if warm is not None:
        return warm.run(list(args), cwd, timeout)
    return subprocess.run([sys.executable, "-m", "finetune", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout)


# The commands that import no torch (tests/test_layers.py); `launch`'s and `sweep`'s
# children are cold `python -m` processes either way.
TORCH_FREE = {"validate", "render", "estimate", "plot", "push", "launch", "slurm", "sweep"}
# The worker's warm interpreters by environment, the least recently used first; at most
# WARM_KEPT (a test that sets a variable, then the tests after it).
_WARM: dict = {}
WARM_KEPT = 2


def warm_interpreter(start: bool = True):
    """A WarmInterpreter started with the environment this test has now (the libraries
    read some variables at import: a child must see what a cold process would), started
    on first use (start=False: None where none is up); None with --cold-cli."""
    if _COLD[0]:
        return None
    key = frozenset((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST")
    warm = _WARM.pop(key, None)
    if warm is not None and not warm.alive():
        warm.close()
        warm = None
    if warm is None and not start:
        return None
    if warm is None:
        from warm import WarmInterpreter

        while len(_WARM) >= WARM_KEPT:
            _WARM.pop(next(iter(_WARM))).close()
        try:
            warm = WarmInterpreter()
        except RuntimeError as exc:  # the child would be cold anyway: say so, run cold
            print(f"conftest: no warm interpreter for this environment ({exc})")
            return None
    _WARM[key] = warm
    return warm


_COLD = [False]


def pytest_addoption(parser):
    parser.addoption("--cold-cli", action="store_true",
                     help="run every run_cli as a cold `python -m finetune` (no warm fork)")


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: the cores this process may use, at most MAX_WORKERS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, MAX_WORKERS))


def pytest_configure(config):
    _COLD[0] = config.getoption("--cold-cli")


def pytest_collection_modifyitems(config, items):
    """The exhaustive lane runs only when -m names it: each of its cases repeats a code path
    that a case of the default run covers (its comment says which)."""
    if "exhaustive" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("exhaustive") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


def pytest_unconfigure(config):
    for warm in _WARM.values():
        warm.close()


@pytest.fixture
def online(monkeypatch):
    """As a user with network: offline, a hub id missing from the local caches is refused
    (config/rules/models.py), and the example configs name hub models and data. Online,
    validate asks the hub about a model it has not cached: here a stand-in hub
    (tests/stand_in_hub.py) that has every model asked for; set hub.models to limit it."""
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)
    import huggingface_hub.constants

    from finetune.config.rules.models import _ask_hub

    # huggingface_hub read HF_HUB_OFFLINE when this process imported it; a CLI process
    # started now reads the variable, an in-process validate reads this copy of it.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    hub = _stand_in_hub()
    hub.models, hub.asked = None, []
    _ask_hub.cache_clear()  # a process asks once per model; each test is a new user
    # one address for the worker's whole session: a warm interpreter is kept per environment
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    return hub


_HUB = []


def _stand_in_hub():
    from stand_in_hub import StandInHub

    if not _HUB:
        _HUB.append(StandInHub())
    return _HUB[0]


@pytest.fixture
def write(tmp_path):
    """write("name.yaml", text) -> path, in the test's own directory."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    return _write
