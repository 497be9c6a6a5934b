"""Data too small to train or evaluate well, said before it wastes a GPU hour: fewer rows
than one global batch, a run that goes over its rows more than MAX_PASSES times, an eval
split of 0 or 1 rows. Warnings, not errors: training can start. validate says them from
the rows it counted, a run's start from the rows it loaded. Torch-free."""

from __future__ import annotations

import math

from finetune.config.derived.effective import record, value
from finetune.config.schema import Experiment

MAX_PASSES = 10


def global_batch(experiment: Experiment) -> int:
    """Rows per optimizer step: per device x accumulation x data-parallel processes."""
    return (value(experiment, "per_device_train_batch_size")
            * value(experiment, "gradient_accumulation_steps")
            * experiment.distributed.data_parallel)


def size_warnings(experiment: Experiment, train_rows: int | None,
                  eval_rows: int | None) -> list[str]:
    """What to say about `train_rows` and `eval_rows` (None: not known here). The passes
    over the data are counted for the methods that train on rows as given; the generating
    ones (grpo, rloo, ppo, distill, gkd) batch completions, not rows."""
    warnings = []
    batch = global_batch(experiment)
    if train_rows is not None and record(experiment).completion_length is None:
        if train_rows < batch:
            warnings.append(f"data.train: {train_rows} row(s), fewer than one global batch "
                            f"({batch}: per device x accumulation x processes): every step "
                            "repeats rows")
        steps = value(experiment, "max_steps")
        passes = steps * batch / max(train_rows, 1) if steps and steps > 0 else \
            value(experiment, "num_train_epochs")
        if passes > MAX_PASSES:
            how = (f"training.max_steps {steps} x global batch {batch}" if steps and steps > 0
                   else "training.num_train_epochs")
            warnings.append(f"data.train: {how} goes over its {train_rows} row(s) about "
                            f"{math.floor(passes)} times (more than {MAX_PASSES}): the model "
                            "will learn these rows by heart; give more rows or fewer steps")
    if eval_rows is not None and eval_rows <= 1:
        warnings.append(f"data.eval: {eval_rows} row(s): its metrics say little about the "
                        "model; give more rows (data.eval, or a larger data.eval_fraction)")
    return warnings


def counted_rows(experiment: Experiment, rows: dict[str, int]) -> tuple[int | None, int | None]:
    """Train and eval rows as training will load them, from validate's per-source counts
    ('data.train[0]': rows): max_samples and eval_fraction applied. None for a split with
    a source validate does not read (the hub), or a weighted mixture."""
    data = experiment.data

    def split(name: str) -> int | None:
        sources = getattr(data, name) or []
        if any(f"data.{name}[{i}]" not in rows for i in range(len(sources))) or \
                any(s.weight is not None for s in sources):
            return None
        return sum(min(rows[f"data.{name}[{i}]"], s.max_samples or math.inf)
                   for i, s in enumerate(sources))

    train = split("train")
    if data.eval is not None:
        return train, split("eval")
    if data.eval_fraction is not None and train is not None:
        held = math.ceil(data.eval_fraction * train)  # as data/load.py holds them out
        return train - held, held
    return train, None
