#!/usr/bin/env python
"""`finetune validate`'s data pass speed: rows/s of reading and checking every row of a
jsonl file (finetune.data.scan.check_data, what `finetune validate` runs unless --no-data),
for sft chat rows (`messages`) and dpo preference rows (`prompt`/`chosen`/`rejected` as
messages).

Rows: a user turn and an assistant turn (two assistant answers for preference) of 8-80
random words each (seeded), written once to --workdir.

Usage: python bench/validate_speed.py [--rows 200000] [--repeats 3] [--workdir DIR]
Prints one JSON line per kind: rows, best seconds of the repeats, rows/s.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from prepare_speed import WORDS  # noqa: E402


def write_rows(path: Path, kind: str, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    text = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 80)))
    turn = lambda role: {"role": role, "content": text()}
    with path.open("w") as out:
        for _ in range(count):
            if kind == "chat":
                row = {"messages": [turn("user"), turn("assistant")]}
            else:
                row = {"prompt": [turn("user")], "chosen": [turn("assistant")],
                       "rejected": [turn("assistant")]}
            out.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/finetune-bench-validate"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)

    from finetune.config import load_experiment
    from finetune.data.scan import check_data

    for kind, method in (("chat", "sft"), ("preference", "dpo")):
        data = args.workdir / f"{kind}-{args.rows}.jsonl"
        if not data.exists():
            write_rows(data, kind, args.rows)
        config = args.workdir / f"{kind}.yaml"
        config.write_text(json.dumps({
            "method": method,
            "model": {"name_or_path": str(REPO / "configs/quickstart/tiny-llama")},
            "data": {"train": str(data)}}))
        experiment = load_experiment(config)
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            check_data(experiment)
            times.append(time.perf_counter() - started)
        best = min(times)
        print(json.dumps({"kind": kind, "rows": args.rows,
                          "megabytes": round(data.stat().st_size / 2**20, 1),
                          "seconds": round(best, 2), "rows_per_s": round(args.rows / best),
                          "python": sys.version.split()[0]}), flush=True)


if __name__ == "__main__":
    main()
