"""data.streaming: the training rows of continued pretraining, read lazily.

The local files are read row by row with validate's readers and checks (data/scan.py:
the same file, JSON and row checks as training's whole-data path), as text rows that keep
their origin ("FILE line N") for errors found later. Nothing is held in memory or cached:
methods/sft.py tokenizes and packs the stream as the Trainer reads it.

The stream never ends: it reads the sources in order, and again from the start when they
are done, until training.max_steps. One endless stream is what makes a resume exact: the
Trainer resumes a dataset without a length by skipping the first global_step x
accumulation batches of its first epoch (accelerate's skip_first_batches), so the stream,
its mix and its packing must be the same on every read, and that skip must never run past
an epoch's end. Weighted sources are interleaved at random (datasets'
interleave_datasets, seeded by data.seed), each source endless on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

from datasets import Features, IterableDataset, Value, interleave_datasets

from finetune.config.schema import DataSource, Experiment
from finetune.data.files import list_data_files
from finetune.data.mix import seed_of
from finetune.data.scan import ORIGIN, FileCheck, file_rows  # ORIGIN: data/load.py's
from finetune.errors import DataError

FEATURES = Features({"text": Value("string"), ORIGIN: Value("string")})


class _Quiet:
    """scan.file_rows reports bytes read to a progress bar; a stream shows none."""

    def at(self, position: int) -> None:
        pass

    def file_done(self, size: int) -> None:
        pass


def _file_text(path: Path, source: DataSource, where: str,
               experiment: Experiment) -> Iterator[dict[str, Any]]:
    fmt = None if experiment.data.format == "auto" else experiment.data.format
    check = FileCheck(str(path), fmt, experiment, source, where)
    for at, raw in file_rows(path, _Quiet()):
        row = check.check(at, raw)
        if check.trained != "text":
            raise DataError(f"{where}: {path} is format {check.fmt}; data.streaming streams "
                            "text rows (a `text` column) only")
        yield {"text": row["text"], ORIGIN: at}
    check.finish()


def _one_pass(sources: list[tuple[str, DataSource]],
              experiment: Experiment) -> Iterator[dict[str, Any]]:
    for where, source in sources:
        for path in list_data_files(Path(source.path)):
            yield from _file_text(path, source, where, experiment)


def _endless(sources: list[tuple[str, DataSource]],
             experiment: Experiment) -> Callable[[], Iterator[dict[str, Any]]]:
    def rows() -> Iterator[dict[str, Any]]:
        while True:
            yield from _one_pass(sources, experiment)

    return rows


def _stream(rows: Callable[[], Iterator[dict[str, Any]]]) -> IterableDataset:
    # No gen_kwargs: a stream of one shard, which accelerate splits between processes
    # by batches (IterableDatasetShard), the same global batches as one process reads.
    return IterableDataset.from_generator(rows, features=FEATURES)


def train_stream(experiment: Experiment) -> IterableDataset:
    """The endless stream of the training sources' text rows (with ORIGIN)."""
    sources = [(f"data.train[{i}]", s) for i, s in enumerate(experiment.data.train)]
    weights = [source.weight for _, source in sources]
    if len(sources) == 1 or any(w is None for w in weights):
        return _stream(_endless(sources, experiment))
    total = sum(weights)
    return interleave_datasets([_stream(_endless([s], experiment)) for s in sources],
                               probabilities=[w / total for w in weights],
                               seed=seed_of(experiment), stopping_strategy="all_exhausted")
