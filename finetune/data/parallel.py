"""How many processes tokenize: training.dataset_num_proc, by default the cores this
process may run on (its CPU affinity, as a Slurm or taskset allocation sets it).

datasets' map splits the rows into contiguous shards, one per process, and joins the
results in order, so the prepared data is the same whatever the count (the cache entry's
key leaves it out, and so does the resume fingerprint). Small data is tokenized in this
process: starting workers costs more than it saves below ROWS_PER_PROCESS rows each."""

from __future__ import annotations

import os

from finetune.config.derived.effective import value
from finetune.config.schema import Experiment

ROWS_PER_PROCESS = 2000


def available_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def configured(experiment: Experiment) -> int:
    """training.dataset_num_proc, or the available cores."""
    chosen = value(experiment, "dataset_num_proc", default=None)
    return chosen if chosen else available_cores()


def processes(experiment: Experiment, rows: int) -> int | None:
    """num_proc for datasets' map over `rows` rows: None (this process) when one suffices."""
    count = min(configured(experiment), rows // ROWS_PER_PROCESS)
    return count if count > 1 else None
