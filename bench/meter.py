"""The one measurement every contender gets, taken from outside the training process:
nothing is attached to, wrapped in or patched into any contender.

Each contender writes a metrics.jsonl into its run directory: one JSON record per log
event with "step", "time" (time.time() at on_log, rounded to ms) and the logs. finetune
writes it itself (its MetricsFile callback); plain_trl.py writes the same with a callback
of its own. Every contender runs with logging_steps=1 and
include_num_input_tokens_seen="all", so every step's log carries TRL's "num_tokens"
(cumulative trained tokens) and the Trainer's "num_input_tokens_seen" (cumulative batch
positions, padding included).

- window: from the log of step `warmup` to the log of the last step, so steps
  warmup+1..max_steps whole (data loading, forward/backward, optimizer, callbacks,
  logging). A log follows the loss read-back (.item()), so on a GPU both ends are
  synchronised with the device.
- tokens: num_tokens(last) - num_tokens(warmup). TRL counts attention_mask.sum() for a
  padded batch and the flattened row's length for a padding-free one: the non-pad tokens,
  as long as pad_to_multiple_of is unset (it is for every contender here; run.py warns
  otherwise).
- padding: 1 - tokens / positions, positions = the same difference of
  num_input_tokens_seen (input_ids.numel() of every batch).
- peak memory (run_measured): on CPU the child's peak RSS (os.wait4's rusage); on GPU the
  device's used memory (nvidia-smi, sampled every 100 ms) above the device's idle level,
  measured once before the first contender: CUDA context and allocator cache included,
  not just allocated tensors. Before each contender the device must be back at idle (the
  previous contender's process group killed, the driver's release awaited): a baseline
  taken while a finished neighbour still held its memory once read 0.00 GiB for a run
  that used ~10 GiB. A reading that cannot be right (nothing above idle) is None, shown
  as n/a, never 0.
- FLOPs (MFU), the same model for every contender (same model, same LoRA):
    sum over Linear weights W (LM head included, embedding lookup not):
        6 * |W| per token if W trains, 4 * |W| if frozen (forward + input gradient)
    + attention 12 * L * d_attn * ctx per token, ctx = the token's causal context; the
      window's sum of ctx is estimated as tokens x the data set's mean ctx per token.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from contextlib import nullcontext
from pathlib import Path

# Dense bf16 peak (no sparsity) by device name, for MFU; run.py --peak-tflops overrides.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
FLOPS_FORMULA = ("sum_W (6|W| trainable, 4|W| frozen) * tokens + 12 * L * heads * head_dim "
                 "* tokens * mean causal ctx of the data; peak: dense bf16")
# What a contender trains with, from its run's training_args.json (for the report).
SETTINGS = ("packing", "packing_strategy", "padding_free", "pad_to_multiple_of",
            "gradient_checkpointing", "bf16", "per_device_train_batch_size",
            "gradient_accumulation_steps", "max_length", "train_sampling_strategy",
            "dataloader_num_workers", "use_liger_kernel", "optim")


def training_logs(path: Path) -> dict[int, dict]:
    """The training log records of a metrics.jsonl, by step (eval and summary records,
    which have no "loss", are left out)."""
    logs: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if "loss" in record and "num_tokens" in record:
                logs.setdefault(record["step"], record)
    return logs


def window(path: Path, warmup: int) -> dict:
    """tokens/s, s/step and padding over the window of a run's metrics.jsonl."""
    logs = training_logs(path)
    if warmup not in logs or max(logs, default=0) <= warmup:
        raise ValueError(f"{path}: no log at step {warmup} and after it (logging_steps=1?)")
    first, last = logs[warmup], logs[max(logs)]
    seconds = last["time"] - first["time"]
    steps = last["step"] - warmup
    tokens = int(last["num_tokens"] - first["num_tokens"])
    positions = None
    if "num_input_tokens_seen" in last:
        positions = int(last["num_input_tokens_seen"] - first["num_input_tokens_seen"])
    steps_logged = sorted(logs)
    cumulative = [int(logs[s]["num_tokens"]) for s in steps_logged]
    return {"tokens": tokens, "positions": positions,
            "padding_fraction": round(1 - tokens / positions, 4) if positions else None,
            "seconds": round(seconds, 3), "steps": steps,
            "tokens_per_s": round(tokens / seconds, 2),
            "steps_per_s": round(steps / seconds, 4), "s_per_step": round(seconds / steps, 5),
            # every logged step's trained tokens: equal lists = the same batches
            "tokens_by_step": dict(zip(steps_logged, [b - a for a, b in
                                                      zip([0] + cumulative, cumulative)]))}


def settings(training_args: Path) -> dict:
    saved = json.loads(training_args.read_text())
    return {k: saved.get(k) for k in SETTINGS}


SETTLE_MIB = 256        # "back at idle": within this of the idle level
SETTLE_SECONDS = 120


def _device() -> str:
    return (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]


def gpu_used_mib() -> int | None:
    """The device's used memory now (MiB), or None without a readable nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "-i", _device(), "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return int(out) if out.isdigit() else None


def settle(idle_mib: int, timeout: float = SETTLE_SECONDS) -> int | None:
    """Wait until the device is back at its idle level; the level then (None: unreadable)."""
    deadline = time.monotonic() + timeout
    while True:
        used = gpu_used_mib()
        if used is None or used <= idle_mib + SETTLE_MIB or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


class GpuMemory:
    """Device-wide used GPU memory, sampled by `nvidia-smi -lms 100` while a child runs;
    high_mib: the highest sample (None without nvidia-smi)."""

    def __init__(self):
        self.high_mib = None
        self.proc = None

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "-i", _device(), "--query-gpu=memory.used",
                 "--format=csv,noheader,nounits", "-lms", "100"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self
        first = self.proc.stdout.readline().strip()
        if not first.isdigit():
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return self
        self.high_mib = int(first)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.high_mib = max(self.high_mib, int(line))

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.thread.join(timeout=5)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_measured(cmd: list[str], log: Path, env: dict, cwd: Path, timeout: int,
                 gpu_idle_mib: int | None = None) -> tuple[int | str, dict]:
    """Run one contender (output to `log`); its exit code and peak memory. gpu_idle_mib:
    the device's idle level, for a GPU run (None: a CPU run)."""
    gpu = gpu_idle_mib is not None
    base = settle(gpu_idle_mib) if gpu else None
    with log.open("a") as handle, GpuMemory() if gpu else nullcontext() as memory:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        killed = threading.Event()

        def kill():
            killed.set()
            _kill_group(proc.pid)

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            # wait4, not proc.wait(): it also returns this child's own rusage, whose
            # ru_maxrss (KiB) is its peak RSS (or that of a descendant it waited for).
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # interrupted: take the child down with us
            kill()
            raise
        finally:
            timer.cancel()
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        _kill_group(proc.pid)  # dataloader workers or other leftovers of the contender
    code = "timeout" if killed.is_set() else code
    if not gpu:
        return code, {"peak_mem_bytes": usage.ru_maxrss * 1024,
                      "peak_mem_kind": "process peak RSS"}
    return code, gpu_peak(memory.high_mib, gpu_idle_mib, base)


def gpu_peak(high_mib: int | None, idle_mib: int, base_mib: int | None) -> dict:
    """The run's peak above the device's idle level, or None with the reason."""
    kind = "GPU memory used (nvidia-smi) above the device's idle level"
    if high_mib is None or base_mib is None:
        return {"peak_mem_bytes": None, "peak_mem_kind": kind,
                "peak_mem_note": "nvidia-smi unreadable"}
    out = {"peak_mem_bytes": (high_mib - idle_mib) * 2**20, "peak_mem_kind": kind}
    if base_mib > idle_mib + SETTLE_MIB:
        out["peak_mem_note"] = (f"the device held {base_mib - idle_mib} MiB above idle when "
                                "the run started (not released in time): counted from idle")
    if high_mib <= base_mib:
        out.update(peak_mem_bytes=None, peak_mem_note="no memory use seen above the start "
                   "level: a sampling failure, not a measurement")
    return out


def flops_per_token(model_dir: str, lora: dict | None, ctx_per_token: float) -> dict:
    """Model FLOPs per trained token (see the module docstring), from the model's config
    on the meta device (no weights), LoRA applied as every contender applies it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    trainable = frozen = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            if module.weight.requires_grad:
                trainable += module.weight.numel()
            else:
                frozen += module.weight.numel()
    text = config.get_text_config()
    heads = text.num_attention_heads
    d_attn = heads * (getattr(text, "head_dim", None) or text.hidden_size // heads)
    attention = 12 * text.num_hidden_layers * d_attn * ctx_per_token
    return {"flops_per_token": round(6 * trainable + 4 * frozen + attention),
            "linear_params_trainable": trainable, "linear_params_frozen": frozen,
            "layers": text.num_hidden_layers, "d_attn": d_attn,
            "ctx_per_token": round(ctx_per_token, 2), "formula": FLOPS_FORMULA}


def peak_tflops(device_name: str | None) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if device_name and k in device_name), None)
