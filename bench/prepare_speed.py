#!/usr/bin/env python
"""Data preparation speed: rows/s of reading, validating and tokenizing chat rows for sft
(finetune.data.prepare.prepare, the work the main process of a machine does before it
caches the result), with the quickstart's tiny-llama tokenizer and chat template.

Rows: a user turn and an assistant turn of 8-80 random words each (seeded), written to
a jsonl file in --workdir. The data cache is off: every run prepares.

Usage: python bench/prepare_speed.py [--rows 100000] [--num-proc N] [--workdir DIR]
  --num-proc: training.dataset_num_proc (default: finetune's default, the cores this
  process may run on).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORDS = [w.strip() for w in ("the of and to in is that for it as was with be by on not he "
                             "this are or his from at which but have an they you were her "
                             "she all one their there been has more if will would who so "
                             "sort these words what about when can said into only time "
                             "model train data loss step batch token layer weight answer").split()]


def write_rows(path: Path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    text = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 80)))
    with path.open("w") as out:
        for _ in range(count):
            out.write(json.dumps({"messages": [{"role": "user", "content": text()},
                                               {"role": "assistant", "content": text()}]})
                      + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--num-proc", type=int, default=None)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/finetune-bench-prepare"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    data = args.workdir / f"chat-{args.rows}.jsonl"
    if not data.exists():
        write_rows(data, args.rows)
    training = {"max_length": 256, "assistant_only_loss": True}
    if args.num_proc is not None:
        training["dataset_num_proc"] = args.num_proc
    config = args.workdir / "exp.yaml"
    config.write_text(json.dumps({
        "method": "sft", "model": {"name_or_path": str(REPO / "configs/quickstart/tiny-llama")},
        "data": {"train": str(data), "cache": False}, "training": training}))

    from finetune.config import load_experiment
    from finetune.data.prepare import prepare
    from finetune.methods import preparation
    from finetune.model.tokenizer import load_tokenizer

    experiment = load_experiment(config)
    tokenizer = load_tokenizer(experiment)
    started = time.perf_counter()
    splits = prepare(experiment, tokenizer, preparation(experiment))
    seconds = time.perf_counter() - started
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(json.dumps({"rows": args.rows, "kept": len(splits.train), "seconds": round(seconds, 1),
                      "rows_per_s": round(args.rows / seconds), "num_proc": args.num_proc,
                      "cores": cores, "python": sys.version.split()[0]}))


if __name__ == "__main__":
    main()
