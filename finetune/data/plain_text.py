"""Plain-text corpora (.txt files) for continued pretraining: a file's documents, as `text`
rows, read alike by training (data/load.py) and validate's data pass (data/scan.py).

The rule: a file with a blank line between two non-empty lines holds one document per
block of lines between blank lines (paragraphs, articles); a file without one holds one
document per line. Blank lines (empty, or only whitespace) are never documents; the note
counts them. Lines keep their own text, less the line break."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


@dataclass
class Layout:
    """How a file's documents are cut, and what that leaves out."""
    blocks: bool  # one document per blank-line-separated block (else per line)
    documents: int
    blank_lines: int

    def note(self, path: Path) -> str:
        unit = "blank-line-separated block" if self.blocks else "line"
        return f"{path}: plain text read as {self.documents} document(s), one per {unit}" \
               f"{'' if self.blocks else ' (no blank line between two lines of text)'}; " \
               f"{self.blank_lines} blank line(s) skipped"


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line, less its line break; UTF-8 (files.check_file
    checked it), a leading byte-order mark dropped."""
    with path.open(encoding="utf-8-sig", newline="") as handle:
        for number, line in enumerate(handle, 1):
            yield number, line.rstrip("\r\n")


def layout(path: Path) -> Layout:
    """The file's layout, from one pass over its lines."""
    blocks, seen_text, gap, documents, blank = False, False, False, 0, 0
    lines = 0
    for _, line in _lines(path):
        if not line.strip():
            blank, gap = blank + 1, seen_text
            continue
        lines += 1
        if gap:
            blocks, documents = True, documents + 1
        seen_text, gap = True, False
    return Layout(blocks, documents + 1 if blocks else lines, blank)


def documents(path: Path, blocks: bool) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each document, cut as `blocks` says."""
    start, block = 0, []
    for number, line in _lines(path):
        if line.strip() and not blocks:
            yield number, line
        elif line.strip():
            start = start or number
            block.append(line)
        elif block:
            yield start, "\n".join(block)
            start, block = 0, []
    if block:
        yield start, "\n".join(block)
