"""Training and eval data: read local files or hub datasets, rename columns, detect the
row format, check every row (a bad one is reported with its file and row number), and
split off eval rows. Tokenizing is the method's (see data/prepare.py).

Every row carries its origin ("FILE row N") in the ORIGIN column through the split and the
method's tokenization, so an error found there names the file and row too;
data/prepare.py removes the column before the data reaches a trainer or the cache."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
from datasets import (Dataset, Features, LargeList, List, Value, concatenate_datasets,
                      load_dataset)

from finetune.data import formats, images, mix, peer_rows, plain_text, scratch
from finetune.data.files import checked_builder, diagnose_json, list_data_files
from finetune.data.rows import FORMATS, WEIGHT, check_row, preference_problem
from finetune.config.formats import SOURCES, target as source_target
from finetune.config.methods import method as method_record
from finetune.config.rules import is_local
from finetune.config.schema import DataSource, Experiment
from finetune.config.derived.effective import record, value
from finetune.errors import DataError, one_line

ORIGIN = "__origin__"  # "FILE row N" of every row, until data/prepare.py removes it


@dataclass
class Splits:
    train: Dataset
    eval: Dataset | None
    format: str
    # The validated eval rows before a method tokenized them (exact_match generates from
    # them); None when eval is still rows.
    eval_rows: Dataset | None = None
    # What the mix took from each source (data/mix.py `mixed`), for the start summary.
    mix: list[dict[str, Any]] | None = None
    # What reading did to the rows (a format converted), for the start summary.
    notes: list[str] = field(default_factory=list)

    @property
    def eval_examples(self) -> Dataset | None:
        return self.eval if self.eval_rows is None else self.eval_rows

    def tokenized(self, tokenize: Callable[[Dataset, str], Dataset]) -> "Splits":
        """tokenize(rows, split name) applied to train and eval; the eval rows are kept."""
        return Splits(train=tokenize(self.train, "train"),
                      eval=None if self.eval is None else tokenize(self.eval, "eval"),
                      format=self.format, eval_rows=self.eval, mix=self.mix, notes=self.notes)

    def without_origin(self) -> "Splits":
        """Without the ORIGIN column: what trainers (and grpo's reward functions) see."""
        drop = lambda ds: ds.remove_columns(ORIGIN) \
            if ds is not None and ORIGIN in (ds.column_names or ()) else ds
        return Splits(train=drop(self.train), eval=drop(self.eval), format=self.format,
                      eval_rows=drop(self.eval_rows), mix=self.mix, notes=self.notes)


def _root_cause(exc: BaseException) -> str:
    """datasets wraps the reader's error ("An error occurred while generating the
    dataset"); the user needs the reader's own words (pandas names the CSV line)."""
    while exc.__cause__ is not None or (exc.__context__ is not None
                                        and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__
    text = str(exc).removeprefix("Error tokenizing data. C error: ").strip()
    # pandas counts this one's rows from 0, header included: the file's line is one more.
    text = re.sub(r"starting at row (\d+)", lambda m: f"starting at line {int(m[1]) + 1}", text)
    return one_line(text) or type(exc).__name__


def _read_file(path: Path, notes: list[str]) -> Dataset:
    builder = checked_builder(path)
    if builder == "text":  # cut into documents as validate cuts it (data/plain_text.py)
        layout = plain_text.layout(path)
        notes.append(layout.note(path))
        return Dataset.from_dict({"text": [text for _, text in
                                           plain_text.documents(path, layout.blocks)]})
    try:
        # datasets keys its own cache of a local file by path and mtime only: an edit that
        # keeps the mtime (cp -p, touch -r) would read the old rows. finetune caches the
        # prepared data by content (data/prepare.py), so the file is converted afresh, into
        # a new directory of this process's own (data/scratch.py): a shared one would be
        # rewritten by another process's read while this one writes or maps files in it.
        return load_dataset(builder, data_files=str(path), split="train",
                            cache_dir=scratch.read_dir())
    except Exception as exc:  # datasets raises many types; the user needs file and cause
        located = diagnose_json(path) if builder == "json" else None
        raise DataError(located or f"{path}: cannot read as {builder}: {_root_cause(exc)}") \
            from None


def _renamed(ds: Dataset, original: str, target: str) -> Dataset:
    """Column `original` under the name `target` (a column already called that goes)."""
    if target == original:
        return ds
    if target in ds.column_names:
        ds = ds.remove_columns(target)
    return ds.rename_column(original, target)


def _read_source(source: DataSource, where: str,
                 notes: list[str]) -> list[tuple[str, Dataset]]:
    """(label, dataset) per file, so row numbers stay per file."""
    if is_local(source.path):
        parts = [(str(f), _read_file(f, notes)) for f in list_data_files(Path(source.path))]
    else:
        # datasets' shared cache: a hub dataset's arrow is keyed by its revision and, read
        # without force_redownload, prepared once under datasets' lock and never deleted.
        try:
            parts = [(source.path, load_dataset(source.path, source.subset, split=source.split,
                                                data_files=source.data_files,
                                                revision=source.revision))]
        except Exception as exc:
            raise DataError(f"{where}: cannot load hub dataset {source.path!r}: "
                            f"{one_line(str(exc))}") from None
    out = []
    for label, ds in parts:
        for target, original in source.columns.items():
            if original not in ds.column_names:
                raise DataError(f"{where}.columns.{target}: {label} has no column {original!r} "
                                f"(columns: {formats.names(ds.column_names)})")
            ds = _renamed(ds, original, target)
        out.append((label, ds))
    return out


def _weighted(label: str, ds: Dataset, column: str | None) -> Dataset:
    """The per-sample weight column, renamed to WEIGHT; missing is an error."""
    if column is None:
        return ds.remove_columns([WEIGHT]) if WEIGHT in ds.column_names else ds
    if column not in ds.column_names:
        raise DataError(f"{label}: no weight column {column!r} (data.weight_column); "
                        f"columns: {formats.names(ds.column_names)}")
    return _renamed(ds, column, WEIGHT)


def _validated(label: str, ds: Dataset, fmt: str, experiment: Experiment,
                failure: formats.Failure) -> Dataset:
    required, optional = FORMATS[fmt]
    missing = [c for c in required if c not in ds.column_names]
    if missing:
        raise DataError(f"{label}: format {fmt} needs column(s) {', '.join(missing)}; "
                        f"found {formats.names(ds.column_names)}")
    if fmt != "prompt":
        ds = _weighted(label, ds, experiment.data.weight_column)
        keep = [c for c in required + optional + (WEIGHT,) if c in ds.column_names]
        ds = ds.select_columns(keep)
    elif ORIGIN in ds.column_names:  # grpo/ppo keep every column for the reward functions
        raise DataError(f"{label}: the column name {ORIGIN} is finetune's own; rename it "
                        "(data.<split>[i].columns)")
    if fmt == "preference" and "prompt" in ds.column_names and \
            ds.data.column("prompt").null_count == len(ds):
        ds = ds.remove_columns("prompt")  # null on every row: no prompt, for reward and dpo
    has_prompt = "prompt" in ds.column_names
    shared_prompt = record(experiment).shared_prompt
    labels = experiment.classify.labels if experiment.classify else None
    number = 0
    try:
        for number, row in enumerate(ds, 1):
            problem = check_row(row, fmt, labels) or (
                preference_problem(row, has_prompt, shared_prompt)
                if fmt == "preference" else None)
            if problem:
                raise DataError(failure(number, problem))
    except (UnicodeDecodeError, RecursionError, pa.ArrowException) as exc:
        # Bytes the file's reader let through (a parquet string that is not UTF-8, say)
        # and that fail when the rows become Python values, a batch at a time.
        raise DataError(f"{label} row {number + 1} or a few after: cannot be read: "
                        f"{type(exc).__name__}: {one_line(str(exc))}") from None
    if len(ds) == 0:
        raise DataError(f"{label}: no rows")
    if fmt == "classification":
        ds = _label_ids(ds, labels)
    if fmt != "prompt":  # grpo/ppo hand their columns to reward functions as they are
        ds = _float_weights(ds)
    return ds.add_column(ORIGIN, [f"{label} row {n}" for n in range(1, len(ds) + 1)])


def _float_weights(ds: Dataset) -> Dataset:
    """Weights (the column, and turns' `weight`) typed float64: whole numbers read as
    int64, and files of int64 and float64 weights would not concatenate."""
    def cast(feature, name: str | None = None):
        if isinstance(feature, dict):
            return {key: cast(value, key) for key, value in feature.items()}
        if isinstance(feature, List):
            return List(cast(feature.feature), length=feature.length)
        if isinstance(feature, LargeList):
            return LargeList(cast(feature.feature))
        numeric = isinstance(feature, Value) and feature.dtype.startswith(("int", "uint", "float"))
        return Value("float64") if name == WEIGHT and (numeric or feature == Value("null")) \
            else feature

    features = cast(dict(ds.features))
    return ds if features == dict(ds.features) else ds.cast(Features(features))


def _label_ids(ds: Dataset, labels: list[str]) -> Dataset:
    """Class names become their index in classify.labels (the model's id2label is that
    list too). The column is typed int64 explicitly: map() keeps a column's old type, and
    a CSV's label column is text, so "1" would reach the collator as a string."""
    features = ds.features.copy()
    features["label"] = Value("int64")
    return ds.map(lambda row: {"label": labels.index(row["label"])
                               if isinstance(row["label"], str) else row["label"]},
                  features=features)


def _failure(label: str, raw: Dataset, fmt: str, forced: bool, experiment: Experiment,
             roles: dict[str, str]) -> formats.Failure:
    """(row number, problem) -> the error (formats.failure_text)."""
    labels = experiment.classify.labels if experiment.classify else None
    return lambda number, problem: formats.failure_text(
        f"{label} row {number}", problem, lambda: raw[number - 1], fmt, forced,
        experiment.method, roles, labels)


def _read_part(label: str, ds: Dataset, fmt: str | None, experiment: Experiment,
               notes: list[str], columns: dict[str, str]) -> tuple[Dataset, str]:
    """One file's rows in format fmt (None: detected), converted to the format the method
    trains on and validated; and fmt."""
    forced = experiment.data.format != "auto"
    ds = images.undecoded(ds)  # stored pictures checked as stored; resolved decodes them
    fmt = fmt or formats.detect_format(ds.column_names, experiment.method, label)
    roles = formats.speaker_roles(experiment.data.roles)
    failure = _failure(label, ds, fmt, forced, experiment, roles)
    trained = fmt
    if fmt in images.ONE_PICTURE_FORMATS and images.IMAGE in ds.column_names and \
            images.IMAGES not in ds.column_names:
        ds = images.one_picture(ds)
        notes.append(f"{label}: `image` read as a one-item `images`")
    ds, note = peer_rows.alpaca_input(label, ds, columns, failure)
    notes.extend([note] if note else [])
    ds, note = peer_rows.text_parts(label, ds, failure)
    notes.extend([note] if note else [])
    if fmt in SOURCES:
        trained = source_target(fmt, method_record(experiment.method).formats)
        missing = [c for c in SOURCES[fmt][0] if c not in ds.column_names]
        if missing:
            raise DataError(f"{label}: format {fmt} needs column(s) {', '.join(missing)}; "
                            f"found {formats.names(ds.column_names)}")
        ds, note = formats.converted(label, ds, fmt, trained, roles, failure)
        notes.append(note)
    elif fmt == "preference":
        ds, note = peer_rows.single_answers(label, ds, roles, failure)
        notes.extend([note] if note else [])
        ds, note = formats.text_prompts(label, ds, failure)
        notes.extend([note] if note else [])
    ds = _validated(label, ds, trained, experiment, failure)
    return images.resolved(label, ds, ORIGIN, experiment.method), fmt


def _joined(parts: list[tuple[str, Dataset]], where: str) -> Dataset:
    """The parts (label, rows) one after the other; parts of two schemas are an error."""
    if len(parts) == 1:
        return parts[0][1]
    try:
        return concatenate_datasets([ds for _, ds in parts])
    except ValueError as exc:
        (first, features), others = (parts[0][0], parts[0][1].features), parts[1:]
        other = next((label for label, ds in others if ds.features != features), others[-1][0])
        raise DataError(f"{where}: {first} and {other} do not share one schema (the "
                        f"same columns, of the same types): {one_line(str(exc))}") from None


def _load_split(sources: list[DataSource], split: str, experiment: Experiment,
                fmt: str | None, notes: list[str]) -> tuple[Dataset, str, list[dict[str, Any]]]:
    """The split's rows, the format read (the first file's, for every file), and what the
    mix (data/mix.py) took from each source."""
    parts = []
    for i, source in enumerate(sources):
        files = []
        for label, ds in _read_source(source, f"data.{split}[{i}]", notes):
            ds, fmt = _read_part(label, ds, fmt, experiment, notes, source.columns)
            files.append((label, ds))
        parts.append((source.path, _joined(files, f"data.{split}[{i}]")))
    parts, described = mix.mixed(parts, sources, mix.seed_of(experiment), split)
    return _joined(parts, f"data.{split}"), fmt, described


def _held_out(train: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """train_test_split, refused with the counts where it would leave either side empty."""
    rows = len(train)
    held = math.ceil(fraction * rows)  # as datasets rounds test_size
    if held < 1 or rows - held < 1:
        raise DataError(f"data.eval_fraction: {fraction} of the {rows} training row(s) holds "
                        f"out {held} for eval and leaves {rows - held} to train on; both need "
                        "at least 1 (more rows, another fraction, or data.eval)")
    parts = train.train_test_split(test_size=held, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def load_data(experiment: Experiment) -> Splits:
    spec = experiment.data
    fmt = None if spec.format == "auto" else spec.format
    notes: list[str] = []
    if spec.streaming:  # read as training goes (data/stream.py); eval data is read whole
        from finetune.data.stream import train_stream

        train, fmt, mixture = train_stream(experiment), "text", []
        notes.append("data.train is streamed: read, tokenized and packed as training goes, "
                     "not cached")
    else:
        train, fmt, mixture = _load_split(spec.train, "train", experiment, fmt, notes)
    evaluation = None
    if spec.eval is not None:
        evaluation, _, eval_mixture = _load_split(spec.eval, "eval", experiment, fmt, notes)
        mixture += eval_mixture
    elif spec.eval_fraction is not None:
        seed = value(experiment, "seed")
        train, evaluation = _held_out(train, spec.eval_fraction, seed)
    own = method_record(experiment.method).formats
    trained = source_target(fmt, own) or fmt
    if trained == "preference" and "unpaired_preference" in own:
        # After the eval split, so that both answers of a pair stay on one side.
        counts = f"{len(train)} training" + ("" if evaluation is None else
                                            f" and {len(evaluation)} eval")
        train = formats.unpaired(train, ORIGIN)
        evaluation = None if evaluation is None else formats.unpaired(evaluation, ORIGIN)
        trained = "unpaired_preference"
        notes.append(f"data: {counts} preference pair(s) read as unpaired rows (method "
                     f"{experiment.method}): each pair's chosen answer as a desirable row "
                     "(label true), its rejected answer as an undesirable one (label false)")
    return Splits(train=train, eval=evaluation, format=trained, mix=mixture, notes=notes)
