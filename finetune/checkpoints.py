"""Checkpoints that are complete or ignored. Torch-free.

The Trainer writes checkpoints/checkpoint-<step>/ file by file; a kill mid-write leaves a
directory that looks like a checkpoint but is not one. After every rank has finished
writing, rank 0 adds MANIFEST (sizes of every file, SHA-256 of the small ones, and the
fingerprint of the experiment that wrote it), atomically and last. A checkpoint without a
manifest, or whose files disagree with it, is incomplete: reported, never resumed from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune import __version__

MANIFEST = "finetune-manifest.json"
# Written in the run directory by rank 0 once a checkpoint asked for by a signal is sealed:
# how `finetune launch` knows its training processes stopped on purpose, to be resumed.
STOPPED = "stopped.json"
HASHED_BELOW = 16 * 2**20  # hash files up to 16 MiB (state, RNG, scheduler); size the rest
_STEP = re.compile(r"^checkpoint-(\d+)$")


def directory(output_dir: str | Path, step: int) -> Path:
    """Where the Trainer writes the checkpoint of `step`."""
    return Path(output_dir) / f"checkpoint-{step}"


def step_of(path: Path) -> int | None:
    match = _STEP.match(path.name)
    return int(match.group(1)) if match else None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write, flush to disk, then rename over `path`: readers see the old or the new."""
    staging = path.with_name(f".{path.name}.tmp")
    with staging.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)
    _fsync_dir(path.parent)


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


def _shape_problem(manifest: Any) -> str | None:
    """What in a manifest (edited by hand, say) is not what write_manifest writes."""
    if not isinstance(manifest, dict):
        return f"a JSON object expected, got {type(manifest).__name__}"
    if not _is_int(manifest.get("step")):
        return f"`step` is {manifest.get('step')!r}, not a step number"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "`files` is not an object"
    for name, entry in files.items():
        if not isinstance(entry, dict) or not _is_int(entry.get("size")) or \
                not isinstance(entry.get("sha256", ""), str):
            return f"`files.{name}` is not {{size, sha256}}"
    if not isinstance(manifest.get("fingerprint", {}), dict):
        return "`fingerprint` is not an object"
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


def problem(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot be resumed from, or None if it is complete and intact."""
    try:
        manifest = read_manifest(checkpoint)
    except FileNotFoundError:
        return "no manifest: its writing did not finish"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest {checkpoint / MANIFEST} ({exc})"
    for name, entry in manifest.get("files", {}).items():
        path = checkpoint / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != entry["size"]:
            return f"{name} has {size} bytes, the manifest says {entry['size']}"
        if "sha256" in entry and sha256_of(path) != entry["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest"
    return None


@dataclass
class Scan:
    complete: list[Path]  # oldest first
    incomplete: list[tuple[Path, str]]

    @property
    def newest(self) -> Path | None:
        return self.complete[-1] if self.complete else None


def scan(checkpoints: Path) -> Scan:
    found = sorted((p for p in checkpoints.glob("checkpoint-*") if step_of(p) is not None),
                   key=step_of)
    complete, incomplete = [], []
    for path in found:
        why = problem(path)
        if why is None:
            complete.append(path)
        else:
            incomplete.append((path, why))
    return Scan(complete, incomplete)


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
