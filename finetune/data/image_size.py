"""vision.max_pixels / min_pixels: an image outside those bounds is resized, aspect ratio
kept, before the processor sees it, for any model (LLaMA-Factory's image_max_pixels and
image_min_pixels; a processor's own size settings differ from model to model). Rows reach
TRL's vision collator with image paths; within the bounds they stay paths."""

from __future__ import annotations

import math
from typing import Callable


def fitted(image, max_pixels: int | None, min_pixels: int | None):
    """The picture, scaled so that width x height lies within the bounds (rounded down
    for the upper one, up for the lower one; at least 1 x 1)."""
    pixels = image.width * image.height
    if max_pixels is not None and pixels > max_pixels:
        scale = math.sqrt(max_pixels / pixels)
        size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
    elif min_pixels is not None and pixels < min_pixels:
        scale = math.sqrt(min_pixels / pixels)
        size = (math.ceil(image.width * scale), math.ceil(image.height * scale))
    else:
        return image
    return image.resize(size)


def fit_all(images: list, max_pixels: int | None, min_pixels: int | None) -> list:
    """A row's images (paths or pictures) as the processor is to see them: within the
    bounds, each opened as the processor opens a path (transformers' load_image: EXIF
    orientation, RGB) and fitted; without bounds, as they are."""
    if max_pixels is None and min_pixels is None:
        return list(images)
    from transformers.image_utils import load_image

    return [fitted(load_image(image), max_pixels, min_pixels) for image in images]


def fitter(experiment) -> Callable[[list], list]:
    """fit_all with the experiment's vision.max_pixels / min_pixels (`list`: no bounds)."""
    spec = experiment.vision
    if spec is None or (spec.max_pixels is None and spec.min_pixels is None):
        return list
    return lambda images: fit_all(images, spec.max_pixels, spec.min_pixels)


class ImagesSized:
    """A collator wrapper: each row's images opened as the processor opens a path
    (transformers' load_image: EXIF orientation, RGB) and fitted to the experiment's
    vision.max_pixels / min_pixels (fitter); the one wrapper training and `finetune data`
    put around every vision collator."""

    def __init__(self, collate, experiment):
        self.collate, self.fit = collate, fitter(experiment)

    def __call__(self, rows):
        if self.fit is list:
            return self.collate(rows)
        return self.collate([{**row, "images": self.fit(row.get("images") or [])}
                             for row in rows])
