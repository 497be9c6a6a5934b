"""Private directories for datasets' reads of local files.

datasets converts a local file to arrow in its cache, in a directory keyed by the file's
path and modification time, and a later `.map` writes its cache files beside it. Two
processes reading one file share that directory, and a re-read (download_mode
force_redownload, which finetune needs: the key misses an edit that keeps the mtime)
deletes it under the other's feet. So every read gets a directory of its own, under one
directory per process: `<datasets cache>/finetune-reads/<host>.<pid>.<random>/`.

It lives under datasets' cache root (HF_DATASETS_CACHE), where the arrow copy of a file
went before: a multi-GB file needs no more room than it did, on the disk the user chose
for datasets. The process's directory is removed when the process ends normally (the
datasets memory-mapped from it are in use until then: training reads them when
data.cache is false); one left by a killed process is removed by the next read on the same
host, once its pid is gone. Other hosts' directories (a shared file system) are left to
their own host.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

import datasets

_NAME = re.compile(r"^(?P<host>.+)\.(?P<pid>\d+)\.[^.]+$")
_mine: dict[int, Path] = {}  # pid -> this process's directory (a fork gets its own)


def reads_root() -> Path:
    return Path(datasets.config.HF_DATASETS_CACHE) / "finetune-reads"


def _host() -> str:
    # The name's separator is ".": a dotted host name keeps its dots, the pid and the
    # random suffix have none, so the pattern reads it back from the right.
    return socket.gethostname() or "localhost"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep(root: Path) -> list[Path]:
    """Remove the directories of this host's processes that are gone; the ones removed."""
    host, removed = _host(), []
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = _NAME.match(entry.name)
        if not match or match["host"] != host or _alive(int(match["pid"])):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _remove(pid: int, folder: Path) -> None:
    if os.getpid() == pid:  # not in a forked child that happens to run atexit handlers
        shutil.rmtree(folder, ignore_errors=True)


def _process_dir() -> Path:
    pid = os.getpid()
    if pid not in _mine:
        root = reads_root()
        root.mkdir(parents=True, exist_ok=True)
        sweep(root)
        folder = Path(tempfile.mkdtemp(prefix=f"{_host()}.{pid}.", dir=root))
        atexit.register(_remove, pid, folder)
        _mine[pid] = folder
    return _mine[pid]


def read_dir() -> str:
    """A new, empty directory for one load_dataset call's cache_dir, kept until this
    process ends: nothing else reads or writes it, and datasets finds no earlier
    conversion in it to reuse."""
    return tempfile.mkdtemp(prefix="read-", dir=_process_dir())
