"""Paths written in an experiment, checked before pathlib sees them: pathlib raises on a
NUL byte, a component longer than the file system allows, an unknown ~user or a symlink
loop, where validation should say what is wrong with the value."""

from __future__ import annotations

import os
from pathlib import Path

NAME_MAX = 255  # bytes in one path component (ext4, xfs, btrfs, APFS)
PATH_MAX = 4096


def problem(value: str) -> str | None:
    """Why `value` cannot name a file, or None."""
    if "\0" in value:
        return "contains a NUL byte"
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return "contains a control character"
    encoded = value.encode("utf-8", "surrogateescape")
    if len(encoded) > PATH_MAX:
        return f"longer than {PATH_MAX} bytes"
    if any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        return f"has a component longer than {NAME_MAX} bytes"
    if value.startswith("~"):
        try:
            Path(value).expanduser()
        except RuntimeError:
            user = value[1:].split("/", 1)[0]
            return f"~{user}: no such user"
    return None


def _probe(path: str | Path, test: str) -> bool:
    try:
        return bool(getattr(Path(path), test)())
    except (OSError, ValueError, RuntimeError):  # ELOOP, ENAMETOOLONG, EACCES...
        return False


def exists(path: str | Path) -> bool:
    return _probe(path, "exists")


def is_file(path: str | Path) -> bool:
    return _probe(path, "is_file")


def is_dir(path: str | Path) -> bool:
    return _probe(path, "is_dir")


def resolve(path: Path) -> Path:
    """Absolute, symlinks followed where they resolve (a loop is left as written)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return Path(os.path.abspath(path))
