"""Files written so that a reader, or a run killed mid-write, sees the old content or the
new and never half of one (write_atomic), and their content hashes (sha256_of). Imports
only errors."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from finetune.errors import RunError


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_UMASK = os.umask(0)  # read once, at import (single-threaded), and put back at once
os.umask(_UMASK)


def write_atomic(path: Path, text: str) -> None:
    """Write, flush to disk, then rename over `path`: readers see the old or the new. The
    staging file's name is new each time, so nothing left behind by a kill can block it.
    A RunError names `path` when it cannot be written (a directory there, a full disk)."""
    try:
        handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                           dir=path.parent)
    except OSError as exc:
        raise RunError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        os.chmod(staging, 0o666 & ~_UMASK)  # as open() would create it, not mkstemp's 0600
        with os.fdopen(handle, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(staging, path)
    except OSError as exc:
        Path(staging).unlink(missing_ok=True)
        raise RunError(f"cannot write {path}: {exc.strerror or exc}") from None
    fsync_dir(path.parent)
