#!/usr/bin/env python
"""SFT throughput side by side: finetune (its CLI) against the same run in plain TRL.

One invocation runs every contender, repetitions interleaved to cancel noise.

Contenders (each a fresh process, run as a user runs it and measured from outside the
same way, by bench/meter.py, from the metrics.jsonl it leaves in its run directory):
  finetune  `finetune train bench/configs/sft.yaml <overrides>`: the real CLI
  defaults  plain TRL, TRL's defaults
  tuned     plain TRL, packing=True (bfd, padding-free)
  same      plain TRL with finetune's effective settings (its run's training_args.json)

Usage:
  python bench/run.py                              # CPU preset, a few minutes on 2 cores
  python bench/run.py --preset gpu-qwen0.5b[-dense] [--lora] --out results.json --markdown
  python bench/table.py results.json --markdown    # the table again, from a results file
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import make_data  # noqa: E402
import make_tokenizer  # noqa: E402
import meter  # noqa: E402
import table  # noqa: E402
from plain_trl import LORA  # noqa: E402

PRESETS = {
    # Whole comparison (4 contenders x 3 repeats) in about 4 minutes on 2 CPU cores.
    # One thread per run: on a shared CPU, OpenMP threads spin-waiting for a descheduled
    # sibling turn other load into 10x swings; a single thread degrades gracefully.
    "cpu": dict(device="cpu", model="models/tiny-cpu", precision="fp32", steps=12,
                warmup_steps=2, batch_size=4, max_length=512, data="lognormal", median=128,
                repeats=3, threads=1),
    # Realistic shapes (real vocab sizes included), random weights, one GPU. Each preset
    # comes in two data sets: log-normal rows (most SFT data: padding dominates) and dense
    # rows near max_length (long-context data: attention and memory dominate).
    "gpu-qwen0.5b": dict(device="cuda", model="models/qwen2.5-0.5b", precision="bf16",
                         steps=40, warmup_steps=5, batch_size=8, max_length=2048,
                         data="lognormal", median=256, repeats=2),
    "gpu-llama1b": dict(device="cuda", model="models/llama-3.2-1b", precision="bf16",
                        steps=40, warmup_steps=5, batch_size=8, max_length=2048,
                        data="lognormal", median=256, repeats=2),
}
# The dense twin of every preset: the same run on rows of 0.75-1 x max_length.
PRESETS.update({f"{name}-dense": {**preset, "data": "dense", "steps": min(preset["steps"], 20)}
                for name, preset in list(PRESETS.items())})
CONTENDERS = ("finetune", "defaults", "tuned", "same")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--preset", choices=sorted(PRESETS), help="default: cpu, or "
                   "gpu-qwen0.5b with --device cuda; explicit options below override it")
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--model", help="a config dir (random init) or a model dir (--init "
                   "pretrained); relative paths are relative to bench/")
    p.add_argument("--init", choices=["random", "pretrained"], default="random")
    p.add_argument("--lora", action="store_true", help="LoRA r=16 alpha=32 all-linear")
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup-steps", type=int, help="first steps left out of the timing")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--max-length", type=int)
    p.add_argument("--precision", choices=["bf16", "fp32"])
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logging-steps", type=int, default=1)
    p.add_argument("--attn", help="attn_implementation for every contender (default: each "
                   "its own: finetune's auto, TRL's sdpa; `same` takes finetune's)")
    p.add_argument("--repeats", type=int)
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of every run (cpu preset: 1; "
                   "default otherwise: torch's choice)")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help="comma-separated subset of " + ",".join(CONTENDERS))
    p.add_argument("--rows", type=int, help="data rows (default: enough for every contender)")
    p.add_argument("--data", choices=make_data.DISTRIBUTIONS, help="row lengths: log-normal "
                   "or dense (near max_length)")
    p.add_argument("--median", type=float, help="median row length in tokens (log-normal)")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of lengths")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/finetune-bench"))
    p.add_argument("--keep-runs", action="store_true", help="keep run/output directories")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per contender run")
    p.add_argument("--out", type=Path, help="write the results (JSON) here")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak for MFU "
                   "(default: by its name, H100/H200 989, A100 312)")
    args = p.parse_args(argv)
    preset = PRESETS[args.preset or ("gpu-qwen0.5b" if args.device == "cuda" else "cpu")]
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    model = Path(args.model)
    args.model = str(model if model.is_absolute() or model.exists() else BENCH / model)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown:
        p.error(f"unknown contenders: {', '.join(sorted(unknown))}")
    if "same" in args.contenders and "finetune" not in args.contenders:
        p.error("'same' needs 'finetune' (it reads finetune's training_args.json)")
    return args


def prepare(args) -> dict:
    """Tokenizer and data in the work directory; checks the model can take them."""
    from transformers import AutoConfig

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = make_tokenizer.build(work / "tokenizer")
    typical = make_data.typical_length(args.data, args.median, args.max_length)
    rows = args.rows or max(1000, 2 * args.steps * args.batch_size * args.max_length
                            // int(typical))
    data = make_data.make_rows(rows, args.max_length, 20, args.median, args.sigma, args.seed,
                               args.data)
    make_data.write(data, work / "data.jsonl")
    token_lengths = make_data.token_lengths(data, str(tokenizer_dir))
    lengths = make_data.describe(token_lengths)
    config = AutoConfig.from_pretrained(args.model)
    if config.vocab_size < make_tokenizer.VOCAB_SIZE:
        sys.exit(f"{args.model}: vocab_size {config.vocab_size} < the bench tokenizer's "
                 f"{make_tokenizer.VOCAB_SIZE}")
    if getattr(config, "max_position_embeddings", args.max_length) < args.max_length:
        sys.exit(f"{args.model}: max_position_embeddings < --max-length {args.max_length}")
    # A token's causal context is its position + 1 within its row: the data's mean, for
    # the attention FLOPs (no contender truncates or splits these rows).
    ctx = sum(n * (n + 1) / 2 for n in token_lengths) / sum(token_lengths)
    return {"tokenizer": str(tokenizer_dir), "data": str(work / "data.jsonl"),
            "lengths": lengths,
            "flops": meter.flops_per_token(args.model, LORA if args.lora else None, ctx)}


def finetune_command(args, files: dict, run_dir: Path) -> list[str]:
    overrides = {
        "model.name_or_path": args.model, "model.init": args.init,
        "tokenizer.name_or_path": files["tokenizer"], "data.train": files["data"],
        "output.dir": str(run_dir), "precision": args.precision,
        "distributed.device": args.device, "training.max_steps": args.steps,
        "training.per_device_train_batch_size": args.batch_size,
        "training.learning_rate": args.lr, "training.max_length": args.max_length,
        "training.seed": args.seed, "training.logging_steps": args.logging_steps,
        # a logging option every contender gets: batch positions in the logs (padding)
        "training.include_num_input_tokens_seen": "all",
    }
    if args.lora:
        overrides["peft.type"] = "lora"
    if args.attn:
        overrides["model.attn_implementation"] = args.attn
    script = Path(sys.executable).parent / "finetune"  # the console script, as a user runs it
    command = [str(script)] if script.exists() else [sys.executable, "-m", "finetune"]
    return [*command, "train", str(BENCH / "configs" / "sft.yaml"),
            *(f"{k}={v}" for k, v in overrides.items())]


def plain_command(args, files: dict, mode: str, out_dir: Path,
                  finetune_args: Path) -> list[str]:
    cmd = [sys.executable, str(BENCH / "plain_trl.py"), "--mode", mode, "--model", args.model,
           "--init", args.init, "--tokenizer", files["tokenizer"], "--data", files["data"],
           "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
           "--batch-size", str(args.batch_size), "--lr", str(args.lr),
           "--max-length", str(args.max_length), "--precision", args.precision,
           "--device", args.device, "--seed", str(args.seed),
           "--logging-steps", str(args.logging_steps), "--output-dir", str(out_dir)]
    attn = args.attn
    if mode == "same":
        cmd += ["--finetune-args", str(finetune_args)]
        # finetune's attention as its run resolved it (environment.json), unless forced
        environment = finetune_args.with_name("finetune_environment.json")
        if attn is None and environment.exists():
            attn = json.loads(environment.read_text()).get("attention")
    if args.lora:
        cmd.append("--lora")
    if attn:
        cmd += ["--attn", attn]
    return cmd


def run_one(args, files: dict, contender: str, repeat: int) -> dict:
    work = args.workdir
    out_dir = work / "runs" / f"{contender}-{repeat}"
    shutil.rmtree(out_dir, ignore_errors=True)
    finetune_args = work / "finetune_training_args.json"
    if contender == "finetune":
        cmd = finetune_command(args, files, out_dir)
    else:
        cmd = plain_command(args, files, contender, out_dir, finetune_args)
    log = work / "logs" / f"{repeat}-{contender}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(shlex.join(cmd) + "\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if args.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    started = time.time()
    code, memory = meter.run_measured(cmd, log, env, BENCH.parent, args.timeout,
                                      gpu_idle_mib=files.get("gpu_idle_mib"))
    record = {"contender": contender, "repeat": repeat, "command": shlex.join(cmd),
              "wall_s": round(time.time() - started, 1), "log": str(log), "exit": code}
    try:
        if code != 0:
            raise RuntimeError(f"exit {code}")
        result = meter.window(out_dir / "metrics.jsonl", args.warmup_steps)
        result.update(memory, settings=meter.settings(out_dir / "training_args.json"))
        flops = files["flops"]["flops_per_token"] * result["tokens"]
        result["flops"] = flops
        if args.peak_tflops:
            result["mfu"] = round(flops / result["seconds"] / (args.peak_tflops * 1e12), 4)
        record["result"] = result
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        tail = log.read_text().splitlines()[-15:]
        print(f"  {contender} (repeat {repeat}) FAILED ({exc}); {log}:\n    "
              + "\n    ".join(tail), file=sys.stderr)
    if contender == "finetune":
        saved = out_dir / "training_args.json"
        if saved.exists() and not finetune_args.exists():
            shutil.copy(saved, finetune_args)
            shutil.copy(out_dir / "environment.json",
                        finetune_args.with_name("finetune_environment.json"))
    if not args.keep_runs:
        shutil.rmtree(out_dir, ignore_errors=True)
    return record


def machine(device: str) -> dict:
    import torch

    info = {"platform": platform.platform(), "cpus": os.cpu_count(), "python":
            platform.python_version(), "torch": torch.__version__}
    for package in ("transformers", "trl", "peft", "finetune"):
        try:
            info[package] = __import__(package).__version__
        except Exception:  # noqa: BLE001 - a version is only a label here
            info[package] = None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        info["cpu"] = next((line.split(":", 1)[1].strip() for line in
                            cpuinfo.read_text().splitlines() if line.startswith("model name")),
                           None)
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main(argv=None) -> None:
    args = parse(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device visible")
    for name in ("finetune_training_args.json", "finetune_environment.json"):
        (args.workdir / name).unlink(missing_ok=True)
    files = prepare(args)
    if args.device == "cuda":  # what the device holds with no contender running
        files["gpu_idle_mib"] = meter.gpu_used_mib()
    info = machine(args.device)
    if args.device == "cuda" and args.peak_tflops is None:
        args.peak_tflops = meter.peak_tflops(info.get("gpu"))
    print(f"data: {files['lengths']}", flush=True)
    runs = []
    for repeat in range(args.repeats):
        # Rotate the order each repetition so no contender always runs first or last;
        # repetition 0 starts with finetune, whose training_args.json `same` reads.
        order = args.contenders[repeat % len(args.contenders):] + \
            args.contenders[:repeat % len(args.contenders)]
        if repeat == 0:
            order = args.contenders
        for contender in order:
            record = run_one(args, files, contender, repeat)
            runs.append(record)
            r = record.get("result")
            print(f"[{repeat}] {contender:9s} " + (
                f"{r['tokens_per_s']:>10,.0f} tokens/s  {r['s_per_step']:.3f} s/step  "
                f"({record['wall_s']} s wall)" if r else "failed"), flush=True)
    results = {
        "date": datetime.date.today().isoformat(), "command": shlex.join(sys.argv),
        "machine": info, "peak_tflops": args.peak_tflops, "flops": files["flops"],
        "settings": {k: getattr(args, k) for k in (
            "preset", "device", "model", "init", "lora", "steps", "warmup_steps",
            "batch_size", "max_length", "precision", "lr", "seed", "logging_steps", "attn",
            "repeats", "threads", "contenders", "data", "median", "sigma")},
        "data": {"rows": files["lengths"]["rows"], "lengths": files["lengths"]},
        "runs": runs, "summary": table.summarize(runs),
    }
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print()
    print(table.markdown(results) if args.markdown else table.text(results))
    padded = {r["contender"] for r in runs if r.get("result") and
              r["result"]["settings"].get("pad_to_multiple_of")}
    if padded:
        print(f"warning: pad_to_multiple_of is set for {', '.join(sorted(padded))}: TRL's "
              "num_tokens then counts the padding of padding-free batches as tokens")
    failed = sorted({r["contender"] for r in runs if not r.get("result")})
    if failed:  # a table of dashes is no result: lane.sh counts the step as failed
        sys.exit(f"error: {len(failed)} contender(s) failed: {', '.join(failed)} "
                 "(the tail of each failed run's log is printed above)")


if __name__ == "__main__":
    main()
