"""Rows with images, in TRL's vision format: `messages` whose content may be a list of
parts ({"type": "image"}, {"type": "text", "text": ...}), and `images`, one image per
image part, in order; or every turn's content text, the images then placed before the
first user turn's text (TRL's prepare_multimodal_messages). Preference pairs and prompts
carry them the same way in their prompt (rows.py).

An image is a file path relative to the data file (or a URL), or a picture stored in the
row as datasets' Image feature stores it ({"bytes", "path"}: a parquet file or a hub
dataset with an Image column; a decoded PIL image is taken too). A file's `images` are
all paths or all stored pictures (one Arrow type); a hub dataset's must be stored
pictures (a path there is relative to nothing).

The checks of a row's parts and images (rows.py calls them), and each image: a file found
next to the data file, a stored picture's bytes, opened and verified (the header, and for
PNG the checksums; the pixels are decoded where training collates them); a URL refused
offline, else fetched once and verified. validate (scan.py) and training (load.py) check
them alike; a bad one is one error naming the file, row and images[i]. Training keeps
stored pictures in the rows, decoded to PIL images as the collator reads them. Without
torch: validate imports this."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.errors import DataError, one_line

if TYPE_CHECKING:
    from datasets import Dataset

IMAGES = "images"
IMAGE = "image"  # LLaVA's rows' one picture (data/llava_rows.py)
PART_TYPES = ("image", "text")
URL_SCHEMES = ("http://", "https://")
URL_TIMEOUT_S = 10.0


def parts_problem(content: Any, field: str) -> str | None:
    """Why a message's content is neither text nor a list of image and text parts."""
    if isinstance(content, str):
        return None
    if not isinstance(content, list) or not content:
        return f"`{field}` must be text or a non-empty list of parts, got " \
               f"{type(content).__name__}"
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES:
            return f"`{field}[{j}]` must be a part with `type` image or text, got {part!r}"
        if kind == "text" and not isinstance(part.get("text"), str):
            return f"`{field}[{j}]` is a text part without `text`"
    return None


def image_parts(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") == "image")


def is_picture(entry: Any) -> bool:
    """A picture stored in the row: datasets' Image feature undecoded (a dict with
    `bytes`, as parquet holds it) or decoded (a PIL image)."""
    return (isinstance(entry, dict) and "bytes" in entry) or \
        type(entry).__module__.startswith("PIL.")


def images_problem(row: dict[str, Any]) -> str | None:
    """`images` a list of paths, one per image part of the messages, or no image parts."""
    return count_problem(row.get(IMAGES), row["messages"], "messages")


def count_problem(images: Any, turns: list[dict[str, Any]], field: str) -> str | None:
    """`images` a list of paths, one per image part of turns (the row's `field`, where
    the collator puts the images), or none; turns all text take them all (TRL puts them
    at the start of the first user turn)."""
    parts = image_parts(turns)
    if images is None:
        return f"{parts} image part(s) in `{field}` and no `images` column giving the " \
               "files" if parts else None
    if not isinstance(images, list) or \
            not all((isinstance(p, str) and p) or is_picture(p) for p in images):
        return "`images` must be a list of image file paths (relative to the data file) " \
               "or of pictures stored in the row (datasets' Image: `bytes`)"
    if parts == 0 and all(isinstance(m.get("content"), str) for m in turns):
        return None  # text turns: TRL puts the images at the start of the first user turn
    if len(images) != parts:
        return f"`images` gives {len(images)} file(s) for {parts} image part(s) in `{field}`"
    return None


def picture_problem(picture: Any) -> str | None:
    """Why a picture stored in the row cannot be read, or None (a decoded one can)."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(picture, dict):
        return None  # a PIL image: datasets decoded it already
    data = picture.get("bytes")
    if not isinstance(data, bytes) or not data:
        named = f" (its `path` {picture['path']!r} only)" if picture.get("path") else ""
        return f"a stored picture without its `bytes`{named}: store the pictures in the " \
               "rows (datasets' Image with bytes, as push_to_hub writes them), or give " \
               "`images` as file paths"
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        # Pillow names the buffer it read (an address): the line says the picture instead
        cause = type(exc).__name__ if isinstance(exc, UnidentifiedImageError) else \
            f"{type(exc).__name__}: {one_line(str(exc))}"
        named = f"{picture['path']!r}, " if picture.get("path") else ""
        return f"a stored picture ({named}{len(data)} bytes): not an image Pillow can read " \
               f"({cause})"
    return None


def image_problem(path: Path) -> str | None:
    """Why an image file cannot be read, or None."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        return "no such file" if not path.exists() else "not a file"
    try:
        with Image.open(path) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        return f"not an image Pillow can read ({type(exc).__name__}: {one_line(str(exc))})"
    return None


def is_url(given: str) -> bool:
    return given.lower().startswith(URL_SCHEMES)


def offline() -> bool:
    """HF_HUB_OFFLINE set, as the rest of finetune reads it (config/rules/models.py)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def url_problem(url: str) -> str | None:
    """Why the picture at url cannot be used: offline, or it does not download and open
    as an image (fetched once, URL_TIMEOUT_S at most)."""
    from urllib.request import urlopen

    from PIL import Image, UnidentifiedImageError

    if offline():
        return "a URL, and HF_HUB_OFFLINE is set: nothing is fetched offline; download " \
               "the picture and give its path"
    try:
        with urlopen(url, timeout=URL_TIMEOUT_S) as answer:
            data, kind = answer.read(), answer.headers.get("Content-Type")
    except (OSError, ValueError) as exc:  # URLError, HTTPError and timeouts are OSErrors
        return f"cannot be fetched ({type(exc).__name__}: {one_line(str(exc))})"
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        return f"not an image Pillow can read ({len(data)} bytes of {kind or 'no stated type'})"
    return None


def resolved_paths(images: list, data_file: Path, where: str) -> list:
    """A row's images, each checked: paths made absolute (relative ones next to the data
    file), stored pictures as they are; a DataError naming the row, images[i] and the
    path and file looked for. A URL stays as it is once it downloads and opens (the
    processor fetches it again for each batch)."""
    out = []
    for i, given in enumerate(images):
        if is_picture(given):
            problem = picture_problem(given)
            if problem:
                raise DataError(f"{where}: images[{i}]: {problem}")
            out.append(given)
            continue
        if is_url(given):
            problem = url_problem(given)
            if problem:
                raise DataError(f"{where}: images[{i}] {given!r}: {problem}")
            out.append(given)
            continue
        path = Path(given).expanduser()
        path = path if path.is_absolute() else data_file.parent / path
        problem = image_problem(path)
        if problem:
            raise DataError(f"{where}: images[{i}] {given!r}: {problem} ({path})")
        out.append(str(path.resolve()))
    return out


def holds_pictures(feature: Any) -> bool:
    """Does a column of this feature hold stored pictures: datasets' Image, a list of them,
    or of the struct of `bytes` they are stored as (a parquet file written without
    datasets)?"""
    from datasets import Image, LargeList, List

    inner = feature.feature if isinstance(feature, (List, LargeList)) else feature
    return isinstance(inner, Image) or (isinstance(inner, dict) and "bytes" in inner)


def _stored_pictures(ds: Dataset) -> bool:
    return IMAGES in ds.features and holds_pictures(ds.features[IMAGES])


def _decoding(features, columns: list[str], decode: bool):
    """features with the stored pictures of columns read decoded (PIL images) or not."""
    from datasets import Image, LargeList, List

    features = features.copy()
    for column in columns:
        listed = isinstance(features[column], (List, LargeList))
        features[column] = List(Image(decode=decode)) if listed else Image(decode=decode)
    return features


# The formats whose rows may give one picture as `image` (TRL's collators read it as a
# one-item `images`): read so here. sharegpt and alpaca read it while converting
# (llava_rows.py); grpo's and rloo's prompts hand it to TRL as it is.
ONE_PICTURE_FORMATS = ("messages", "prompt_completion", "preference", "unpaired_preference")


def one_picture_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row's `image` (beside no `images`) as a one-item `images`."""
    if IMAGE not in row or IMAGES in row:
        return row
    row = dict(row)
    image = row.pop(IMAGE)
    return {**row, IMAGES: None if image is None else [image]}


def one_picture(ds: Dataset) -> Dataset:
    """one_picture_row for a file's rows, `images` typed as its `image` is."""
    if IMAGE not in ds.column_names or IMAGES in ds.column_names:
        return ds
    from datasets import Features, List

    features = Features({**{k: v for k, v in ds.features.items() if k != IMAGE},
                         IMAGES: List(ds.features[IMAGE])})
    return ds.map(lambda row: {IMAGES: None if row[IMAGE] is None else [row[IMAGE]]},
                  remove_columns=[IMAGE], features=features, desc="reading `image`")


def undecoded(ds: Dataset) -> Dataset:
    """The rows as read, their stored pictures (`images`, and LLaVA's `image`) as stored
    ({"bytes", "path"}), not decoded: the rows are checked as validate reads them, and a
    broken picture is an error naming its row rather than a failure while datasets decodes
    it (resolved decodes them). The same Arrow table seen with other features, nothing
    copied: cast_column writes a copy of the whole table for a List of Image (it flips the
    decode flag in place only for an Image column). ds as read: a table seen through
    select, filter or shuffle would lose them here (datasets' own reader gives none)."""
    from datasets import Dataset
    from datasets.fingerprint import Hasher, generate_fingerprint

    columns = [c for c in (IMAGES, IMAGE) if c in ds.features and holds_pictures(ds.features[c])]
    if not columns:
        return ds
    info = ds.info.copy()
    info.features = _decoding(ds.features, columns, False)
    # Its own fingerprint (the maps after it key their cache files by it), the same for
    # the same rows read again.
    fingerprint = Hasher.hash(("stored pictures undecoded", generate_fingerprint(ds)))
    try:
        return Dataset(ds.data, info=info, split=ds.split, fingerprint=fingerprint)
    except ValueError:  # stored as another Arrow type than datasets' Image: cast (a copy)
        return ds.cast(info.features)


def resolved(label: str, ds: Dataset, origin: str, method: str) -> Dataset:
    """A file's validated rows with `images` as absolute, checked paths, or checked
    stored pictures, decoded to PIL images as the collator reads them (undecoded rows in);
    rows without an `images` column as they are. label: the data file, or a hub
    dataset's id (whose images must be stored pictures: a path there is relative to
    nothing)."""
    from datasets import Image, List

    if IMAGE in ds.column_names and holds_pictures(ds.features[IMAGE]):
        # LLaVA's `image` left by a format that does not read it (grpo's prompts give it to
        # TRL): decoded again, as read (an Image column's flag flips without a copy)
        ds = ds.cast_column(IMAGE, Image())
    if IMAGES not in ds.column_names:
        return ds
    column = ds.select_columns([IMAGES, origin])
    pictured = next((row[origin] for row in column if row[IMAGES] is not None), None)
    if pictured is not None:
        require_images_method(method, pictured)
    if _stored_pictures(ds):
        for batch in column.iter(batch_size=256):
            for images, where in zip(batch[IMAGES], batch[origin]):
                resolved_paths(images or [], Path(label), where)
        return ds.cast_column(IMAGES, List(Image()))
    data_file = Path(label)
    if not data_file.is_file():
        raise DataError(f"{label}: `images` holds file paths, and a hub dataset's paths are "
                        "relative to nothing: give the pictures stored in the rows "
                        "(datasets' Image feature), or a local data file with the pictures "
                        "beside it")
    paths = [resolved_paths(images or [], data_file, where)
             for images, where in zip(ds[IMAGES], ds[origin])]
    return ds.remove_columns(IMAGES).add_column(IMAGES, paths)


def require_images_method(name: str, where: str) -> None:
    """Rows with images need a method that trains on them: a DataError naming the row."""
    from finetune.config.methods import method, names_where, spoken

    if not method(name).vision:
        takers = names_where(lambda m: m.vision)
        raise DataError(f"{where}: the row has images, and method {name} does not take "
                        f"images; {spoken(takers)} train on rows with images (docs/vision.md)")


def require_vision_model(experiment, where: str) -> bool:
    """Rows with images need a method that takes them and a vision-language model: True
    when model.name_or_path is one; a DataError naming the row when the method does not
    take images or a local model is not one. A hub id is read at training (True here)."""
    from finetune.config import vision

    require_images_method(experiment.method, where)
    path = experiment.model.name_or_path
    found = vision.model_type(path)
    if found is None or found in vision.image_text_model_types():
        return True
    raise DataError(f"{where}: the row has images, and model.name_or_path {path} is not a "
                    f"vision-language model (model_type {found}); give an image-text-to-text "
                    "model, or rows without images")
