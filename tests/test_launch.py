"""Launching for real: several processes on CPU, two "machines" on loopback, the
ecosystem's own `accelerate launch`, and the launches that would silently train wrong."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import DATA, REPO, TINY_MODEL, free_port, run_cli
from resumable import Run, Terminal
from finetune.rundir import checkpoints
from finetune.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_SAVE_TIMEOUT

pytestmark = pytest.mark.slow  # several processes launched for real


def experiment(distributed: str, extra: str = "") -> str:
    return (f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
            f"data:\n  train: {{path: {DATA}/sft_train.jsonl, max_samples: 8}}\n"
            f"distributed: {distributed}\nevaluation: {{before_training: false}}\n"
            "output: {plot: false}\n"
            "training: {max_steps: 2, per_device_train_batch_size: 2, optim: sgd, "
            "learning_rate: 0.1, max_grad_norm: 0.0, save_strategy: 'no', seed: 5, "
            "activation_checkpointing: false}\n" + extra)


def launch(*argv: str, cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "finetune", *argv], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_two_machines_on_loopback_match_one_process(write, tmp_path):
    """Two machines of one process each, batch 2, against one process of batch 4: the data is
    one global batch (4 rows), so every step sees the same rows in both layouts."""
    eight = "max_samples: 8}"
    two = write("two.yaml", experiment(
        "{strategy: ddp, num_processes: 2, num_machines: 2, "
        f"main_process_port: {free_port()}, device: cpu}}").replace(eight, "max_samples: 4}"))
    machines = [launch("launch", str(two), "--machine-rank", str(rank), cwd=tmp_path)
                for rank in (0, 1)]
    outputs = [m.communicate(timeout=300) for m in machines]
    for machine, (out, err) in zip(machines, outputs):
        assert machine.returncode == 0, err[-3000:]
    assert "x 2 process(es)" in outputs[0][0]
    one = write("one.yaml", experiment("{device: cpu}").replace(eight, "max_samples: 4}")
                .replace("per_device_train_batch_size: 2", "per_device_train_batch_size: 4"))
    result = run_cli("train", str(one), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    a = load_file(tmp_path / "runs" / "two" / "final" / "model.safetensors")
    b = load_file(tmp_path / "runs" / "one" / "final" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)
    start = load_file(tmp_path / "runs" / "one" / "init-model" / "model.safetensors")
    assert any(not torch.equal(b[k], start[k]) for k in b)  # it trained


def _fails(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-3000:]


def test_accelerate_cpu_flag_that_starts_one_process_is_refused(write, tmp_path):
    # `accelerate launch --cpu --num_processes 2` exits 0 having started ONE process.
    config = write("trap.yaml", experiment("{strategy: ddp, num_processes: 2, device: cpu}"))
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
         "-m", "finetune", "train", str(config)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    _fails(result, "started as one of 1 (WORLD_SIZE=1), but the experiment asks for 2")


def test_torchrun_copies_of_a_one_process_experiment_are_refused(write, tmp_path):
    """A count the experiment gives and the launcher contradicts stops every process before
    the data is prepared or the run directory written."""
    config = write("copies.yaml", experiment("{strategy: none, num_processes: 1, device: cpu}"))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "finetune", "train", str(config)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    _fails(result, "started as one of 2 (WORLD_SIZE=2), but the experiment asks for 1")
    assert "leave the count out to take the launcher's" in result.stderr
    assert "data prepared" not in result.stdout and not (tmp_path / "runs").exists()


# torchrun's case is accelerate's path (launcher_overrides reads the WORLD_SIZE and
# LOCAL_WORLD_SIZE that torchrun's agent sets, under `accelerate launch` too; torchrun's own
# starts: the two refusals beside this test): exhaustive.
@pytest.mark.parametrize("launcher", [
    "accelerate", pytest.param("torchrun", marks=pytest.mark.exhaustive)])
def test_the_launchers_process_count_is_taken_when_the_experiment_gives_none(
        write, tmp_path, launcher):
    """docs/distributed.md's recipe, `accelerate launch --config_file
    accelerate_configs/ddp.yaml -m finetune train EXP` (the shipped preset), and torchrun,
    with no count in the experiment: it trains on the launcher's 2 processes, says so once,
    the data is tokenized once (by the main process; the other rank loads its cache entry),
    and the run directory records 2. An experiment whose count agrees with the launcher's
    takes the same path as `finetune launch`, which every launch test runs."""
    config = write("adopt.yaml", experiment("{device: cpu}"))
    port = str(free_port())
    start = ["accelerate.commands.launch", "--config_file",
             str(REPO / "accelerate_configs" / "ddp.yaml"), "--main_process_port", port] \
        if launcher == "accelerate" else \
        ["torch.distributed.run", "--nproc-per-node", "2", "--master-port", port]
    result = subprocess.run([sys.executable, "-m", *start, "-m", "finetune", "train",
                             str(config)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    note = ("finetune: distributed.num_processes 2 over 1 machine(s), from the launcher "
            "(WORLD_SIZE=2); the experiment gives no process count")
    assert result.stdout.count(note) == 1, result.stdout
    assert result.stdout.index(note) < result.stdout.index("finetune: data prepared")
    assert result.stdout.count("finetune: data prepared and cached") == 1
    assert "x 2 process(es)" in result.stdout
    assert "2 processes with distributed.strategy none: data parallel (DDP) on cpu" in \
        result.stdout
    run = tmp_path / "runs" / "adopt"
    resolved = yaml.safe_load((run / "experiment.yaml").read_text())
    assert resolved["distributed"]["num_processes"] == 2
    assert (run / "final" / "model.safetensors").is_file()


def test_a_machine_count_the_launcher_contradicts_is_refused(write, tmp_path):
    config = write("machines.yaml", experiment("{strategy: ddp, num_machines: 2, device: cpu}"))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "finetune", "train", str(config)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    _fails(result, "the launcher started 2 process(es) on 1 machine(s) (WORLD_SIZE=2, "
                   "LOCAL_WORLD_SIZE=2), but the experiment asks for 2 machines "
                   "(distributed.num_machines)")
    assert not (tmp_path / "runs").exists()


def test_accelerate_precision_that_contradicts_the_experiment_is_refused(write, tmp_path):
    config = write("mp.yaml", experiment("{strategy: ddp, num_processes: 2, device: cpu}",
                                         "precision: fp32\n"))
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(REPO / "accelerate_configs" / "ddp.yaml"), "--mixed_precision", "bf16",
         "--main_process_port", str(free_port()), "-m", "finetune", "train", str(config)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    _fails(result, "the Accelerate launch says mixed_precision 'bf16', but the experiment's "
                   "precision is fp32")
    # refused before torch is imported: no data prepared, no run directory written
    assert "data prepared" not in result.stdout and not (tmp_path / "runs").exists()


def test_unreachable_main_machine_fails_in_bounded_time(write, tmp_path):
    port = free_port()
    config = write("alone.yaml", experiment(
        f"{{strategy: ddp, num_processes: 2, num_machines: 2, main_process_port: {port}, "
        "rdzv_timeout: 3}"))
    # Bounded by rdzv_timeout (the message says 3 s); the subprocess timeout catches a hang.
    result = run_cli("launch", str(config), "--machine-rank", "1", cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"machine 1 cannot reach the main process at 127.0.0.1:{port} within 3 s" in \
        result.stderr


def test_usr1_or_ctrl_c_to_finetune_launch_saves_on_every_trainer(write, tmp_path):
    """SIGUSR1 sent to `finetune launch` alone (as SLURM does with proctrack/cgroup) gets to
    the training process, which saves a sealed checkpoint and exits 75 ("try again"); Ctrl-C
    in the terminal of a 2-process launch reaches each of its training processes once (they
    run in a session of their own: only the launcher hears the terminal), together they
    save at the same step, and the launch exits 130. Either way the same command continues
    (test_resume)."""
    for name, distributed in (("one", "{strategy: none, device: cpu}"),
                              ("two", "{strategy: ddp, num_processes: 2, device: cpu, "
                                      f"main_process_port: {free_port()}}}")):
        config = write(f"{name}.yaml", experiment(distributed).replace(
            "max_steps: 2", "max_steps: 100000").replace("save_strategy: 'no'",
                                                          "save_strategy: 'no', logging_steps: 1"))
        run_dir = tmp_path / "runs" / name
        ranks, sent = (1, "SIGUSR1") if name == "one" else (2, "SIGINT")
        if sent == "SIGINT" and shutil.which("tmux"):
            proc = Terminal([sys.executable, "-m", "finetune", "launch", str(config)], tmp_path,
                            tmp_path / f"{name}.log")
        else:  # SIGINT is what a terminal's Ctrl-C sends the launcher
            proc = launch("launch", str(config), cwd=tmp_path)
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.2)
        if isinstance(proc, Terminal):
            proc.ctrl_c()
            code, err = proc.wait(120), (tmp_path / f"{name}.log").read_text()
        else:
            proc.send_signal(getattr(signal, sent))
            _, err = proc.communicate(timeout=120)
            code = proc.returncode
        assert code == (EXIT_PREEMPTED if sent == "SIGUSR1" else EXIT_INTERRUPTED), err[-3000:]
        for rank in range(ranks):
            assert err.count(f"rank {rank} received {sent}") == 1, err[-3000:]
        stopped = json.loads((run_dir / checkpoints.STOPPED).read_text())
        assert stopped["signal"] == sent
        saved = checkpoints.scan(run_dir / "checkpoints")
        assert [p.name for p in saved.complete] == [f"checkpoint-{stopped['step']}"]
        manifest = checkpoints.read_manifest(saved.newest)
        assert manifest["saved_on"] == sent and manifest["layout"]["processes"] == ranks
        if ranks == 2:
            assert "rng_state_1.pth" in manifest["files"]  # both ranks' files are sealed in
        assert not (run_dir / "final").exists() and not (run_dir / "summary.json").exists()
        assert "Run the same command again to continue" in err


def _slow_start(write, name: str, extra: str = "") -> str:
    """A run that spends seconds evaluating 4000 rows before its first step: a window in
    which a requested save cannot happen yet."""
    text = experiment("{strategy: none, device: cpu}", extra)
    text = text.replace("evaluation: {before_training: false}",
                        "evaluation: {before_training: true}")
    text = text.replace("max_samples: 8}\n", f"max_samples: 8}}\n  eval: {DATA}/sft_train.jsonl\n")
    return write(f"{name}.yaml", text)


def _wait_for_text(proc_log, text: str, proc, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    read = lambda: proc_log.read_text() if proc_log.exists() else ""  # a warm child opens it
    while text not in read():
        assert proc.poll() is None and time.monotonic() < deadline, read()[-3000:]
        time.sleep(0.05)


# The two below fork `finetune train` from the warm interpreter (resumable.Run): a process
# of its own that installs its own signal handlers, less ~8 s of imports; a cold start's
# signals are test_usr1_or_ctrl_c_to_finetune_launch_saves_on_every_trainer's.
def test_a_second_signal_ends_the_process_at_once(write, tmp_path):
    config = _slow_start(write, "twice")
    run = Run("train", config, tmp_path, 1)
    _wait_for_text(run.log, "finetune: run twice", run.proc)  # training set up, evaluating
    run.signal(signal.SIGTERM)
    _wait_for_text(run.log, "rank 0 received SIGTERM", run.proc)
    run.signal(signal.SIGTERM)
    assert run.wait(60) == -signal.SIGTERM
    assert not list((tmp_path / "runs" / "twice" / "checkpoints").glob("checkpoint-*"))


def test_a_save_that_cannot_finish_in_time_ends_the_process(write, tmp_path):
    config = _slow_start(write, "late", "preemption: {save_timeout: 1}\n")
    run = Run("train", config, tmp_path, 1)
    _wait_for_text(run.log, "finetune: run late", run.proc)
    run.signal(signal.SIGUSR1)  # the save would run on; wait(60) catches a hang
    assert run.wait(60) == EXIT_SAVE_TIMEOUT, run.text()[-3000:]
    assert "did not finish within 1 s (preemption.save_timeout)" in run.text()


def test_a_bad_data_row_under_launch_exits_2_and_names_the_row(write, tmp_path):
    """The row is only read by the training processes; the launcher says just that a
    child failed, so launch itself turns their error into exit 2."""
    rows = [{"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "yo"}]}] * 3
    rows.insert(1, {"messages": [{"role": "robot", "content": "x"}]})
    data = write("bad.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    config = write("bad.yaml", f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, "
                               f"init: random}}\ndata: {{train: {data}}}\n"
                               "distributed: {strategy: ddp, num_processes: 2, device: cpu, "
                               f"main_process_port: {free_port()}}}\n"
                               "training: {max_steps: 1}\n")
    result = run_cli("launch", str(config), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "bad.jsonl row 2: `messages[0].role` is 'robot'" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "finetune: a training process stopped on the error above")


def test_num_processes_without_a_strategy_trains_ddp_on_the_probed_cpu(write, tmp_path):
    """device auto and precision auto on a machine without a GPU: the probe says cpu, so
    the Accelerate file says no mixed precision, and 2 processes train as DDP (gloo)."""
    from finetune.launch.probe import PROC_GPUS

    config = write("auto.yaml", experiment(f"{{main_process_port: {free_port()}}}"))
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS")  # finetune launch shares this machine's cores out
    if PROC_GPUS.exists() or shutil.which("nvidia-smi"):
        env["CUDA_VISIBLE_DEVICES"] = ""  # a GPU machine: hide them, as the probe reads it
    result = subprocess.run([sys.executable, "-m", "finetune", "launch", str(config),
                             "--num-processes", "2"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finetune: distributed.device auto -> cpu on this machine" in result.stdout
    assert "2 processes with distributed.strategy none: data parallel (DDP) on cpu" in \
        result.stdout
    assert "x 2 process(es)" in result.stdout
    summary = result.stdout.split("finetune: run auto")[-1]  # the start summary says it too
    assert "data parallel (DDP) on cpu" in summary
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"finetune: OMP_NUM_THREADS={threads} for each of the 2 processes on this " \
           f"machine's {len(os.sched_getaffinity(0))} cores" in result.stdout
    assert f"{threads} CPU thread(s) per process (OMP_NUM_THREADS={threads})" in summary
    run = tmp_path / "runs" / "auto"
    accel = yaml.safe_load((run / "accelerate.yaml").read_text())
    assert accel["mixed_precision"] == "no" and accel["distributed_type"] == "MULTI_GPU"
    environment = json.loads((run / "environment.json").read_text())
    assert environment["device"] == "cpu" and environment["precision"] == "fp32"
