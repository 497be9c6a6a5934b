"""SLURM for real: the suite starts a two-node cluster on this machine (tests/slurm/
cluster.sh; Debian's slurm-wlm and munge) and submits the jobs `finetune slurm` writes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA, REPO, TINY_MODEL, free_port, run_cli

# One cluster per machine (tests/slurm/cluster.sh): its tests run on one xdist worker, in turn.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]  # a cluster, jobs that train

CLUSTER = REPO / "tests" / "slurm" / "cluster.sh"


# Session scope: started once per worker and stopped when the worker ends, never between two
# of these tests (their xdist group keeps them on one worker: test_suite_tools).
@pytest.fixture(scope="session")
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


STEPS = 150


def experiment(name: str, local: bool = False) -> str:
    processes = "num_processes: 2, " if local else ""
    return (f"name: {name}\nmethod: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
            f"data:\n  train: {{path: {DATA}/sft_train.jsonl, max_samples: 16}}\n"
            f"distributed: {{strategy: ddp, device: cpu, {processes}"
            f"main_process_port: {free_port()}}}\n"
            "evaluation: {before_training: false}\noutput: {plot: false}\n"
            f"training: {{max_steps: {STEPS}, per_device_train_batch_size: 2, optim: sgd, "
            "learning_rate: 0.1, max_grad_norm: 0.0, save_steps: 25, seed: 9, "
            "activation_checkpointing: false, logging_steps: 1}\n")


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> Path:
    """The same training as one local launch of 2 processes, never interrupted."""
    cwd = tmp_path_factory.mktemp("local")
    config = cwd / "local.yaml"
    config.write_text(experiment("local", local=True))
    result = run_cli("launch", str(config), cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "runs" / "local"


def submit(config: Path, cwd: Path) -> str:
    result = run_cli("slurm", str(config), "--nodes", "2", "--time", "00:10:00", "--submit",
                     "--partition", "debug", cwd=cwd)
    assert result.returncode == 0, result.stderr
    return re.search(r"submitted job (\d+)", result.stdout).group(1)


def state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    match = re.search(r"JobState=(\w+)", out)
    return match.group(1) if match else "UNKNOWN"


def wait_for(condition, seconds: float, every: float = 0.5) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return False


def steps_logged(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return 0
    return sum('"loss"' in line for line in metrics.read_text().splitlines())


def usr1(job: str) -> None:
    """What --signal=USR1@N does before the time limit: USR1 to the srun steps (our tasks),
    not the batch shell."""
    subprocess.run(["scancel", "--signal=USR1", job], check=True)


def scontrol_requeue(job: str) -> None:
    """An operator's requeue: SIGTERM to the tasks, SLURM requeues the job itself."""
    subprocess.run(["scontrol", "requeue", job], check=True)


def test_a_job_interrupted_three_ways_resumes_each_time_and_ends_as_one_run(
        cluster, write, tmp_path, uninterrupted):
    """One 2-node job, stopped in each way a cluster stops a job, in turn: USR1 before the
    time limit (finetune saves and requeues the job), `scontrol requeue` (SIGTERM; SLURM
    requeues), preemption by a higher-priority partition (preempt_send_user_signal: USR1
    first). Each time both ranks save, the job is requeued and resumes from the checkpoint;
    it ends bitwise equal to the local run, every step logged once.

    Over 2 minutes: four job starts of two ranks each (cold interpreters under srun), the
    scheduler's 2 s passes, SLURM's wait before a requeued job may start again (10 s,
    cred_expire) three times, and 150 steps: enough that each interrupt lands mid-run."""
    high = []

    def preempt(job: str) -> None:
        result = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N2", "--exclusive",
                                 "--time=1", f"--output={tmp_path}/high-%j.out", "--wrap",
                                 "echo high ran"], capture_output=True, text=True, check=True)
        high.append(result.stdout.strip())

    name = "interrupted"
    job = submit(write(f"{name}.yaml", experiment(name)), tmp_path)
    run = tmp_path / "runs" / name
    log_file = run / f"slurm-{job}.out"
    log = lambda: log_file.read_text(errors="replace") if log_file.exists() else "no log yet"
    try:
        for restart, interrupt in enumerate((usr1, scontrol_requeue, preempt)):
            # Running again (from its checkpoint after the first), and a few steps in.
            assert wait_for(lambda: f"restart {restart} on" in log() and log().count(
                "finetune: resuming from") >= restart, 240, every=0.05), log()[-3000:]
            base = steps_logged(run)
            assert wait_for(lambda: steps_logged(run) >= base + 3, 240, every=0.05), \
                log()[-3000:]
            interrupt(job)
        # Finished is COMPLETED and the run's last line in its log: the state alone once read
        # COMPLETED before the requeued job had started again.
        assert wait_for(lambda: state(job) in ("FAILED", "CANCELLED") or (
            state(job) == "COMPLETED" and "finetune: done" in log()), 300), \
            f"{state(job)}\n{log()[-3000:]}"
        assert state(job) == "COMPLETED", log()[-4000:]
    finally:
        subprocess.run(["scancel", job])
    text = log()
    assert all(f"restart {n} on" in text for n in range(4)), text[-4000:]
    assert "machine 0 runs" in text and "machine 1 runs" in text
    assert "x 2 process(es)" in text and "finetune: done" in text
    assert len(re.findall(r"finetune: resuming from .*checkpoint-\d+", text)) >= 3, text[-4000:]
    # USR1 (the time limit, then the preemption) and SIGTERM (the requeue), on both ranks
    assert all(text.count(f"rank {r} received SIGUSR1") >= 2 for r in (0, 1)), text[-4000:]
    assert "rank 0 received SIGTERM" in text and "rank 1 received SIGTERM" in text
    assert re.search(r"finetune: checkpoint saved \(.*\); requeueing job", text)
    assert state(high[0]) == "COMPLETED"
    a = load_file(run / "final" / "model.safetensors")
    b = load_file(uninterrupted / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a), "weights differ from the local run"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text()
             .splitlines() if '"loss"' in line]
    assert steps == list(range(1, STEPS + 1))  # nothing skipped, nothing repeated
    script = (run / "job.sbatch").read_text()
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=USR1@120" in script


def test_a_hostile_run_directory_reaches_sbatch_whole(cluster, tmp_path):
    """sbatch reads #SBATCH lines itself (quotes stripped, % a file name pattern): the
    job's log lands in the run directory as named, and nothing in the name runs. Near 60 s:
    a job of two steps, but a real submission, start and teardown (the cluster stops after
    this, the module's last test)."""
    run = tmp_path / "x $(touch PWNED) `touch PWNED`; '\"#*%j&|<>" / "run"
    config = tmp_path / "hostile.yaml"
    config.write_text(experiment("hostile").replace(f"max_steps: {STEPS}", "max_steps: 2")
                      .replace("output: {plot: false}",  # JSON is a YAML flow mapping
                               f"output: {json.dumps({'dir': str(run), 'plot': False})}"))
    result = run_cli("slurm", str(config), "--nodes", "1", "--time", "5", "--submit",
                     "--partition", "debug", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    job = re.search(r"submitted job (\d+)", result.stdout).group(1)
    try:
        assert wait_for(lambda: state(job) in ("COMPLETED", "FAILED", "CANCELLED"), 240)
    finally:
        subprocess.run(["scancel", job])
    log = run / f"slurm-{job}.out"
    assert state(job) == "COMPLETED" and log.is_file(), sorted(p.name for p in run.iterdir())
    assert "finetune: done" in log.read_text()
    assert not list(tmp_path.rglob("PWNED"))
