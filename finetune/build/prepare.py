"""Training data, prepared once and cached on disk: read, validated and, for the methods
that tokenize in finetune (sft, reward, classify), tokenized.

The cache entry's key hashes everything the result depends on: the data files (path,
size, modification time; a hub dataset: its id, subset, split and revision), the
tokenizer's saved files, the method, the data section, the settings that change
tokenization, and the library versions.
A second run with the same key loads the entry instead of preparing again.

Within a run, the main process of each machine (LOCAL_RANK 0) prepares; the other ranks
wait for the entry's completion marker on the file system, not in a collective. That runs
before the process group exists, so no NCCL/gloo timeout can fire however long the
tokenization takes (the pain of LLaMA-Factory#2424, alignment-handbook#190). Entries are
written to a private directory and renamed into place whole, so a crash leaves none
half-written and two machines preparing into one shared cache cannot collide.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from datasets import load_from_disk

from finetune import __version__
from finetune.build.data import Splits, load_data
from finetune.build.tokenizer import require_chat_template
from finetune.config.rules import is_local
from finetune.config.schema import Experiment
from finetune.errors import FAILED_MARKER, DataError

VERSION = 1  # bump when what is stored changes
META = "meta.json"  # written last: its presence marks a complete entry
# Training settings that change what preparation produces.
SETTINGS = ("max_length", "truncation_mode", "assistant_only_loss", "completion_only_loss",
            "packing", "packing_strategy", "eval_packing", "shuffle_dataset", "seed",
            "dataset_text_field")
PACKAGES = ("transformers", "tokenizers", "datasets", "trl")
POLL_SECONDS = 0.2
STAGING_MAX_AGE = 24 * 3600  # seconds


def cache_root(experiment: Experiment, run_dir: Path) -> Path:
    spec = experiment.data.cache_dir
    return Path(spec) if spec else run_dir.parent / ".data-cache"


def _file_stamp(path: Path) -> list[Any]:
    # Path, size and modification time, as make and datasets' own cache do: cheap on
    # every rank however large the data, and changed by any edit or rewrite.
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def _sources_digest(experiment: Experiment) -> list[Any]:
    out = []
    for source in experiment.data.train + (experiment.data.eval or []):
        if not is_local(source.path):
            out.append([source.path, source.subset, source.split, source.revision])
            continue
        root = Path(source.path)
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        out.append([_file_stamp(f) for f in files])
    return out


def _tokenizer_digest(tokenizer) -> str:
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        for path in sorted(Path(folder).iterdir()):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cache_key(experiment: Experiment, tokenizer) -> str:
    data = experiment.data.model_dump(mode="json", exclude={"cache", "cache_dir"})
    settings = {k: experiment.training[k] for k in SETTINGS if k in experiment.training}
    described = {
        "version": VERSION, "method": experiment.method, "data": data, "settings": settings,
        "classify": experiment.classify.model_dump(mode="json") if experiment.classify else None,
        "sources": _sources_digest(experiment), "tokenizer": _tokenizer_digest(tokenizer),
        # finetune's own version from the package: a source tree run without installing
        # has no distribution metadata.
        "packages": {"finetune": __version__,
                     **{name: metadata.version(name) for name in PACKAGES}},
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _method_prepare(experiment: Experiment) -> Callable | None:
    from finetune.methods import METHODS

    module = importlib.import_module(f"finetune.methods.{METHODS[experiment.method]}")
    return getattr(module, "prepare", None)


def prepare(experiment: Experiment, tokenizer) -> Splits:
    """Read and validate the rows, then let the method tokenize them if it does."""
    splits = load_data(experiment)
    require_chat_template(splits, tokenizer, experiment)
    method_prepare = _method_prepare(experiment)
    return method_prepare(splits, tokenizer, experiment) if method_prepare else splits


def _remove_abandoned(entry: Path) -> None:
    """Staging directories of this key untouched for a day: left by a crash (a live
    writer, even one tokenizing for hours, is not that old)."""
    for staging in entry.parent.glob(f".{entry.name}.*"):
        if time.time() - staging.stat().st_mtime > STAGING_MAX_AGE:
            shutil.rmtree(staging, ignore_errors=True)


def _save(splits: Splits, entry: Path) -> None:
    """Write aside, then rename into place; a concurrent writer's entry wins if first."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(entry)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        parts = {"train": splits.train, "eval": splits.eval, "eval_rows": splits.eval_rows}
        for name, dataset in parts.items():
            if dataset is not None:
                dataset.save_to_disk(str(staging / name))
        meta = {"format": splits.format, "parts": [n for n, d in parts.items() if d is not None],
                "rows": {n: len(d) for n, d in parts.items() if d is not None},
                "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (staging / META).write_text(json.dumps(meta, indent=1))
        try:
            staging.rename(entry)
        except OSError:
            if not (entry / META).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _load(entry: Path) -> Splits:
    meta = json.loads((entry / META).read_text())
    part = lambda name: load_from_disk(str(entry / name)) if name in meta["parts"] else None
    return Splits(train=part("train"), eval=part("eval"), format=meta["format"],
                  eval_rows=part("eval_rows"))


def _wait(entry: Path, run_dir: Path, launched: float, rank: int) -> None:
    """Until the local main's entry is complete, or a rank of this launch has reported a
    failure (failed-<rank>.json newer than this process's start: the ranks of a launch
    start together, and none can fail before its own imports are done)."""
    waiting = time.time()
    told = False
    while not (entry / META).exists():
        failed = [p for p in run_dir.glob(FAILED_MARKER.replace(".json", "-*.json"))
                  if p.stat().st_mtime >= launched]
        if failed:
            raise DataError(f"rank {rank}: the data could not be prepared; the error is "
                            f"in {failed[0]} and above")
        if not told and time.time() - waiting > 10:
            print(f"finetune: rank {rank} waiting for the data being prepared into {entry}",
                  flush=True)
            told = True
        time.sleep(POLL_SECONDS)


def prepared_data(experiment: Experiment, tokenizer, run_dir: Path, launched: float,
                  env: dict[str, str] | None = None) -> Splits:
    """This rank's data: from the cache, prepared by this machine's main process.
    `launched`: when this process started (time.time())."""
    env = os.environ if env is None else env
    if not experiment.data.cache:
        return prepare(experiment, tokenizer)
    entry = cache_root(experiment, run_dir) / cache_key(experiment, tokenizer)
    if not (entry / META).exists():
        if int(env.get("LOCAL_RANK", "0")) == 0:
            _save(prepare(experiment, tokenizer), entry)
            print(f"finetune: data prepared and cached in {entry}", flush=True)
        else:
            _wait(entry, run_dir, launched, int(env.get("RANK", "0")))
    elif int(env.get("RANK", "0")) == 0:
        print(f"finetune: data loaded from the cache {entry}", flush=True)
    return _load(entry)
