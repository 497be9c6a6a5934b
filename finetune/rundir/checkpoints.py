"""Checkpoints that are complete or ignored. Torch-free.

The Trainer writes checkpoints/checkpoint-<step>/ file by file; a kill mid-write leaves a
directory that looks like a checkpoint but is not one. After every rank has finished
writing, rank 0 adds MANIFEST (sizes of every file, SHA-256 of the small ones, and the
fingerprint of the experiment that wrote it), atomically and last. So a checkpoint without
a manifest is incomplete (a kill mid-save): reported, never resumed from, removed. One whose
manifest exists but is damaged, or whose files disagree with it, was damaged after it was
sealed: moved aside to damaged-checkpoint-<step>, never resumed from, never deleted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from finetune import __version__
from finetune.errors import RunError
from finetune.fileio.atomic import fsync_dir, sha256_of, write_atomic

MANIFEST = "finetune-manifest.json"
# Written in the run directory by rank 0 once a checkpoint asked for by a signal is sealed:
# how `finetune launch` knows its training processes stopped on purpose, to be resumed.
STOPPED = "stopped.json"
HASHED_BELOW = 16 * 2**20  # hash files up to 16 MiB (state, RNG, scheduler); size the rest
_STEP = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"  # what the Trainer resumes from: its step, its logs
NO_MANIFEST = "no manifest: its writing did not finish"
# A damaged checkpoint moved aside is renamed with this prefix: no longer checkpoint-<step>,
# so scans, rotation and new saves leave it alone.
DAMAGED = "damaged-"


def directory(output_dir: str | Path, step: int) -> Path:
    """Where the Trainer writes the checkpoint of `step`."""
    return Path(output_dir) / f"checkpoint-{step}"


def step_of(path: Path) -> int | None:
    match = _STEP.match(path.name)
    return int(match.group(1)) if match else None


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(checkpoint: Path, step: int, extra: dict[str, Any]) -> dict[str, Any]:
    """Seal a checkpoint whose files are all written (every rank has finished)."""
    files = {}
    for path in _files(checkpoint):
        with path.open("rb") as handle:
            os.fsync(handle.fileno())  # the files reach the disk before the manifest does
        size = path.stat().st_size
        entry: dict[str, Any] = {"size": size}
        if size <= HASHED_BELOW:
            entry["sha256"] = sha256_of(path)
        files[str(path.relative_to(checkpoint))] = entry
    manifest = {"finetune": __version__, "step": step, "time": round(time.time(), 3),
                **extra, "files": files}
    write_atomic(checkpoint / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _name_problem(name: str) -> str | None:
    """A `files` key must name a file inside the checkpoint, as write_manifest writes it."""
    path = PurePosixPath(name)
    if "\0" in name or path.is_absolute() or str(path) != name or not path.parts or \
            any(part in (".", "..") for part in path.parts):
        return f"`files` names {name[:60]!r}, not a path inside the checkpoint"
    if any(len(os.fsencode(part)) > 255 for part in path.parts):
        return f"`files` names {name[:60]!r}..., longer than a file name can be"
    return None


def _shape_problem(manifest: Any) -> str | None:
    """What in a manifest (edited by hand, say) is not what write_manifest writes."""
    if not isinstance(manifest, dict):
        return f"a JSON object expected, got {type(manifest).__name__}"
    if not _is_int(manifest.get("step")):
        return f"`step` is {manifest.get('step')!r}, not a step number"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "`files` is not an object listing the checkpoint's files"
    for name, entry in files.items():
        if why := _name_problem(name):
            return why
        if not isinstance(entry, dict) or not _is_int(entry.get("size")) or \
                not isinstance(entry.get("sha256", ""), str):
            return f"`files.{name}` is not {{size, sha256}}"
    if TRAINER_STATE not in files:
        return f"`files` lacks {TRAINER_STATE}, which the Trainer resumes from"
    if not isinstance(manifest.get("fingerprint"), dict):
        return "`fingerprint` is missing or not an object"
    layout = manifest.get("layout", {})
    if not isinstance(layout, dict) or (layout and not all(_is_int(layout.get(key)) for key in (
            "processes", "per_device_train_batch_size", "gradient_accumulation_steps",
            "global_batch"))):
        return "`layout` is not the processes, batch and accumulation of a run"
    return None


def read_manifest(checkpoint: Path) -> dict[str, Any]:
    """The manifest, checked for the shape write_manifest gives it (ValueError if not)."""
    path = checkpoint / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except RecursionError:
        raise ValueError("nested too deeply") from None
    shape = _shape_problem(manifest)
    if shape:
        raise ValueError(shape)
    return manifest


def _unreadable(path: Path, exc: OSError) -> RunError:
    """Not damage but this user's access: moving the checkpoint aside would not help."""
    return RunError(f"cannot read {path} ({exc.strerror}): finetune checks every file of a "
                    "checkpoint before resuming from it. Nothing was changed. Give the user "
                    "that runs finetune read access to it, then run again.")


def _file_problem(checkpoint: Path, name: str, entry: dict[str, Any]) -> str | None:
    path = checkpoint / name
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            return f"{name} is not a file"
        if info.st_size != entry["size"]:
            return f"{name} has {info.st_size} bytes, the manifest says {entry['size']}"
        if "sha256" in entry and sha256_of(path) != entry["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest"
    except FileNotFoundError:
        return f"{name} is missing"
    except PermissionError as exc:
        raise _unreadable(path, exc) from None
    except OSError as exc:
        return f"{name} cannot be read ({exc.strerror})"
    return None


def _state_problem(checkpoint: Path, step: int) -> str | None:
    """The manifest's step is the Trainer's (trainer_state.json) and the directory's name."""
    named = step_of(checkpoint)
    if named is not None and named != step:
        return f"named {checkpoint.name}, its manifest says step {step}"
    path = checkpoint / TRAINER_STATE
    try:
        state = json.loads(path.read_text())
    except PermissionError as exc:
        raise _unreadable(path, exc) from None
    except (OSError, ValueError, RecursionError):  # matches the manifest: sealed that way
        state = None
    found = state.get("global_step") if isinstance(state, dict) else None
    if found != step:
        return f"the manifest says step {step}, {TRAINER_STATE} says {found!r}"
    return None


def problem(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot be resumed from, or None if it is complete and intact.
    A file this user may not read is a RunError: nothing to judge the checkpoint by."""
    try:
        manifest = read_manifest(checkpoint)
    except FileNotFoundError:
        return NO_MANIFEST
    except PermissionError as exc:
        raise _unreadable(checkpoint / MANIFEST, exc) from None
    except (OSError, ValueError) as exc:
        return f"unreadable manifest {checkpoint / MANIFEST} ({exc})"
    for name, entry in manifest["files"].items():
        why = _file_problem(checkpoint, name, entry)
        if why:
            return why
    return _state_problem(checkpoint, manifest["step"])


@dataclass
class Scan:
    complete: list[Path]  # oldest first
    incomplete: list[tuple[Path, str]]  # no manifest: a save cut short
    damaged: list[tuple[Path, str]]  # a manifest, damaged or disagreeing with the files

    @property
    def newest(self) -> Path | None:
        return self.complete[-1] if self.complete else None


def scan(checkpoints: Path) -> Scan:
    found = Scan([], [], [])
    for path in sorted((p for p in checkpoints.glob("checkpoint-*") if step_of(p) is not None),
                       key=step_of):
        why = problem(path)
        if why is None:
            found.complete.append(path)
        elif os.path.lexists(path / MANIFEST):  # written last, atomically: not a kill
            found.damaged.append((path, why))
        else:
            found.incomplete.append((path, why))
    return found


def aside(checkpoint: Path) -> Path:
    """Where a damaged checkpoint is moved: damaged-checkpoint-<step>, -2, -3... if taken."""
    target, copy = checkpoint.with_name(DAMAGED + checkpoint.name), 1
    while os.path.lexists(target):
        copy += 1
        target = checkpoint.with_name(f"{DAMAGED}{checkpoint.name}-{copy}")
    return target


def rotate(checkpoints: Path, limit: int | None, keep: set[Path]) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `limit`. Only ever called right after a
    newer checkpoint was sealed, so the newest complete one (what a resume needs) and those
    in `keep` (the best model) survive."""
    if not limit:
        return []
    sealed = sorted((p for p in checkpoints.glob("checkpoint-*")
                     if step_of(p) is not None and (p / MANIFEST).is_file()), key=step_of)
    doomed = [p for p in sealed[:-max(limit, 1)] if p.resolve() not in keep]
    for path in doomed:
        # Unseal first: a delete cut short leaves an incomplete checkpoint, never a
        # broken one that claims to be complete.
        (path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return doomed
