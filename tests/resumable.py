"""Helpers for tests that interrupt real runs: start `finetune` in a subprocess, watch its
metrics.jsonl, send real signals (to the launcher, as SLURM does, or SIGKILL to every
process of the run, as a dead node would), and read back weights and losses."""

from __future__ import annotations

import json
import os
import shlex
import shutil
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
from finetune.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED

DATASETS = {"sft": "sft_train", "sft-vlm": "vlm_train", "dpo-vlm": "vlm_pref_train",
            "reward": "pref_train", "dpo": "pref_train",
            "orpo": "pref_train", "cpo": "pref_train", "simpo": "pref_train",
            "distill": "sft_train", "distill-vlm": "vlm_train", "kto": "pref_train",
            "gkd": "sft_train"}


def experiment(name: str, method: str, *, processes: int = 1, steps: int = 40,
               batch: int = 4, accumulation: int = 1, samples: int = 24, extra: str = "",
               port: int | None = None, zero_stage: int | None = None,
               logging_steps: int = 1) -> str:
    """fp32 CPU, fixed seed, a checkpoint every 4 steps, several epochs (24 samples);
    DDP over `processes`, or DeepSpeed ZeRO at `zero_stage`; a free port unless given.
    method sft-vlm (distill-vlm): sft (distill) of the tiny LLaVA (whole) on rows with
    images; dpo-vlm: dpo of its LoRA on pairs with images."""
    if port is None:
        port = free_port()
    strategy = "ddp" if zero_stage is None else \
        f"deepspeed, deepspeed: {{zero_stage: {zero_stage}}}"
    distributed = (f"distributed: {{strategy: {strategy}, num_processes: {processes}, "
                   f"device: cpu, main_process_port: {port}}}\n" if processes > 1 else "")
    peft = "peft: {type: lora, r: 4, dropout: 0.1}\n" if method in ("sft", "dpo-vlm") else ""
    model = TINY_MODEL.parent / "tiny-vlm" if method.endswith("-vlm") else TINY_MODEL
    return (f"name: {name}\nmethod: {method.removesuffix('-vlm')}\nmodel: {{name_or_path: "
            f"{model}, init: random}}\n{peft}"
            f"data:\n  train: {{path: {DATA}/{DATASETS[method]}.jsonl, max_samples: {samples}}}\n"
            f"{distributed}evaluation: {{before_training: false}}\noutput: {{plot: false}}\n"
            f"training:\n  max_steps: {steps}\n  per_device_train_batch_size: {batch}\n"
            f"  gradient_accumulation_steps: {accumulation}\n  learning_rate: 1e-3\n"
            f"  logging_steps: {logging_steps}\n  save_steps: 4\n  seed: 5\n"
            + ("  max_completion_length: 8\n" if method.startswith("distill") else
               "  max_length: 64\n")
            + "  activation_checkpointing: false\n" + extra)


class Terminal:
    """`finetune ARGS` typed into a real terminal (a tmux pane): Ctrl-C there goes to the
    foreground process group, as a person's does. As much of Popen as Run uses."""

    def __init__(self, argv: list[str], cwd: Path, log: Path):
        self.session = f"finetune-{cwd.name}-{log.stem}"
        self.status = log.with_suffix(".status")
        self.args, self.returncode = argv, None
        # A tmux server started earlier has its own environment: this test's goes in the
        # script (the offline flags, one thread per process, the tree on PYTHONPATH).
        script = log.with_suffix(".sh")
        script.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in os.environ.items()
                                  if k.isidentifier()) +
                          f"cd {shlex.quote(str(cwd))}\n{shlex.join(argv)} > "
                          f"{shlex.quote(str(log))} 2>&1\necho $? > "
                          f"{shlex.quote(str(self.status))}\nsleep 600\n")
        subprocess.run(["tmux", "new-session", "-d", "-s", self.session, "bash", str(script)],
                       check=True)
        pane = subprocess.run(["tmux", "display-message", "-p", "-t", self.session,
                               "#{pane_pid}"], capture_output=True, text=True, check=True)
        self.pid = int(pane.stdout)  # the shell; the command is its child

    def poll(self) -> int | None:
        if self.returncode is None and self.status.is_file() and self.status.read_text():
            self.returncode = int(self.status.read_text())
            subprocess.run(["tmux", "kill-session", "-t", self.session], capture_output=True)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout or 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def ctrl_c(self) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.session, "C-c"], check=True)


class Run:
    """One attempt of `finetune train|launch CONFIG`, output kept in files. `train` forks
    from the warm interpreter (conftest.run_cli) unless cold=True; `launch` is always a
    cold process (its workers are cold either way); terminal=True types it into a real
    terminal (cold)."""

    def __init__(self, command: str, config: Path, cwd: Path, attempt: int,
                 cold: bool = False, terminal: bool = False):
        self.log = cwd / f"{config.stem}-{attempt}.log"
        if terminal:
            self.proc = Terminal([sys.executable, "-m", "finetune", command, str(config)],
                                 cwd, self.log)
            return
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
    """The records of metrics.jsonl; read while the run appends, a last line without its
    newline is still being written (seen on a loaded machine): not a record yet."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    whole = text if text.endswith("\n") else text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in whole.splitlines() if line.strip()]


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
    """What the run trained: the adapter where there is one (a random-init adapter run's
    final/ holds its untrained base beside it: model/peft.py embed_base), else the model."""
    final = run_dir / "final"
    name = "adapter_model.safetensors" if (final / "adapter_model.safetensors").exists() \
        else "model.safetensors"
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


def stopped_by_ctrl_c(command: str, config: Path, run_dir: Path, cwd: Path,
                      at_step: int) -> Run:
    """Run `finetune COMMAND` in a real terminal until `at_step` is logged, press Ctrl-C
    once, and check it saved and exited 130. Without tmux: a cold process sent the SIGINT
    a terminal would send."""
    terminal = shutil.which("tmux") is not None
    run = Run(command, config, cwd, 1, cold=True, terminal=terminal)
    try:
        wait_for_step(run, run_dir, at_step)
        run.proc.ctrl_c() if terminal else run.signal(signal.SIGINT)
        assert run.wait(300) == EXIT_INTERRUPTED, run.text()[-3000:]
    finally:
        if terminal:
            subprocess.run(["tmux", "kill-session", "-t", run.proc.session], capture_output=True)
    return run
