"""SLURM for real: the suite starts a two-node cluster on this machine (tests/slurm/
cluster.sh; Debian's slurm-wlm and munge) and submits the jobs `finetune slurm` writes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA, REPO, TINY_MODEL, run_cli

CLUSTER = REPO / "tests" / "slurm" / "cluster.sh"


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("SLURM tests need root to start slurmctld/slurmd (not root here)")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("SLURM tests need slurm-wlm installed, or apt-get to install it")
    started = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True,
                             timeout=600)
    assert started.returncode == 0, started.stdout + started.stderr
    yield
    subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, timeout=120)


def experiment(max_steps: int) -> str:
    return (f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
            f"data:\n  train: {{path: {DATA}/sft_train.jsonl, max_samples: 16}}\n"
            "distributed: {strategy: ddp, device: cpu, main_process_port: 29631}\n"
            "evaluation: {before_training: false}\noutput: {plot: false}\n"
            f"training: {{max_steps: {max_steps}, per_device_train_batch_size: 2, optim: sgd, "
            "learning_rate: 0.1, max_grad_norm: 0.0, save_strategy: 'no', seed: 9, "
            "activation_checkpointing: false, logging_steps: 1}\n")


def submit(config: Path, cwd: Path) -> str:
    result = run_cli("slurm", str(config), "--nodes", "2", "--time", "00:10:00", "--submit",
                     cwd=cwd)
    assert result.returncode == 0, result.stderr
    return re.search(r"submitted job (\d+)", result.stdout).group(1)


def state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    match = re.search(r"JobState=(\w+)", out)
    return match.group(1) if match else "UNKNOWN"


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(1)
    return False


def test_two_node_job_trains_like_two_local_processes(cluster, write, tmp_path):
    config = write("slurm2.yaml", experiment(max_steps=3))
    job = submit(config, tmp_path)
    assert wait_for(lambda: state(job) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300)
    run = tmp_path / "runs" / "slurm2"
    log = (run / f"slurm-{job}.out").read_text()
    assert state(job) == "COMPLETED", log[-3000:]
    script = (run / "job.sbatch").read_text()
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=USR1@120" in script
    assert "machine 0 runs" in log and "machine 1 runs" in log
    assert "x 2 process(es)" in log and "finetune: done" in log

    local = write("local2.yaml", experiment(max_steps=3).replace("device: cpu,",
                                                                 "device: cpu, num_processes: 2,"))
    result = run_cli("launch", str(local), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    a = load_file(run / "final" / "model.safetensors")
    b = load_file(tmp_path / "runs" / "local2" / "final" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


def test_usr1_reaches_the_training_processes_on_both_nodes(cluster, write, tmp_path):
    config = write("signal.yaml", experiment(max_steps=100_000))
    job = submit(config, tmp_path)
    log_file = tmp_path / "runs" / "signal" / f"slurm-{job}.out"
    metrics = tmp_path / "runs" / "signal" / "metrics.jsonl"
    try:
        assert wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, 180), \
            log_file.read_text()[-3000:] if log_file.exists() else "no log"
        # Like --signal=USR1@N: to the srun steps (our tasks), not the batch shell.
        subprocess.run(["scancel", "--signal=USR1", job], check=True)
        assert wait_for(lambda: all(f"rank {r} received SIGUSR1" in log_file.read_text()
                                    for r in (0, 1)), 60), log_file.read_text()[-3000:]
        assert state(job) == "RUNNING"  # a notice, not a kill: the launchers ignore it
    finally:
        subprocess.run(["scancel", job])
