"""What a run tells its user: the environment record, the start and end summaries (the
loss curve is plots.py)."""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from finetune import __version__, compat
from finetune.config.derived.effective import record, setting
from finetune.data.sizes import size_warnings

# What environment.json records and `finetune env` (machine.py) prints: one list.
PACKAGES = ("torch", "torchvision", "transformers", "accelerate", "peft", "trl", "datasets",
            "deepspeed", "bitsandbytes", "liger-kernel", "flash-attn", "kernels", "pydantic")


def environment(device: str, precision: str, attention: str | None) -> dict[str, Any]:
    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    info: dict[str, Any] = {
        "finetune": __version__, "python": sys.version.split()[0],
        "platform": platform.platform(), "host": socket.gethostname(),
        "packages": versions, "device": device, "precision": precision,
        "attention": attention,
        "cpu_count": os.cpu_count(),
    }
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def attention_name(model) -> str | None:
    """The attention implementation the built model runs (auto resolved)."""
    return compat.attention_implementation(model)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def start_summary(job, trainable: int, total: int) -> str:
    exp, args = job.experiment, job.args
    tp, sp = exp.distributed.tensor_parallel, exp.distributed.sequence_parallel
    cp = exp.distributed.context_parallel
    world = args.world_size // (tp * sp * cp)  # a tensor/sequence/context group shares a batch
    effective = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    length = f"{args.max_steps} steps" if args.max_steps > 0 else f"{args.num_train_epochs} epochs"
    eval_rows = len(job.data.eval) if job.data.eval is not None else 0
    train_rows = f"streamed train blocks of {args.max_length} tokens" \
        if exp.data.streaming else f"{len(job.data.train)} train rows"
    lines = [
        f"finetune: run {exp.name} in {job.run_dir}",
        f"  method     {exp.method} (data format {job.data.format})",
        f"  model      {exp.model.name_or_path} ({exp.model.init})",
        f"  parameters {_count(trainable)} trainable of {_count(total)} "
        f"({100 * trainable / max(total, 1):.2f}%), peft {exp.peft.type}",
        f"  hardware   {job.hardware.device}, precision {job.hardware.precision}",
        f"  data       {train_rows}, {eval_rows} eval rows",
        f"  batch      {args.per_device_train_batch_size} per device x "
        f"{args.gradient_accumulation_steps} accumulation x {world} "
        f"{'data parallel group(s)' if tp * sp * cp > 1 else 'process(es)'} "
        f"= {effective} effective; {length}, learning rate {args.learning_rate:g}",
        f"  speed      {_speed(job)}",
    ]
    if tp > 1:
        lines.insert(6, f"  layout     {args.world_size} processes = data parallel {world} x "
                        f"tensor parallel {tp} (DeepSpeed AutoTP)")
    if cp > 1:
        lines.insert(6, f"  layout     {args.world_size} processes = FSDP shards {world} x "
                        f"context parallel {cp} (torch ring attention)")
    if sp > 1:
        lines.insert(6, f"  layout     {args.world_size} processes = data parallel {world} x "
                        f"sequence parallel {sp} (DeepSpeed ALST/Ulysses; rows padded to "
                        f"{args.pad_to_multiple_of} tokens)")
    listed = record(exp).labels  # the setting that lists the classes, if any
    if listed:
        lines.insert(6, f"  labels     {label_ids(setting(exp, listed), listed)}")
    if worth_showing(job.data.mix):
        lines += [f"  {'mix' if i == 0 else '':<10} {line}"
                  for i, line in enumerate(describe_mix(job.data.mix))]
    lines += [f"             {note}" for note in job.notes]
    train = None if exp.data.streaming else len(job.data.train)
    lines += [f"finetune: warning: {w}" for w in size_warnings(exp, train, len(
        job.data.eval) if job.data.eval is not None else None)]
    return "\n".join(lines)


def label_ids(labels: list[str], where: str, shown: int = 12) -> str:
    """Which id each class name trains as (data rows give a name or its id; the saved
    model's id2label is the same list). where: the setting that lists them."""
    pairs = ", ".join(f"{i} {name}" for i, name in enumerate(labels[:shown]))
    return pairs + (f", ... ({len(labels)} classes, {where})" if len(labels) > shown
                    else f" ({where})")


def _speed(job) -> str:
    """The throughput settings in effect, so a slow run shows why."""
    args = job.args
    attention = attention_name(job.model)
    optim = getattr(args.optim, "value", args.optim)
    parts = [f"attention {attention or 'default'}", f"optim {optim}"]
    for name in ("packing", "padding_free", "use_liger_kernel", "torch_compile",
                 "activation_checkpointing"):
        if getattr(args, name, False):
            parts.append(name)
    if args.train_sampling_strategy != "random":
        parts.append(args.train_sampling_strategy)
    if args.dataloader_num_workers:
        parts.append(f"{args.dataloader_num_workers} dataloader workers")
    return ", ".join(parts)


def end_summary(run_dir: Path, seconds: float, attempt: float, before: dict, after: dict,
                final_dir: Path | None) -> str:
    """`seconds` over every attempt of the run, `attempt` this one's."""
    resumed = f" ({attempt:.1f} s in this attempt)" if seconds - attempt > 0.05 else ""
    lines = [f"finetune: done in {seconds:.1f} s{resumed}"]
    if final_dir is not None:
        lines.append(f"  model      {final_dir}")
    for key in sorted(after):
        if not isinstance(after[key], (int, float)) or any(
                word in key for word in ("runtime", "per_second", "preparation_time",
                                         "num_tokens", "epoch", "entropy")):
            continue
        start = before.get(key)
        change = f"{start:.4g} -> {after[key]:.4g}" if isinstance(start, (int, float)) \
            else f"{after[key]:.4g}"
        lines.append(f"  {key:<28} {change}")
    lines.append(f"  metrics    {run_dir / 'metrics.jsonl'}, summary {run_dir / 'summary.json'}")
    return "\n".join(lines)


def logged_before(records: list[dict]) -> dict[str, Any]:
    """The evaluation before training as metrics.jsonl holds it (the records at step 0):
    a resumed attempt does not evaluate before training again, and its summary takes the
    first attempt's numbers from there."""
    before: dict[str, Any] = {}
    for record in records:
        if record["step"] == 0:
            before.update((k, v) for k, v in record.items() if k.startswith("eval_"))
    return before


def summary_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """Every finite number of a summary, flat: before/<metric>, after/<metric>,
    train/<metric>, and the run's own (seconds, global_step). What the trackers and the
    model card report."""
    numbers: dict[str, float] = {}
    parts = [(part, summary.get(part)) for part in ("before", "after", "train")]
    parts.append(("", {k: summary.get(k) for k in ("seconds", "global_step")}))
    for part, values in parts:
        for key, value in (values if isinstance(values, dict) else {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                    math.isfinite(value):
                numbers[f"{part}/{key}" if part else key] = value
    return numbers


def write_json(path: Path, value: Any) -> None:
    """Whole or not at all (summary.json half-written by a kill would block every rerun)."""
    from finetune.fileio.atomic import write_atomic

    write_atomic(path, json.dumps(value, indent=2, default=str) + "\n")  # RunError naming it


def describe_mix(mix: list[dict[str, Any]]) -> list[str]:
    """One line per source, for the start summary: what the mix (data/mix.py) took from it."""
    lines = []
    for entry in mix:
        how = []
        if entry["max_samples"] is not None and entry["sampled"] < entry["rows"]:
            how.append(f"max_samples {entry['max_samples']}")
        if entry["weight"] is not None:
            how.append(f"weight {entry['weight']:g}")
        if entry["taken"] > entry["sampled"]:
            how.append(f"{entry['sampled']} rows repeated "
                       f"{entry['taken'] / entry['sampled']:.2f}x")
        lines.append(f"{entry['split']} {entry['source']}: {entry['taken']} rows "
                     f"({100 * entry['share']:.1f}%) of its {entry['rows']}"
                     + (f" ({', '.join(how)})" if how else ""))
    return lines


def worth_showing(mix: list[dict[str, Any]] | None) -> bool:
    """A mix of several sources, or one sampled: a single whole source says nothing new."""
    return bool(mix) and (len(mix) > 1 or mix[0]["taken"] != mix[0]["rows"])
