"""LLaVA's rows (and LLaMA-Factory's image rows): sharegpt turns (or alpaca's instruction
and input) whose text marks each image's place with `<image>`, and the files in `images`,
or one in `image`, read as TRL's vision rows (data/images.py): each placeholder an image
part where it stands. The pictures may be stored in the rows instead (datasets' Image:
`image` an Image, `images` a list of them, as a parquet file or a hub dataset holds
them), read as TRL's rows with stored pictures are. The row check and one row's
conversion; data/formats.py's sharegpt and alpaca conversions call them for a file with
an `image` or `images` column, in validate (scan.py) as in training (load.py). Plain
Python on dicts, without `datasets` at import."""

from __future__ import annotations

from typing import Any

from finetune.data.images import IMAGE, IMAGES, holds_pictures, is_picture
from finetune.data.peer_rows import has_calls, sharegpt_messages

# Where a turn's text holds an image.
PLACEHOLDER = "<image>"
IMAGE_COLUMNS = (IMAGE, IMAGES)


def given_images(row: dict[str, Any]) -> tuple[list | None, str | None]:
    """A sharegpt row's images, files or stored pictures (`image` as a one-item list;
    None: the row gives none), or the problem."""
    images, image = row.get(IMAGES), row.get(IMAGE)
    if images is not None and image is not None:
        return None, "gives both `image` and `images`: give the files in one of them"
    if image is not None:
        if not _an_image(image):
            return None, "`image` must be an image file path (relative to the data file) " \
                         "or a picture stored in the row (datasets' Image: `bytes`)"
        return [image], None
    if images is not None and (not isinstance(images, list)
                               or not all(_an_image(p) for p in images)):
        return None, "`images` must be a list of image file paths (relative to the data " \
                     "file) or of pictures stored in the row (datasets' Image: `bytes`)"
    return images, None


def _an_image(given: Any) -> bool:
    return (isinstance(given, str) and bool(given)) or is_picture(given)


def with_images(row: dict[str, Any]) -> bool:
    """Is a raw sharegpt row one of a file with images (an `image` or `images` column)?"""
    return any(c in row for c in IMAGE_COLUMNS)


def image_turns_problem(row: dict[str, Any], roles: dict[str, str]) -> str | None:
    """Why a checked sharegpt row's images and its `<image>` placeholders disagree, or
    None."""
    problem = given_images(row)[1]
    if problem:
        return problem
    if with_images(row) and has_calls(row, roles):
        return "function_call turns in rows with images are not supported yet"
    return placeholders_problem(row, [t["value"] for t in row["conversations"]]
                                + [row.get("system") or ""])


def placeholders_problem(row: dict[str, Any], texts: list[str]) -> str | None:
    """Why a row's images (`image` or `images`) and the `<image>` placeholders in its
    texts disagree, or None (no images: the texts as written)."""
    images, problem = given_images(row)
    if problem or images is None:
        return problem
    placeholders = sum(text.count(PLACEHOLDER) for text in texts)
    if placeholders != len(images):
        given = "`image`" if row.get(IMAGE) is not None else "`images`"
        return f"{placeholders} {PLACEHOLDER} placeholder(s) in the turns for " \
               f"{len(images)} image file(s) in {given}: give one file per placeholder"
    return None


def placeholder_parts(text: str) -> list[dict[str, str]]:
    """A turn's text as content parts: an image part for each `<image>` placeholder, the
    text before, between and after it as text parts, as written (empty ones left out)."""
    parts: list[dict[str, str]] = []
    for i, piece in enumerate(text.split(PLACEHOLDER)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts or [{"type": "text", "text": ""}]


def as_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with text content as content parts, each placeholder an image part."""
    return [{**m, "content": placeholder_parts(m["content"])} for m in messages]


def image_messages(row: dict[str, Any], roles: dict[str, str]) -> dict[str, Any]:
    """A checked sharegpt row of a file with images in TRL's vision format: every turn's
    content as parts (a file's rows share one schema), its images in `images`."""
    messages = [{"role": m["role"], "content": m["content"]}
                for m in as_parts(sharegpt_messages(row, roles))]
    return {"messages": messages, IMAGES: given_images(row)[0]}


def image_messages_features(read, turns: tuple[str, ...] = ("messages",)):
    """The `turns` (message lists) and `images` of image_messages (or of alpaca's rows
    with images: `prompt`, `completion`), typed as datasets' JSON reader types a
    file of TRL's vision rows: parts of two shapes ({type} and {type, text}) as JSON
    objects, each kept as written; `images` as the file's (`read`: its features) give
    them: paths, or pictures stored in the rows (kept undecoded, as data/images.py's
    `undecoded` reads them: it decodes them once they are checked)."""
    from datasets import Image, Json, List, Value

    text = Value("string")
    stored = any(holds_pictures(read[c]) for c in IMAGE_COLUMNS if c in read)
    return {**{turn: List({"role": text, "content": List(Json())}) for turn in turns},
            IMAGES: List(Image(decode=False) if stored else text)}
