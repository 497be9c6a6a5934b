"""The pictures a data cache entry's rows name, stamped when the entry is written (size and
modification time of each file). The entry's key hashes the data files (data/prepare.py),
not the pictures their rows point to: a picture replaced in place would otherwise be
trained on unchecked until the data file itself changed. A stamp that no longer matches
makes the entry out of date, and the rows are prepared (and their pictures checked) again."""

from __future__ import annotations

import os
from typing import Any, Iterable

from finetune.data.images import IMAGES, holds_pictures


def stamps(parts: Iterable[Any]) -> dict[str, list[int]]:
    """{path: [size, mtime_ns]} of every picture file the parts' rows name (paths are
    absolute after data/images.resolved). Pictures stored in the rows are none: the data
    file holding them is in the entry's key (and reading them would decode each)."""
    out: dict[str, list[int]] = {}
    for dataset in parts:
        if dataset is None or IMAGES not in (dataset.column_names or ()) or \
                holds_pictures(dataset.features[IMAGES]):
            continue
        for paths in dataset[IMAGES]:
            for path in paths or ():
                if isinstance(path, str) and path not in out:
                    stat = os.stat(path)
                    out[path] = [stat.st_size, stat.st_mtime_ns]
    return out


def changed(recorded: Any) -> str | None:
    """What differs from the stamps an entry recorded (the first picture), or None."""
    if not isinstance(recorded, dict):
        return None  # an entry without pictures
    for path, stamp in recorded.items():
        try:
            stat = os.stat(path)
        except OSError:
            return f"picture {path} is gone"
        if [stat.st_size, stat.st_mtime_ns] != stamp:
            return f"picture {path} changed"
    return None
