"""Prompts for `finetune generate`: --prompt texts, or a JSONL file of rows, each checked and
named by file and line when it is wrong.

Rows: {"prompt": "text"}, {"prompt": [messages]}, or {"messages": [messages]}. A
conversation that ends in assistant turns is cut before its last one, which becomes the
row's reference (so an eval file of the run can be given as it is); a "completion" is a
reference too. For a vision-language model, messages may hold image parts, with `images`
as in training (data/images.py: paths relative to the prompts file, checked); a plain
prompt's `images` go with it as a plain prompt/completion row's do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.data.images import IMAGES, count_problem, image_parts, image_problem, \
    images_problem, parts_problem, resolved_paths
from finetune.errors import DataError, one_line

MAX_LINE = 16 * 2**20


@dataclass
class Prompt:
    where: str                       # "--prompt 2" or "prompts.jsonl line 7"
    text: str | None = None          # a plain prompt (chat-wrapped unless raw)
    messages: list[dict] | None = None
    reference: str | None = None
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns
    images: list[str] | None = None  # for a vision-language model: absolute image paths

    def given(self) -> str | list[dict]:
        return self.messages if self.messages is not None else self.text


def from_texts(texts: list[str], images: list[str] | None = None) -> list[Prompt]:
    """--prompt texts, each with the --image pictures (paths from the working directory,
    checked: a DataError naming the flag and the path)."""
    paths = [checked_image(given, "--image") for given in images or ()] or None
    return [Prompt(f"--prompt {i + 1}", text=text, images=paths)
            for i, text in enumerate(texts)]


def checked_image(given: str, flag: str) -> str:
    """A picture named on the command line (`generate --image`, chat's --image and /image;
    relative to the working directory) as an absolute path; a DataError `FLAG GIVEN:
    problem (path)` when it is no image."""
    path = Path(given).expanduser().absolute()
    problem = image_problem(path)
    if problem:
        raise DataError(f"{flag} {given}: {problem} ({path})")
    return str(path.resolve())


def _messages_problem(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return "is not a non-empty list of messages"
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or \
                parts_problem(message.get("content"), "content"):
            return f"has a message ({i}) that is not an object with string role and content " \
                   "(text, or image and text parts)"
    return None


def _text(content: Any) -> str | None:
    """A turn's text: its content, or its text parts joined."""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if p.get("type") == "text")
    return content if isinstance(content, str) else None


def _reference(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        return _text(value[-1].get("content"))
    return None


def _images(row: dict[str, Any], messages: list[dict], where: str, file: Path) -> list[str]:
    """A row's `images` (paths relative to the prompts file), one per image part, each
    checked as training checks them (data/images.py)."""
    problem = images_problem({"messages": messages, IMAGES: row.get(IMAGES)})
    if problem:
        raise DataError(f"{where}: {problem}")
    return resolved_paths(row.get(IMAGES) or [], file, where)


def _row(row: Any, where: str, file: Path | None = None) -> Prompt:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, not {type(row).__name__}")
    keys = [k for k in ("prompt", "messages") if k in row]
    if len(keys) != 1:
        raise DataError(f"{where}: a row needs exactly one of 'prompt' (text or messages) and "
                        f"'messages'; it has {sorted(row) or 'no keys'}")
    key, value = keys[0], row[keys[0]]
    reference = _reference(row.get("completion"))
    columns = {k: v for k, v in row.items()
               if k not in ("prompt", "messages", "completion", IMAGES)}
    if key == "prompt" and isinstance(value, str):
        images = None
        if file is not None and row.get(IMAGES) is not None:  # a plain prompt's pictures
            problem = count_problem(row[IMAGES], [], "prompt")
            if problem:
                raise DataError(f"{where}: {problem}")
            images = resolved_paths(row[IMAGES], file, where)
        return Prompt(where, text=value, reference=reference, columns=columns, images=images)
    problem = _messages_problem(value)
    if problem:
        raise DataError(f"{where}: {key} {problem}")
    images = _images(row, value, where, file) if file is not None and \
        (row.get(IMAGES) is not None or image_parts(value)) else None
    if key == "messages" and value[-1]["role"] == "assistant":
        if len(value) == 1:
            raise DataError(f"{where}: messages is one assistant turn: nothing to prompt with")
        reference, value = _text(value[-1]["content"]), value[:-1]
    return Prompt(where, messages=value, reference=reference, columns=columns, images=images)


def from_file(path: str) -> list[Prompt]:
    file = Path(path)
    try:
        lines = file.read_bytes().split(b"\n")
    except OSError as exc:
        raise DataError(f"{path}: cannot read it: {exc.strerror}") from None
    prompts = []
    for number, raw in enumerate(lines, start=1):
        where = f"{path} line {number}"
        if not raw.strip():
            continue
        if len(raw) > MAX_LINE:
            raise DataError(f"{where}: longer than {MAX_LINE} bytes")
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise DataError(f"{where}: not a JSON object ({one_line(str(exc))})") from None
        prompts.append(_row(row, where, file))
    if not prompts:
        raise DataError(f"{path}: no prompts in it")
    return prompts
