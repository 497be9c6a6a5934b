"""Helpers for tests that interrupt real runs: start `finetune` in a subprocess, watch its
metrics.jsonl, send real signals (to the launcher, as SLURM does, or SIGKILL to every
process of the run, as a dead node would), and read back weights and losses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from conftest import DATA, TINY_MODEL, warm_interpreter, free_port
from warm import WarmProcess
from finetune.errors import EXIT_PREEMPTED

DATASETS = {"sft": "sft_train", "reward": "pref_train", "dpo": "pref_train",
            "orpo": "pref_train", "cpo": "pref_train", "simpo": "pref_train",
            "distill": "sft_train", "kto": "pref_train", "gkd": "sft_train"}


def experiment(name: str, method: str, *, processes: int = 1, steps: int = 40,
               batch: int = 4, accumulation: int = 1, samples: int = 24, extra: str = "",
               port: int | None = None, zero_stage: int | None = None,
               logging_steps: int = 1) -> str:
    """fp32 CPU, fixed seed, a checkpoint every 4 steps, several epochs (24 samples);
    DDP over `processes`, or DeepSpeed ZeRO at `zero_stage`; a free port unless given."""
    if port is None:
        port = free_port()
    strategy = "ddp" if zero_stage is None else \
        f"deepspeed, deepspeed: {{zero_stage: {zero_stage}}}"
    distributed = (f"distributed: {{strategy: {strategy}, num_processes: {processes}, "
                   f"device: cpu, main_process_port: {port}}}\n" if processes > 1 else "")
    peft = "peft: {type: lora, r: 4, dropout: 0.1}\n" if method == "sft" else ""
    return (f"name: {name}\nmethod: {method}\nmodel: {{name_or_path: {TINY_MODEL}, "
            f"init: random}}\n{peft}"
            f"data:\n  train: {{path: {DATA}/{DATASETS[method]}.jsonl, max_samples: {samples}}}\n"
            f"{distributed}evaluation: {{before_training: false}}\noutput: {{plot: false}}\n"
            f"training:\n  max_steps: {steps}\n  per_device_train_batch_size: {batch}\n"
            f"  gradient_accumulation_steps: {accumulation}\n  learning_rate: 1e-3\n"
            f"  logging_steps: {logging_steps}\n  save_steps: 4\n  seed: 5\n"
            + ("  max_completion_length: 8\n" if method == "distill" else "  max_length: 64\n")
            + "  activation_checkpointing: false\n" + extra)


class Run:
    """One attempt of `finetune train|launch CONFIG`, output kept in files. `train` forks
    from the warm interpreter (conftest.run_cli) unless cold=True; `launch` is always a
    cold process (its workers are cold either way)."""

    def __init__(self, command: str, config: Path, cwd: Path, attempt: int,
                 cold: bool = False):
        self.log = cwd / f"{config.stem}-{attempt}.log"
        warm = None if cold or command != "train" else warm_interpreter()
        if warm is not None:
            self.proc = warm.start([command, str(config)], cwd, self.log, self.log)
            return
        with self.log.open("w") as handle:
            self.proc = subprocess.Popen([sys.executable, "-m", "finetune", command,
                                          str(config)], cwd=cwd, stdout=handle,
                                         stderr=subprocess.STDOUT, text=True)

    def wait(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout)

    def text(self) -> str:
        return self.log.read_text()

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill_all(self) -> None:
        """SIGKILL to every process of the run at once: nothing gets to clean up."""
        try:
            tree = [psutil.Process(self.proc.pid)]
            tree += tree[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return
        # A warm child is reaped by its server the moment it ends, and its pid reused:
        # only once it is known alive after the lookup is the tree above its own.
        if isinstance(self.proc, WarmProcess) and not self.proc.running():
            self.proc.wait(60)
            return
        for proc in tree:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(60)
        psutil.wait_procs(tree, timeout=30)


def logged(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> list[tuple]:
    """What the run logged per step, exactly (not the time)."""
    return [(r["step"], r["loss"], r.get("grad_norm"), r.get("learning_rate"))
            for r in logged(run_dir) if "loss" in r]


def wait_for_step(run: Run, run_dir: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = losses(run_dir)
        if done and done[-1][0] >= step:
            return
        if run.proc.poll() is not None:
            raise AssertionError(f"run ended (exit {run.proc.returncode}) before step {step}:"
                                 f"\n{run.text()[-3000:]}")
        time.sleep(0.005)
    raise AssertionError(f"no step {step} within {timeout} s:\n{run.text()[-3000:]}")


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    final = run_dir / "final"
    name = "model.safetensors" if (final / "model.safetensors").exists() \
        else "adapter_model.safetensors"
    return load_file(final / name)


def _assert_same_weights(a: Path, b: Path, context: str) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"{context}: weights differ in {different[:5]}"


def assert_identical(a: Path, b: Path, context: str = "") -> None:
    _assert_same_weights(a, b, context)
    assert losses(a) == losses(b), f"{context}: logged losses differ"


def assert_continues(resumed: Path, reference: Path, step: int, context: str = "") -> None:
    """A run resumed (resume: PATH) from the uninterrupted reference's checkpoint-<step>
    ends with the reference's weights bitwise and logs its losses after that step: the
    restore path of a signal's checkpoint, without a third run to stop (the signal's save
    is the same Trainer save; SIGTERM and SIGKILL chains: test_resume.py)."""
    _assert_same_weights(resumed, reference, context)
    after = [entry for entry in losses(reference) if entry[0] > step]
    assert after and losses(resumed) == after, f"{context}: logged losses differ"


def stopped_by_sigterm(command: str, config: Path, run_dir: Path, cwd: Path,
                       at_step: int, cold: bool = False) -> Run:
    """Run until `at_step` is logged, SIGTERM `finetune COMMAND` (as SLURM signals the
    task), and check it saved and exited 75."""
    run = Run(command, config, cwd, 1, cold)
    wait_for_step(run, run_dir, at_step)
    run.signal(signal.SIGTERM)
    assert run.wait() == EXIT_PREEMPTED, run.text()[-3000:]
    return run
