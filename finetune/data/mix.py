"""Data mixtures: each source of a data list sampled by its `max_samples` and `weight`.

max_samples keeps a seeded random sample of N rows (without replacement, in the file's
order), not the first N. Weights are proportions of the mix, and the mix keeps the total
(the sum of the sources' rows after max_samples): source i gets exactly
round(total x w_i / sum(w)) rows, rounded by largest remainder so the counts add up to the
total. A source asked for fewer rows than it has gives a random sample; one asked for more
is repeated whole as often as it fits, plus a random sample of the rest (oversampling, as
LLaMA-Factory's interleave_over, but with exact counts instead of a random stream's).
Without weights the sources are concatenated as they are.

Every draw comes from numpy's generator seeded with (data.seed or training.seed, split,
source index): the same experiment gives the same rows on every rank and every run, and
the rows reach the trainer, whose sampler shuffles them, in source order.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np

from finetune.config.derived.effective import value
from finetune.config.schema import DataSource, Experiment

if TYPE_CHECKING:
    from datasets import Dataset

SPLITS = ("train", "eval")


def seed_of(experiment: Experiment) -> int:
    seed = experiment.data.seed
    return value(experiment, "seed") if seed is None else seed


def shares(sizes: list[int], weights: list[float]) -> list[int]:
    """Rows per source: the total of sizes split in proportion to weights, exactly (the
    largest remainders get the rows that rounding down leaves; ties go to the earlier)."""
    total, whole = sum(sizes), sum(Fraction(w) for w in weights)
    quotas = [total * Fraction(w) / whole for w in weights]
    counts = [math.floor(q) for q in quotas]
    left = total - sum(counts)
    order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return counts


def draw(rows: int, count: int, rng: np.random.Generator) -> list[int]:
    """`count` row indices of `rows`: whole repeats, then a sample without replacement of
    the rest, each in the file's order."""
    repeats, rest = divmod(count, rows)
    sample = np.sort(rng.choice(rows, size=rest, replace=False)) if rest else []
    return [i for _ in range(repeats) for i in range(rows)] + [int(i) for i in sample]


def _take(ds: Dataset, indices: list[int]) -> Dataset:
    # A selection of every row in order is the dataset itself: no indices mapping.
    return ds if indices == list(range(len(ds))) else ds.select(indices)


def mixed(parts: list[tuple[str, Dataset]], sources: list[DataSource], seed: int,
          split: str) -> tuple[list[tuple[str, Dataset]], list[dict[str, Any]]]:
    """The sources' parts sampled as the mix asks, and a description of the mix per source:
    its rows, its rows after max_samples, the rows taken, their share of the mix."""
    rngs = [np.random.default_rng([seed, SPLITS.index(split), i]) for i in range(len(parts))]
    sampled = []
    for (label, ds), source, rng in zip(parts, sources, rngs):
        limit = source.max_samples
        indices = draw(len(ds), limit, rng) if limit is not None and limit < len(ds) \
            else list(range(len(ds)))
        sampled.append((label, _take(ds, indices)))
    sizes = [len(ds) for _, ds in sampled]
    weights = [source.weight for source in sources]
    if weights and all(w is not None for w in weights):
        counts = shares(sizes, weights)
        sampled = [(label, _take(ds, draw(len(ds), count, rng)) if count != len(ds) else ds)
                   for (label, ds), count, rng in zip(sampled, counts, rngs)]
    total = sum(len(ds) for _, ds in sampled)
    described = [{"split": split, "source": label, "rows": len(original),
                  "max_samples": source.max_samples, "sampled": size, "weight": source.weight,
                  "taken": len(ds), "share": len(ds) / total if total else 0.0}
                 for (label, original), (_, ds), source, size
                 in zip(parts, sampled, sources, sizes)]
    return sampled, described
