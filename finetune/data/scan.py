"""`finetune validate`'s data pass: every row of every local data source read and checked
as training reads and checks it (data/load.py), one row at a time and without `datasets`,
so a bad row is reported (file, line, field) before anything heavy loads, and a file
larger than memory streams through.

The checks are those training runs: data/files.py's (the bytes, the JSON, the values),
data/formats.py's and data/peer_rows.py's (format detection, the conversions) and
data/rows.py's (the format's row check, weights, labels, a file's prompts). This module
reads rows and hands them to those checks in training's order; it checks nothing itself.

What reading alone cannot see is left to training: hub datasets (read there, not here),
a JSON Lines file whose first row lacks a column later rows have (training detects the
format from every row's columns, this pass from the first row's), and the mix's draws.
"""

from __future__ import annotations

import codecs
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from finetune.config.derived.effective import record
from finetune.config.formats import SOURCES, target as source_target
from finetune.config.methods import method as method_record
from finetune.config.rules import is_local
from finetune.config.rules.vision import PREFIX_LM
from finetune.config import vision
from finetune.config.schema import DataSource, Experiment
from finetune.data import formats, images, peer_rows, plain_text
from finetune.data.images import IMAGES
from finetune.data.files import (MAX_DEPTH, checked_builder, is_document, list_data_files,
                                 not_an_object, parse_json, value_problem)
from finetune.data.rows import FORMATS, PREFIX_LM_ROWS, TURN_WEIGHTS_WITH_IMAGES, WEIGHT, \
    check_row, preference_problem, turn_weighted
from finetune.data.sizes import counted_rows, size_warnings
from finetune.errors import DataError, one_line
from finetune.model import chat_template

ORIGIN = "__origin__"  # data/load.py's; a prompt row may not have a column of that name
BATCH = 8192  # rows of a CSV chunk or parquet batch, and between progress updates
# A JSON line needs this many brackets to nest beyond MAX_DEPTH. Only such lines, and
# those with a surrogate escape ("\ud..."), are walked value by value (value_problem).
DEEP = MAX_DEPTH - 1


@dataclass
class Counts:
    """What the pass read: rows per source, and lines for the user."""
    rows: int = 0
    notes: list[str] = field(default_factory=list)


class Progress:
    """Bytes read, on a tqdm bar on stderr (as datasets' preparation bars) that shows only
    once the pass has taken a second."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="checking data",
                        delay=1.0, file=sys.stderr, leave=False)
        self.position = 0  # bytes of the current file counted

    def at(self, position: int) -> None:
        self.bar.update(position - self.position)
        self.position = position

    def file_done(self, size: int) -> None:
        self.at(size)
        self.position = 0


def _json_lines(path: Path, progress: Progress) -> Iterator[tuple[str, Any]]:
    decode = json.JSONDecoder().decode  # json.loads less its per-call type checks
    with path.open("rb") as handle:
        for number, line in enumerate(handle, 1):
            if number % BATCH == 0:
                progress.at(handle.tell())
            if not line.strip():
                continue
            try:  # UTF-8 throughout: check_file made sure
                row = decode(line.decode().removeprefix("\ufeff") if number == 1
                             else line.decode())
            except (ValueError, RecursionError):
                row, problem = parse_json(line.removeprefix(codecs.BOM_UTF8))
                raise DataError(f"{path} line {number}: {problem}") from None
            problem = not_an_object(row) or (
                value_problem(row) if b"\\ud" in line or b"\\uD" in line
                or line.count(b"[") + line.count(b"{") >= DEEP else None)
            if problem:
                raise DataError(f"{path} line {number}: {problem}")
            yield f"{path} line {number}", row


def _json_document(path: Path) -> Iterator[tuple[str, Any]]:
    rows, problem = parse_json(path.read_bytes().removeprefix(codecs.BOM_UTF8))
    if problem:
        raise DataError(f"{path}: {problem}")
    for number, row in enumerate(rows if isinstance(rows, list) else [rows], 1):
        problem = not_an_object(row) or value_problem(row)
        if problem:
            raise DataError(f"{path} row {number}: {problem}")
        yield f"{path} row {number}", row


def _tables(path: Path, builder: str):
    """The file's Arrow tables, as datasets' csv and parquet readers make them."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        yield from pq.ParquetFile(path).iter_batches(batch_size=BATCH)
        return
    import pandas as pd
    import pyarrow as pa

    # datasets' csv builder: pandas in chunks of 10,000 rows, each made an Arrow table.
    for chunk in pd.read_csv(path, iterator=True, chunksize=10_000):
        yield pa.Table.from_pandas(chunk, preserve_index=False)


def _table_rows(path: Path, builder: str) -> Iterator[tuple[str, Any]]:
    number = 0
    try:
        for table in _tables(path, builder):
            for row in table.to_pylist():
                number += 1
                yield f"{path} row {number}", row
    except DataError:
        raise
    except Exception as exc:  # pandas/pyarrow raise many types; the user needs the cause
        raise DataError(f"{path} row {number + 1} or a few after: cannot read as {builder}: "
                        f"{type(exc).__name__}: {one_line(str(exc))}") from None


def file_rows(path: Path, progress: Progress) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) of every row of a local data file, after training's file checks."""
    builder = checked_builder(path)
    if builder == "text":
        for number, text in plain_text.documents(path, plain_text.layout(path).blocks):
            yield f"{path} line {number}", {"text": text}
    elif builder != "json":
        yield from _table_rows(path, builder)
    elif is_document(path):
        yield from _json_document(path)
    else:
        yield from _json_lines(path, progress)
    progress.file_done(path.stat().st_size)


class FileCheck:
    """One file's rows checked in order, as data/load.py's _read_part checks the file's
    dataset: renamed columns, the format detected (or carried from the split's first
    file), a source format's rows converted, then the trained format's row checks."""

    def __init__(self, label: str, fmt: str | None, experiment: Experiment,
                 source: DataSource, where: str):
        self.label, self.fmt, self.experiment, self.where = label, fmt, experiment, where
        self.columns = [(t, o) for t, o in source.columns.items() if t != o]
        self.mapping = source.columns
        self.roles = formats.speaker_roles(experiment.data.roles)
        self.labels = experiment.classify.labels if experiment.classify else None
        self.shared_prompt = record(experiment).shared_prompt
        self.trained: str | None = None
        self.rows = 0
        self.vision_model = False  # rows with images: the model checked once
        # a local vision-language model trains through TRL's vision path, which finds
        # weighted turns as runs of trained tokens (methods/sft_vision.py)
        self.vision_run = where.startswith("data.train") and \
            vision.is_vision_language(experiment.model.name_or_path)
        self.prefix_lm = self.vision_run and \
            vision.model_type(experiment.model.name_or_path) in PREFIX_LM
        # preference rows with a prompt; the first without one; the first whose chosen and
        # rejected share no turn (an error only if no row has a prompt)
        self.prompts = 0
        self.no_prompt: tuple[str, dict[str, Any]] | None = None
        self.shared_turns: tuple[str, str, dict[str, Any]] | None = None

    def _first(self, row: dict[str, Any]) -> None:
        """What training checks of the file's columns, from the first row's."""
        for target, original in self.columns:
            if original not in row:
                raise DataError(f"{self.where}.columns.{target}: {self.label} has no column "
                                f"{original!r} (columns: {formats.names(row)})")
        renamed = self._renamed(dict(row))
        self.fmt = self.fmt or formats.detect_format(renamed, self.experiment.method,
                                                     self.label)
        methods = method_record(self.experiment.method).formats
        self.trained = source_target(self.fmt, methods) or self.fmt
        needed = SOURCES[self.fmt][0] if self.fmt in SOURCES else FORMATS[self.trained][0]
        missing = [c for c in needed if c not in renamed]
        if missing:
            raise DataError(f"{self.label}: format {self.fmt} needs column(s) "
                            f"{', '.join(missing)}; found {formats.names(renamed)}")
        column = self.experiment.data.weight_column
        if self.trained != "prompt" and column is not None and column not in renamed:
            raise DataError(f"{self.label}: no weight column {column!r} (data.weight_column); "
                            f"columns: {formats.names(renamed)}")
        if self.trained == "prompt" and ORIGIN in renamed:
            raise DataError(f"{self.label}: the column name {ORIGIN} is finetune's own; "
                            "rename it (data.<split>[i].columns)")

    def _renamed(self, row: dict[str, Any]) -> dict[str, Any]:
        for target, original in self.columns:
            row[target] = row.pop(original, None)
        return row

    def _fail(self, where: str, problem: str, raw: dict[str, Any]) -> DataError:
        forced = self.experiment.data.format != "auto"
        return DataError(formats.failure_text(where, problem, lambda: raw, self.fmt, forced,
                                              self.experiment.method, self.roles, self.labels))

    def check(self, where: str, raw: dict[str, Any]) -> dict[str, Any]:
        """The row as training reads it (renamed, converted), once checked."""
        if self.rows == 0:
            self._first(raw)
        self.rows += 1
        raw = row = self._renamed(raw)
        if self.fmt in images.ONE_PICTURE_FORMATS:
            row = images.one_picture_row(row)
        row, _, problem = peer_rows.alpaca_input_row(row, self.mapping)
        if problem is None:
            row, _, problem = peer_rows.text_parts_row(row)
        if problem:
            raise self._fail(where, problem, raw)
        if self.fmt in SOURCES:
            problem = formats.PROBLEMS[self.fmt](row, self.roles)
            if problem:
                raise self._fail(where, problem, raw)
            row = formats.convert_row(row, self.fmt, self.trained, self.roles)
        elif self.trained == "preference":
            row, _, problem = peer_rows.single_answers_row(row, self.roles)
            if problem is None and isinstance(row.get("prompt"), str) and \
                    isinstance(row.get("chosen"), list):
                row, problem = formats.text_prompt_row(row)
            if problem:
                raise self._fail(where, problem, raw)
        if self.trained != "prompt":
            column = self.experiment.data.weight_column
            weight = row.pop(WEIGHT, None) if column is None else row.pop(column, None)
            if column is not None:
                row[WEIGHT] = weight
        problem = check_row(row, self.trained, self.labels)
        if problem is None and self.trained == "preference":
            problem = self._preference(where, row, raw)
        if problem:
            raise self._fail(where, problem, raw)
        if self.vision_run and self.trained == "messages" and turn_weighted(row) and \
                self.experiment.training.get("assistant_only_loss") is False:
            raise DataError(TURN_WEIGHTS_WITH_IMAGES)
        if self.prefix_lm and (self.trained == "messages" or isinstance(row.get("prompt"), list)):
            raise DataError(PREFIX_LM_ROWS)  # as methods/sft_vision.py at training
        if row.get(IMAGES) is not None:  # the files, as training resolves them (load.py)
            self.vision_model = self.vision_model or images.require_vision_model(
                self.experiment, where)
            images.resolved_paths(row[IMAGES], Path(self.label), where)
        return row

    def _preference(self, where: str, row: dict[str, Any], raw: dict[str, Any]) -> str | None:
        """preference_problem, whose `has_prompt` is the whole file's: a row without a
        prompt is an error once any row has one; without any, the shared-turn check."""
        if row.get("prompt") is not None:
            self.prompts += 1
            if self.no_prompt is not None:  # an earlier row had none: it is the error
                earlier, earlier_raw = self.no_prompt
                raise self._fail(earlier, preference_problem({}, True, False), earlier_raw)
            return preference_problem(row, True, self.shared_prompt)
        if self.prompts:
            return preference_problem(row, True, self.shared_prompt)
        if self.no_prompt is None:
            self.no_prompt = (where, raw)
        if self.shared_turns is None:
            problem = preference_problem(row, False, self.shared_prompt)
            self.shared_turns = (where, problem, raw) if problem else None
        return None

    def finish(self) -> None:
        if self.rows == 0:
            raise DataError(f"{self.label}: no rows")
        if self.shared_turns is not None and not self.prompts:
            raise self._fail(*self.shared_turns)


def _local_files(experiment: Experiment) -> dict[str, list[Path]]:
    return {f"data.{split}[{i}]": list_data_files(Path(source.path))
            for split in ("train", "eval") for i, source in
            enumerate(getattr(experiment.data, split) or []) if is_local(source.path)}


def check_data(experiment: Experiment) -> list[str]:
    """Read and check every row of the experiment's local data sources; the lines that
    say what was read (rows per source, the format, hub sources not read), and a warning
    line for data too small to train or evaluate well (data/sizes.py)."""
    files = _local_files(experiment)
    counts: dict[str, int] = {}
    total = sum(f.stat().st_size for paths in files.values() for f in paths)
    lines, fmt = [], None if experiment.data.format == "auto" else experiment.data.format
    rendered = chat_template.RowRenderer(experiment)  # rows in chat format, as training
    progress = Progress(total)
    try:
        for split in ("train", "eval"):
            for i, source in enumerate(getattr(experiment.data, split) or []):
                where = f"data.{split}[{i}]"
                if where not in files:
                    lines.append(f"{where}: hub dataset {source.path}: rows not read "
                                 "(validate reads local files; training checks these rows)")
                    continue
                rows = 0
                for path in files[where]:
                    check = FileCheck(str(path), fmt, experiment, source, where)
                    for at, row in file_rows(path, progress):
                        rendered(split, at, check.check(at, row))
                    check.finish()
                    if experiment.data.streaming and split == "train" and check.trained != "text":
                        raise DataError(f"{where}: {path} is format {check.fmt}; data.streaming "
                                        "streams text rows (a `text` column) only")
                    fmt, rows = check.fmt, rows + check.rows
                read_as = "" if check.fmt == check.trained else f", read as {check.trained}"
                lines.append(f"{where}: {source.path}: {rows} rows, format {check.fmt}{read_as}")
                counts[where] = rows
    finally:
        progress.bar.close()
    rendered.finish()
    train, evaluation = counted_rows(experiment, counts)
    if experiment.data.streaming:
        train = None  # read as training goes: its passes are the stream's
    return lines + [f"warning: {w}" for w in size_warnings(experiment, train, evaluation)]
