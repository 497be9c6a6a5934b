"""The suite's own machinery, which the rest of it trusts: xdist groups keep a group's tests on
one worker, and a warm child is a real process whose signals reach it and no other."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import REPO, warm_interpreter

GROUPED = """
import os, pytest
pytestmark = pytest.mark.xdist_group("shared")
def test_{n}(): open(os.environ["WORKERS"], "a").write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


@pytest.mark.slow  # a pytest of its own with two workers: ~5 s
def test_an_xdist_group_runs_on_one_worker(tmp_path):
    """pytest 9.2's structured node ids dropped xdist 3.8's group suffix without a word
    (pytest-xdist issue 1386): every group silently spread over the workers, and a SLURM
    cluster or a module fixture was torn down and started again mid-group."""
    for n in range(6):
        (tmp_path / f"test_{n}.py").write_text(GROUPED.format(n=n))
    workers = tmp_path / "workers.txt"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist",
         "loadgroup", "-q", "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "WORKERS": str(workers)}, capture_output=True,
        text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "6 passed" in result.stdout
    assert len(set(workers.read_text().split())) == 1, workers.read_text()


@pytest.mark.slow
def test_a_warm_child_is_a_process_of_its_own(tmp_path):
    warm = warm_interpreter()
    if warm is None:
        pytest.skip("--cold-cli: no warm interpreter")
    config = REPO / "configs" / "quickstart" / "sft.yaml"
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    done = warm.start(["validate", str(config)], tmp_path, out, err)
    assert done.wait(300) == 0, err.read_text()[-3000:]
    assert "sft.yaml: ok (sft," in out.read_text(), out.read_text()  # its stdout, in its file
    assert not done.running()
    done.kill()  # ended and reported: a no-op, never a signal to whoever has its pid now

    # A child stopped by a signal reports it as Popen does (-signal).
    child = warm.start(["train", str(config), "training.max_steps=100000",
                        f"output.dir={tmp_path / 'run'}"], tmp_path, out, out)
    assert child.pid not in (os.getpid(), warm.server.pid) and child.running()
    child.send_signal(signal.SIGKILL)
    assert child.wait(300) == -signal.SIGKILL
    assert not child.running()
