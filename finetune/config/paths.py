"""Paths written in an experiment, checked before pathlib sees them: pathlib raises on a
NUL byte, a component longer than the file system allows, an unknown ~user or a symlink
loop, where validation should say what is wrong with the value."""

from __future__ import annotations

import os
from pathlib import Path

MAX_LINKS = 40  # symlinks followed before the kernel answers ELOOP (Linux)
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


def link_loop(path: str | Path) -> list[Path] | None:
    """The symlinks from `path` that lead back to one of them ([a, b, a]; [a, a] for a
    link to itself), or None: the kernel only says ELOOP, which pathlib reads as missing."""
    seen: list[Path] = []
    current = Path(os.path.abspath(path))
    while current not in seen:
        if len(seen) > MAX_LINKS or not current.is_symlink():
            return seen + [current] if len(seen) > MAX_LINKS else None
        seen.append(current)
        try:
            current = Path(os.path.abspath(current.parent / os.readlink(current)))
        except OSError:
            return None
    return seen + [current]
