"""The bytes of a local data file, checked before `datasets` reads it, and the diagnosis
when it could not. datasets reports a bad encoding or deep nesting as a traceback that
names no line, and turns NaN in a JSON row into null (a NaN turn weight would train as
1). Every problem here names the file and its line."""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import math
import stat
from pathlib import Path
from typing import Any, Iterator

from finetune.config.rules import DATA_SUFFIXES
from finetune.errors import DataError, one_line

PLAIN_TEXT = ".txt"
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet",
            ".txt": "text"}  # plain text: data/plain_text.py cuts it into documents
BLOCK = 16 * 2**20  # read in blocks: data files can be larger than memory
# Longest first: the UTF-32 LE mark starts with the UTF-16 LE one.
BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
        (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))
# Deeper than any conversation, preference or prompt row; datasets' type handling recurses
# per level and fails (RecursionError) a few hundred levels down.
MAX_DEPTH = 64
# The non-standard numbers Python's json, pyarrow and ujson write or read. "Inf" finds
# "Infinity" too; a line that only mentions them in text parses cleanly and passes.
NON_FINITE_TOKENS = (b"NaN", b"Inf")
HASHED_WHOLE = 16 * 2**20  # bytes; a larger file is hashed from SAMPLES spread samples
SAMPLES, SAMPLE_BYTES = 64, 64 * 2**10


def not_regular(path: Path) -> str | None:
    """Why `path` is neither a regular file nor a directory (a FIFO, a socket, a device:
    reading one blocks or never ends), or None. Follows symlinks."""
    mode = path.stat().st_mode
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) \
        else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"
    return f"{path}: {kind}; data paths must be regular files or directories"


def list_data_files(path: Path) -> list[Path]:
    """The data files a source path names: itself, or a directory's files with a data
    suffix (not its subdirectories), sorted; .txt files only in a directory of nothing else.
    Every one a regular file."""
    try:
        problem = not_regular(path)
        if problem:
            raise DataError(problem)
        if not path.is_dir():
            if path.suffix.lower() not in DATA_SUFFIXES:
                raise DataError(f"{path}: unsupported file type; use {', '.join(DATA_SUFFIXES)}")
            return [path]
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in DATA_SUFFIXES)
        if any(f.suffix.lower() != PLAIN_TEXT for f in files):
            # A README.txt beside the data files is not data: .txt files are read from a
            # directory of plain text only.
            files = [f for f in files if f.suffix.lower() != PLAIN_TEXT]
        for file in files:
            problem = not_regular(file)
            if problem or file.is_dir():
                raise DataError(problem or f"{file}: a directory with a data file's name; "
                                "data paths must be regular files or directories")
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not files:
        raise DataError(f"{path}: no {'/'.join(DATA_SUFFIXES)} files in this directory")
    return files


def _convert_hint(name: str, text: str = "") -> str:
    return f"data files must be UTF-8: convert it ({text}iconv -f {name} -t UTF-8 IN > OUT)"


def _utf8_problem(path: Path) -> str | None:
    """The first byte that is not UTF-8 (or a NUL), with its line; read block by block."""
    with path.open("rb") as handle:
        head = handle.read(4)
        for bom, name in BOMS:
            if head.startswith(bom):
                return f"{path}: the file is {name} (it starts with a {name} byte-order " \
                       f"mark); {_convert_hint(name)}"
        handle.seek(0)
        line, carry = 1, b""
        while True:
            block = handle.read(BLOCK)
            data = carry + block
            if not data:
                return None
            nul = data.find(b"\x00")
            end = len(data) if nul < 0 else nul
            try:
                data[:end].decode("utf-8")
            except UnicodeDecodeError as exc:
                split = exc.reason == "unexpected end of data" and block and nul < 0
                if not split:  # not a character cut in two by the block boundary
                    line += data.count(b"\n", 0, exc.start)
                    hint = _convert_hint("CP1252", "Windows or Latin-1 text: ")
                    return f"{path} line {line}: byte 0x{data[exc.start]:02x} is not UTF-8 " \
                           f"({exc.reason}); {hint}"
                line += data.count(b"\n", 0, exc.start)
                carry = data[exc.start:]
                continue
            if nul >= 0:
                line += data.count(b"\n", 0, nul)
                return f"{path} line {line}: a NUL byte: not a text file, or UTF-16 without " \
                       f"a byte-order mark; {_convert_hint('UTF-16')}"
            line += data.count(b"\n")
            carry = b""


def _walk(value: Any) -> Iterator[tuple[str, Any, int]]:
    """(path, value, depth) of every value in a parsed row, without recursion."""
    stack = [("", value, 1)]
    while stack:
        path, item, depth = stack.pop()
        yield path, item, depth
        if isinstance(item, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v, depth + 1)
                         for k, v in reversed(list(item.items())))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v, depth + 1)
                         for i, v in reversed(list(enumerate(item))))


_SPELLED = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def value_problem(row: Any) -> str | None:
    """Nesting beyond MAX_DEPTH, non-finite numbers inside a column's value (a turn's
    weight) and lone surrogate escapes, in one parsed row. A column's own NaN reaches the
    row checks as NaN or null, and they name it (data/load.py)."""
    for path, item, depth in _walk(row):
        if depth > MAX_DEPTH:
            return f"nested more than {MAX_DEPTH} levels deep (at `{one_line(path)}`)"
        texts = [item] if isinstance(item, str) else list(item) if isinstance(item, dict) else []
        if any(_has_lone_surrogate(text) for text in texts):
            # json accepts "\ud800" alone; no UTF-8 text (nor datasets' reader) can hold it.
            return f"`{one_line(path) or 'row'}` holds a lone surrogate escape (\\ud800-" \
                   "\\udfff without its pair), which is not a character"
        if depth > 2 and isinstance(item, float) and not math.isfinite(item):
            return f"`{one_line(path) or 'row'}` is {_SPELLED[repr(item)]}: JSON has no NaN " \
                   "or Infinity (a NaN weight is an error, and datasets would read it as null)"
    return None


def parse_json(text: str | bytes) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}" if exc.lineno > 1 else f"column {exc.colno}"
        return None, f"invalid JSON: {exc.msg} ({where})"
    except RecursionError:
        return None, "nested too deeply to read (thousands of levels)"


def is_document(path: Path) -> bool:
    """A JSON array (read whole by datasets), not JSON Lines."""
    with path.open("rb") as handle:
        return handle.read(4096).lstrip(codecs.BOM_UTF8 + b" \t\r\n").startswith(b"[")


def _document_problem(path: Path) -> str | None:
    rows, problem = parse_json(path.read_bytes().removeprefix(codecs.BOM_UTF8))
    if problem:
        return f"{path}: {problem}"
    for number, row in enumerate(rows if isinstance(rows, list) else [rows], 1):
        problem = not_an_object(row) or value_problem(row)
        if problem:
            return f"{path} row {number}: {problem}"
    return None


def _lines(path: Path, wanted: tuple[bytes, ...] = ()) -> Iterator[tuple[int, bytes]]:
    """(number, line) of every line, or only of those holding one of `wanted`."""
    with path.open("rb") as handle:
        for number, line in enumerate(handle, 1):
            if not wanted or any(token in line for token in wanted):
                yield number, line


def _lines_problem(path: Path, wanted: tuple[bytes, ...] = ()) -> str | None:
    """The first line that is not a JSON row, or holds a bad value. With `wanted`, only
    lines holding those tokens, and only their values: a line that is not JSON alone may
    be part of a document datasets reads otherwise (it reports what it cannot read)."""
    for number, line in _lines(path, wanted):
        if not line.strip():
            continue
        row, problem = parse_json(line.removeprefix(codecs.BOM_UTF8) if number == 1 else line)
        if problem and wanted:
            continue
        problem = problem or not_an_object(row) or value_problem(row)
        if problem:
            return f"{path} line {number}: {problem}"
    return None


def not_an_object(row: Any) -> str | None:
    if isinstance(row, dict):
        return None
    return f"a row must be a JSON object ({{\"column\": value, ...}}), got " \
           f"{type(row).__name__} {one_line(repr(row))[:40]}"


def checked_builder(path: Path) -> str:
    """The datasets builder of a local data file, once check_file found nothing wrong
    with it (else a DataError): what training and validate's data pass both read first."""
    builder = BUILDERS[path.suffix.lower()]
    try:
        problem = check_file(path, builder)
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if problem:
        raise DataError(problem)
    return builder


def check_file(path: Path, builder: str) -> str | None:
    """What is wrong with a local text data file before datasets reads it, or None.
    Cheap: one streaming UTF-8 pass; JSON rows are parsed only where NaN/Inf appears."""
    if path.stat().st_size == 0:
        return f"{path}: the file is empty"
    if builder not in ("json", "csv", "text"):
        return None
    problem = _utf8_problem(path)
    if problem or builder != "json":
        return problem
    if is_document(path):
        with path.open("rb") as handle:
            text = handle.read()
        return _document_problem(path) if any(t in text for t in NON_FINITE_TOKENS) else None
    return _lines_problem(path, NON_FINITE_TOKENS) if _mentions(path, NON_FINITE_TOKENS) \
        else None


def _mentions(path: Path, tokens: tuple[bytes, ...]) -> bool:
    """Whether any of tokens occurs in the file: block by block, at the speed of bytes
    search (most files have none, and then no line is looked at)."""
    overlap = max(len(t) for t in tokens) - 1
    with path.open("rb") as handle:
        tail = b""
        for block in iter(lambda: handle.read(BLOCK), b""):
            data = tail + block
            if any(t in data for t in tokens):
                return True
            tail = data[-overlap:]
    return False


def diagnose_json(path: Path) -> str | None:
    """The first line (or array row) datasets could not read: syntax, nesting, numbers."""
    if is_document(path):
        return _document_problem(path)
    if not any(line.strip() for _, line in _lines(path)):
        return f"{path}: the file is empty (blank lines only)"
    return _lines_problem(path)


@functools.lru_cache(maxsize=4096)
def _digest(path: str, size: int, mtime_ns: int, inode: int, ctime_ns: int) -> str:
    # Cached per stat, ctime included: an edit in place that restores size and mtime
    # (cp -p, touch -r) still changes the ctime, which no user can set.
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        if size <= HASHED_WHOLE:
            for block in iter(lambda: handle.read(2**20), b""):
                digest.update(block)
            return f"{size} bytes, sha256 {digest.hexdigest()[:16]}"
        for i in range(SAMPLES):  # the first and the last bytes included
            handle.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
            digest.update(handle.read(SAMPLE_BYTES))
    return f"{size} bytes, sampled sha256 {digest.hexdigest()[:16]}"


def content_digest(path: Path) -> str:
    """What a data file holds, independent of its modification time (a copy or a touch is
    no change). Files up to HASHED_WHOLE: SHA-256 of every byte. Larger ones: of their
    size and SAMPLES blocks spread from the first byte to the last, so at most 4 MiB are
    read per file on every rank at every start; an edit that keeps the size and misses
    every sample goes unnoticed, any edit that adds or removes a byte does not."""
    try:
        status = path.stat()
        if not stat.S_ISREG(status.st_mode):  # a FIFO would block the read forever
            return "not a regular file"
        return _digest(str(path), status.st_size, status.st_mtime_ns, status.st_ino,
                       status.st_ctime_ns)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
