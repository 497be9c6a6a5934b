"""bench/: the GPU memory meter against a scripted `nvidia-smi` (a real executable on PATH,
run as the meter runs it), and the dense data preset. No GPU needed."""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import make_data  # noqa: E402
import meter  # noqa: E402
import table  # noqa: E402

FAKE = """#!{python}
import sys, time
state = {state!r}
def now():
    return open(state).read().strip()
if "-lms" in sys.argv:
    while True:
        print(now(), flush=True)
        time.sleep(0.1)
print(now())
"""


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """set(mib): what the fake device reports as used from now on."""
    state = tmp_path / "used_mib"
    state.write_text("500")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(FAKE.format(python=sys.executable, state=str(state)))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    return state


def _child(state, steps) -> list[str]:
    """A contender that sets the device's used memory through the run."""
    script = "; ".join(f"open({str(state)!r}, 'w').write('{mib}'); __import__('time').sleep({s})"
                       for mib, s in steps)
    return [sys.executable, "-c", script]


@pytest.mark.slow
def test_peak_is_above_idle_even_after_a_neighbour_that_still_holds_memory(gpu, tmp_path):
    idle = meter.gpu_used_mib()
    assert idle == 500
    # The previous contender's memory is still held for a moment after it exited: a
    # baseline taken now (as the first H100 run did) would leave this run ~0.
    gpu.write_text("10500")
    threading.Timer(0.6, lambda: gpu.write_text("500")).start()
    started = time.monotonic()
    code, memory = meter.run_measured(_child(gpu, [(8500, 0.6), (500, 0)]),
                                      tmp_path / "log", {}, tmp_path, 60, gpu_idle_mib=idle)
    assert code == 0 and time.monotonic() - started >= 0.6  # it waited for the release
    assert memory["peak_mem_bytes"] == 8000 * 2**20 and "peak_mem_note" not in memory


def test_a_run_seen_using_nothing_reads_n_a_not_zero(gpu, tmp_path):
    code, memory = meter.run_measured(_child(gpu, [(500, 0.3)]), tmp_path / "log", {},
                                      tmp_path, 60, gpu_idle_mib=500)
    assert code == 0 and memory["peak_mem_bytes"] is None
    assert "sampling failure" in memory["peak_mem_note"]
    summary = table.summarize([{"contender": "finetune", "repeat": 0, "result": {
        "tokens_per_s": 1.0, "s_per_step": 1.0, "tokens": 1, "steps": 1, **memory}}])
    assert table.rows(summary)[1][5] == "n/a"


def test_without_nvidia_smi_there_is_no_reading(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert meter.gpu_used_mib() is None
    assert meter.gpu_peak(None, 500, None)["peak_mem_bytes"] is None


def test_dense_rows_sit_near_max_length():
    lengths = make_data.target_lengths(2000, 256, 1.0, 20, 2048, random.Random(0), "dense")
    assert min(lengths) >= 0.75 * 2048 and max(lengths) <= 2048
    assert abs(sorted(lengths)[1000] - make_data.typical_length("dense", 256, 2048)) < 30
    lognormal = make_data.target_lengths(2000, 256, 1.0, 20, 2048, random.Random(0))
    assert sorted(lognormal)[1000] < 400
