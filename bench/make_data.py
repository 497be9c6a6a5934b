#!/usr/bin/env python
"""Deterministic SFT data for the throughput benchmark, in the `messages` format that both
finetune and plain TRL read: [{"role": "user", ...}, {"role": "assistant", ...}].

Lengths follow one of two distributions:
- lognormal: real SFT sets have a long tail (many short exchanges, a few long ones),
  clipped to [min_length, max_length] tokens;
- dense: every row near max_length (uniform in [0.75, 1] x max_length, median 0.875 x),
  like long-context or pre-packed data, where padding is small and attention dominates. Content is drawn
from the word list of bench/make_tokenizer.py, one token per word, so a row's token count
is exactly its target length (template included). With --tokenizer the real token lengths
are measured and reported (min/median/mean/p90/max).

Usage: python bench/make_data.py --out data.jsonl [--count 2000] [--max-length 2048]
           [--distribution lognormal|dense] [--median 256] [--sigma 1.0] [--seed 0]
           [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tokenizer import TEMPLATE_TOKENS, words  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


DISTRIBUTIONS = ("lognormal", "dense")
DENSE_LOW = 0.75  # dense rows: uniform in [DENSE_LOW, 1] x max_length


def target_lengths(count: int, median: float, sigma: float, min_length: int,
                   max_length: int, rng: random.Random,
                   distribution: str = "lognormal") -> list[int]:
    if distribution == "dense":
        return [max(min_length, round(max_length * rng.uniform(DENSE_LOW, 1.0)))
                for _ in range(count)]
    mu = math.log(median)
    return [min(max_length, max(min_length, round(rng.lognormvariate(mu, sigma))))
            for _ in range(count)]


def typical_length(distribution: str, median: float, max_length: int) -> float:
    """The median row length in tokens, for sizing the data set."""
    return max_length * (1 + DENSE_LOW) / 2 if distribution == "dense" else median


def make_rows(count: int, max_length: int = 2048, min_length: int = 20, median: float = 256,
              sigma: float = 1.0, seed: int = 0, distribution: str = "lognormal") -> list[dict]:
    rng = random.Random(seed)
    vocab = words()
    rows = []
    for length in target_lengths(count, median, sigma, min_length, max_length, rng,
                                 distribution):
        content = max(2, length - TEMPLATE_TOKENS)
        # The prompt takes 10-60 % of the exchange, like instruction data; both turns
        # are at least one word.
        user = min(content - 1, max(1, round(content * rng.uniform(0.1, 0.6))))
        rows.append({"messages": [
            {"role": "user", "content": " ".join(rng.choices(vocab, k=user))},
            {"role": "assistant", "content": " ".join(rng.choices(vocab, k=content - user))},
        ]})
    return rows


def token_lengths(rows: list[dict], tokenizer_dir: str) -> list[int]:
    """The real lengths, tokenized the way TRL tokenizes a conversation."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = tokenizer.apply_chat_template([r["messages"] for r in rows], tokenize=False)
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def describe(lengths: list[int]) -> dict:
    ordered = sorted(lengths)
    return {"rows": len(ordered), "min": ordered[0], "median": statistics.median(ordered),
            "mean": round(statistics.fmean(ordered), 1),
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "max": ordered[-1], "total": sum(ordered)}


def write(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--min-length", type=int, default=20)
    parser.add_argument("--distribution", choices=DISTRIBUTIONS, default="lognormal")
    parser.add_argument("--median", type=float, default=256, help="lognormal only")
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="measure the real token lengths with this tokenizer")
    args = parser.parse_args()
    rows = make_rows(args.count, args.max_length, args.min_length, args.median, args.sigma,
                     args.seed, args.distribution)
    write(rows, args.out)
    print(f"{len(rows)} rows written to {args.out}")
    if args.tokenizer:
        print("token lengths:", json.dumps(describe(token_lengths(rows, args.tokenizer))))


if __name__ == "__main__":
    main()
