"""Processes reading one local data file at the same time: each converts it into a directory
of its own (data/scratch.py), so none deletes what another is writing or reading. The
readers here are real processes, each with datasets' cache in the test's directory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY_MODEL

# alpaca rows: sft converts them with a .map, whose cache files land beside the read ones.
ROWS = [{"instruction": f"sort {i} {i + 1}", "output": f"{i} {i + 1} " * (1 + i % 7)}
        for i in range(3000)]
READER = """
import sys
from finetune.config import load_experiment
from finetune.data.load import load_data
experiment = load_experiment(sys.argv[1])
for _ in range(int(sys.argv[2])):
    splits = load_data(experiment)
    splits.train.map(lambda row: {"n": len(row)})  # as a trainer's own maps do
print("read", len(splits.train), flush=True)
"""


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_DATASETS_CACHE": str(cache), "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1"}


def _reads(cache: Path) -> list[str]:
    """The private read directories left in datasets' cache."""
    root = cache / "finetune-reads"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.fixture
def config(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    path = tmp_path / "exp.yaml"
    path.write_text(f"name: race\nmethod: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
                    f"data: {{train: {data}, eval_fraction: 0.1}}\n"
                    "training: {max_length: 32, max_steps: 2, per_device_train_batch_size: 4, "
                    "save_steps: 100, logging_steps: 1}\n")
    return path


@pytest.fixture
def processes():
    """Started processes, killed at the end whatever the test's outcome."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def _reader(config: Path, cache: Path, loops: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", READER, str(config), str(loops)],
                            env=_env(cache), cwd=config.parent, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_readers_of_one_file_at_once_all_succeed_and_leave_nothing(config, tmp_path, processes):
    # With one shared datasets directory, three readers of 12 loops each crash (a
    # FileNotFoundError on a file another one's re-read deleted) within a few loops.
    cache = tmp_path / "datasets"
    processes.extend(_reader(config, cache, 12) for _ in range(3))
    results = [(p.wait(timeout=600), *p.communicate()) for p in processes]
    for code, out, err in results:
        assert code == 0, err[-3000:]
        assert "read 2700" in out
    assert _reads(cache) == []  # each removed its directory on exit


@pytest.mark.slow
def test_cli_data_twice_beside_a_train_on_one_file(config, tmp_path, processes):
    cache = tmp_path / "datasets"
    run = lambda *args: subprocess.Popen(
        [sys.executable, "-m", "finetune", *args], env=_env(cache), cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # data.cache false: training reads the data mapped from its read directory throughout.
    processes.extend([run("train", str(config), "data.cache=false"),
                      run("data", str(config)), run("data", str(config))])
    for process in processes:
        code = process.wait(timeout=600)
        out, err = process.communicate()
        assert code == 0, (process.args, out[-2000:], err[-3000:])
    assert (tmp_path / "runs" / "race" / "final").is_dir()
    assert _reads(cache) == []


@pytest.mark.slow
def test_a_killed_readers_directory_is_removed_by_the_next_read(config, tmp_path, processes):
    cache = tmp_path / "datasets"
    killed = _reader(config, cache, 1000)
    processes.append(killed)
    deadline = time.time() + 300
    while not _reads(cache) and time.time() < deadline:
        time.sleep(0.2)
    (left,) = _reads(cache)
    assert left.startswith(f"{socket.gethostname()}.{killed.pid}.")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert _reads(cache) == [left]  # no exit handler ran
    # Another host's directory on a shared file system is its host's to remove.
    elsewhere = cache / "finetune-reads" / f"other-host.{killed.pid}.abc123"
    elsewhere.mkdir()
    result = subprocess.run([sys.executable, "-c", READER, str(config), "1"], env=_env(cache),
                            cwd=tmp_path, text=True, capture_output=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _reads(cache) == [elsewhere.name]

