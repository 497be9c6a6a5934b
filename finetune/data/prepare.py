"""Training data, prepared once and cached on disk: read, validated and handed to the
method's own preparation (its module's `prepare`, which the worker passes in): the
methods that tokenize in finetune (config/methods.py `tokenizes`) tokenize there, the
others check their rows.

The cache entry's key hashes everything the result depends on: the data files (path and
content, as data/files.content_digest hashes it; a hub dataset: its id, subset, split
and revision; the pictures rows name are stamped instead, data/picture_stamps.py), the
tokenizer's saved files, the method, the data section, the settings
that change tokenization (for generating methods, the prompt length the model's context
leaves), and the library versions.
A second run with the same key loads the entry instead of preparing again.

Within a run, the main process of each machine (LOCAL_RANK 0) prepares; the other ranks
wait for the entry's completion marker on the file system, not in a collective. That runs
before the process group exists, so no NCCL/gloo timeout can fire however long the
tokenization takes (the pain of LLaMA-Factory#2424, alignment-handbook#190). Entries are
written to a private directory and renamed into place whole, so a crash leaves none
half-written and two machines preparing into one shared cache cannot collide.

An entry lists its files (sizes; SHA-256 of the small ones) and is verified before use: a
damaged one (a file deleted, truncated, unreadable or replaced by hand, a meta.json this
version did not write, a full disk, bytes that fail to load) is removed and prepared
again, with a line saying so. A private directory is named by its writer's pid and host,
so the next run on that host removes those of dead writers (a SIGKILL mid-write) at once;
another host's are removed after a day.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
from datasets import load_from_disk

from finetune import __version__
from finetune.fileio.atomic import sha256_of
from finetune.data.load import FORMATS, Splits, load_data
from finetune.data.files import list_data_files
from finetune.model.tokenizer import require_chat_template
from finetune.config.derived.effective import record
from finetune.config.rules import is_local
from finetune.config.schema import Experiment
from finetune.errors import FAILED_MARKER, DataError, RunError, first_line, one_line
from finetune.data.files import content_digest
from finetune.data import picture_stamps

# Bump when what is stored changes (4: sft conversations train assistant turns by default;
# 5: bare tool schemas wrapped and JSON-text tool-call arguments decoded for the template;
# 6: the pictures rows name stamped in meta.json).
VERSION = 6
META = "meta.json"  # written last: its presence marks a complete entry
# Training settings that change what preparation produces.
SETTINGS = ("max_length", "truncation_mode", "assistant_only_loss", "completion_only_loss",
            "packing", "packing_strategy", "eval_packing", "shuffle_dataset", "seed",
            "dataset_text_field")
PACKAGES = ("transformers", "tokenizers", "datasets", "trl")
POLL_SECONDS = 0.2
STAGING_MAX_AGE = 24 * 3600  # seconds
HASHED_BELOW = 2**20  # entry files hashed when verified (state, features); sized above
PARTS = ("train", "eval", "eval_rows")
# What reading a damaged entry raises (datasets and pyarrow on bytes they cannot parse).
LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, RecursionError, pa.ArrowException)
_STAGING = re.compile(r"^\.[0-9a-f]+\.(?P<pid>\d+)@(?P<host>.+)\.[^.]+$")


def cache_root(experiment: Experiment, run_dir: Path) -> Path:
    spec = experiment.data.cache_dir
    return Path(spec) if spec else run_dir.parent / ".data-cache"


def _sources_digest(experiment: Experiment) -> list[Any]:
    # Content, not size and modification time: a copy that keeps both (cp -p, rsync -t,
    # touch -r) changes the data all the same.
    out = []
    for source in experiment.data.train + (experiment.data.eval or []):
        if not is_local(source.path):
            out.append([source.path, source.subset, source.split, source.revision])
            continue
        out.append([[str(f.resolve()), content_digest(f)]
                    for f in list_data_files(Path(source.path))])
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
        "prompt_limit": _prompt_limit(experiment),
        # finetune's own version from the package: a source tree run without installing
        # has no distribution metadata.
        "packages": {"finetune": __version__,
                     **{name: metadata.version(name) for name in PACKAGES}},
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _prompt_limit(experiment: Experiment) -> int | None:
    """Generating methods refuse prompts the model's context cannot hold (data/prompts.py)."""
    if not record(experiment).generates:
        return None
    from finetune.data.prompts import prompt_limit

    return prompt_limit(experiment)


# The method's preparation: prepare(splits, tokenizer, experiment) -> splits, or None.
MethodPrepare = Callable[[Splits, Any, Experiment], Splits] | None


def prepare(experiment: Experiment, tokenizer, method_prepare: MethodPrepare) -> Splits:
    """Read and validate the rows, then let the method tokenize (or check) them. The rows'
    origins go once the method has used them for its errors."""
    splits = load_data(experiment)
    if not experiment.data.streaming:  # a stream is text rows: no template renders them
        require_chat_template(splits, tokenizer, experiment)
    if method_prepare:
        splits = method_prepare(splits, tokenizer, experiment)
    return splits.without_origin()


def _staging_prefix(entry: Path) -> str:
    # The writer's pid and host in the name: a later run can tell a dead writer's leftovers
    # from a live writer's work (another rank, machine or run preparing the same data).
    return f".{entry.name}.{os.getpid()}@{socket.gethostname()}."


def _writer_is_dead(staging: Path) -> bool:
    """A staging directory named by a process of this host that no longer runs."""
    match = _STAGING.match(staging.name)
    if match is None or match["host"] != socket.gethostname():
        return False  # another machine's: only its age can tell (see _remove_abandoned)
    try:
        os.kill(int(match["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False  # another user's live process (or no such pid on this system)
    return False


def _remove_abandoned(entry: Path) -> None:
    """Staging directories left by writers killed mid-write (SIGKILL, OOM, node loss):
    any key's whose writer on this host is dead, and this key's untouched for a day (a
    live writer, even one tokenizing for hours, is not that old)."""
    for staging in entry.parent.glob(".*"):
        try:
            stale = _writer_is_dead(staging) or (
                staging.name.startswith(f".{entry.name}.")
                and time.time() - staging.stat().st_mtime > STAGING_MAX_AGE)
        except FileNotFoundError:
            continue  # renamed into place or removed meanwhile
        if stale:
            _remove(staging)
            print(f"finetune: removed {staging}, left by a data preparation that did not "
                  "finish", flush=True)


def _listing(folder: Path, hashed: bool = True) -> dict[str, dict[str, Any]]:
    """Size of every file of an entry, SHA-256 of the small ones (state, features)."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / META):
        size = path.stat().st_size
        files[str(path.relative_to(folder))] = {"size": size, **(
            {"sha256": sha256_of(path)} if hashed and size <= HASHED_BELOW else {})}
    return files


def _meta_problem(meta: Any) -> str | None:
    """What is wrong with a parsed meta.json, or None."""
    if not isinstance(meta, dict):
        return "not an object"
    if not isinstance(meta.get("format"), str) or meta["format"] not in FORMATS:
        return f"format {meta.get('format')!r}"
    parts, files = meta.get("parts"), meta.get("files")
    if not isinstance(parts, list) or "train" not in parts or \
            not all(isinstance(p, str) and p in PARTS for p in parts):
        return f"parts {parts!r}"
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and type(e.get("size")) is int
            and isinstance(e.get("sha256", ""), str) for e in files.values()):
        return "files"
    empty = [p for p in parts if not any(name.startswith(f"{p}/") for name in files)]
    return f"part {empty[0]} has no files" if empty else None


def _derived(name: str) -> bool:
    """A file datasets writes beside a loaded part when a trainer maps or filters it
    (part/cache-<fingerprint>.arrow; TRL's reward and DPO trainers do): not the entry's,
    never loaded with it, so neither damage nor part of what meta.json lists."""
    part, _, file = name.partition("/")
    return "/" not in file and file.startswith("cache-") and file.endswith(".arrow")


def _entry_problem(entry: Path) -> str | None:
    if not entry.is_dir() or entry.is_symlink():
        return "not a directory"
    try:
        meta = json.loads((entry / META).read_text())
    except FileNotFoundError:
        return f"no {META}"
    except (OSError, ValueError, RecursionError) as exc:
        return f"{META} is unreadable ({_failure(exc)})"
    problem = _meta_problem(meta)
    if problem:
        return f"{META} is not one this version of finetune wrote ({problem})"
    files = meta["files"]
    on_disk = {name for name in _listing(entry, hashed=False) if not _derived(name)}
    missing, unlisted = sorted(set(files) - on_disk), sorted(on_disk - set(files))
    if missing or unlisted:
        return f"{one_line(missing[0])} is missing" if missing else \
            f"{one_line(unlisted[0])} is not listed in {META}"
    for name, expected in files.items():
        size = (entry / name).stat().st_size
        if size != expected["size"]:
            return f"{name} has {size} bytes, {META} says {expected['size']}"
        if "sha256" in expected and sha256_of(entry / name) != expected["sha256"]:
            return f"{name} does not match its SHA-256 in {META}"
    return None


def entry_problem(entry: Path) -> str | None:
    """Why a cache entry cannot be used (a file deleted, truncated, edited, unreadable or
    added, a meta.json this version did not write), or None."""
    try:
        return _entry_problem(entry)
    except (OSError, ValueError, RecursionError) as exc:  # unreadable: damaged to this user
        return f"cannot be read ({_failure(exc)})"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _discard(entry: Path) -> None:
    """Move a damaged entry aside (atomically: no rank loads half of it), then delete it
    (a directory, or whatever file replaced it). Named as this process's staging, so a
    kill mid-delete is cleaned up next time."""
    aside = entry.parent / f"{_staging_prefix(entry)}damaged"
    try:
        entry.rename(aside)
    except FileNotFoundError:
        return  # another machine's main process moved it first
    _remove(aside)


def _save(splits: Splits, entry: Path) -> None:
    """Write aside, then rename into place; a concurrent writer's entry wins if first."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(entry), dir=entry.parent))
    try:
        parts = {"train": splits.train, "eval": splits.eval, "eval_rows": splits.eval_rows}
        for name, dataset in parts.items():
            if dataset is not None:
                dataset.save_to_disk(str(staging / name))
        meta = {"format": splits.format, "notes": splits.notes,
                "parts": [n for n, d in parts.items() if d is not None],
                "rows": {n: len(d) for n, d in parts.items() if d is not None},
                "mix": splits.mix, "pictures": picture_stamps.stamps(parts.values()),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": _listing(staging)}
        (staging / META).write_text(json.dumps(meta, indent=1))
        try:
            staging.rename(entry)
        except OSError:
            if not (entry / META).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _read(entry: Path) -> Splits:
    """The entry's splits; one of LOAD_ERRORS where damage the listing cannot see (bytes
    changed in a large file, its size kept) fails to load."""
    meta = json.loads((entry / META).read_text())
    part = lambda name: load_from_disk(str(entry / name)) if name in meta["parts"] else None
    return Splits(train=part("train"), eval=part("eval"), format=meta["format"],
                  eval_rows=part("eval_rows"), mix=meta.get("mix"),
                  notes=meta.get("notes", []))


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {one_line(str(exc))[:200]}"


def _meta_stamp(entry: Path) -> tuple[int, int] | None:
    try:
        stat = (entry / META).stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _wait(entry: Path, run_dir: Path, launched: float, rank: int,
          replaced: tuple[int, int] | None = None) -> None:
    """Until the local main's entry is complete (and, with `replaced`, another than the
    one whose meta.json had that stamp), or a rank of this launch has reported a failure
    (failed-<rank>.json newer than this process's start: the ranks of a launch start
    together, and none can fail before its own imports are done)."""
    waiting = time.time()
    told = False
    while not (entry / META).exists() or entry_problem(entry) is not None or \
            (replaced is not None and _meta_stamp(entry) == replaced):
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


def _cached(entry: Path) -> tuple[Splits | None, str | None]:
    """(splits, None) from a sound entry, (None, why not) from a damaged or out-of-date
    one ("is damaged (...)"), (None, None) when there is none."""
    if not os.path.lexists(entry):
        return None, None
    damage = entry_problem(entry)
    if damage is None:
        try:
            splits = _read(entry)
        except LOAD_ERRORS as exc:
            damage = f"cannot be loaded ({_failure(exc)})"
        else:
            meta = json.loads((entry / META).read_text())
            stale = picture_stamps.changed(meta.get("pictures"))
            if stale is None:
                return splits, None
            return None, f"is out of date ({stale} since it was cached)"
    return None, f"is damaged ({damage})"


def prepared_data(experiment: Experiment, tokenizer, method_prepare: MethodPrepare,
                  run_dir: Path, launched: float, env: dict[str, str] | None = None) -> Splits:
    """This rank's data: from the cache, prepared by this machine's main process.
    method_prepare: the method's own preparation (finetune.methods.preparation);
    `launched`: when this process started (time.time())."""
    env = os.environ if env is None else env
    if not experiment.data.cache or experiment.data.streaming:  # a stream is never stored
        return prepare(experiment, tokenizer, method_prepare)
    entry = cache_root(experiment, run_dir) / cache_key(experiment, tokenizer)
    rank = int(env.get("RANK", "0"))
    if int(env.get("LOCAL_RANK", "0")) != 0:
        stamp = None
        while True:
            _wait(entry, run_dir, launched, rank, replaced=stamp)
            splits, damage = _cached(entry)
            if splits is not None:
                return splits
            stamp = _meta_stamp(entry)  # damaged: the local main prepares it again
    if entry.parent.is_dir():
        _remove_abandoned(entry)
    splits, damage = _cached(entry)
    if splits is not None:
        if rank == 0:
            print(f"finetune: data loaded from the cache {entry}", flush=True)
        return splits
    if damage is not None:
        print(f"finetune: the data cache entry {entry} {damage}; preparing it again",
              flush=True)
        _discard(entry)
    splits = prepare(experiment, tokenizer, method_prepare)
    try:
        _save(splits, entry)
    except OSError as exc:  # not writable, not a directory, a full disk
        raise RunError(f"cannot write the data cache entry {entry}: "
                       f"{exc.strerror or first_line(exc)} (data.cache_dir chooses where it "
                       "goes; data.cache: false prepares without one)") from None
    print(f"finetune: data prepared and cached in {entry}", flush=True)
    try:
        return _read(entry)
    except LOAD_ERRORS as exc:  # just written: the file system failed
        raise DataError(f"the data cache entry {entry}, just written, cannot be loaded "
                        f"({_failure(exc)})") from None
