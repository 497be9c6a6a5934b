"""LLaVA-NeXT (`model_type: llava_next`, transformers models/llava_next): LLaVA's CLIP tower,
projector and language model (llava.py) over tiles of the picture, and an image_newline
parameter.

How it runs an image ("anyres"): the processor picks, among image_grid_pinpoints, the
resolution that keeps most of the picture (select_best_resolution), resizes the picture
into it and cuts it into image_size tiles (336), plus the whole picture resized to one
tile: each tile runs through the tower and the projector as a LLaVA image does. The
tiles' features are then laid out as one grid, the rows and columns that are only
padding are dropped (unpad), and image_newline ends each row; the whole picture's 576
tokens come first. So the tokens depend on the picture's size: 640x480 (the default
assumption) becomes 4 tiles and 2340 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from finetune.errors import ConfigError
from finetune.estimate import walk
from finetune.estimate.param import Param
from finetune.estimate.vision import llava, llava_activations
from finetune.estimate.vision.common import DEFAULT_IMAGE, Training

CONFIG = ("llava_next/configuration_llava_next.py", "LlavaNextConfig")
# LlavaNextConfig.__post_init__'s, where the config names none.
DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
NEWLINE = "model.image_newline"


def best_resolution(height: int, width: int,
                    pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """transformers' select_best_resolution: the (height, width) that keeps the most of
    the picture, then wastes the least."""
    best, kept_most, wasted_least = pinpoints[0], 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > kept_most or (kept == kept_most and wasted < wasted_least):
            best, kept_most, wasted_least = (h, w), kept, wasted
    return best


@dataclass(frozen=True)
class LlavaNextVision:
    base: llava.LlavaVision      # one tile's tower and projector
    pinpoints: tuple[tuple[int, int], ...]
    image: tuple[int, int] = DEFAULT_IMAGE   # the picture (width, height)

    family = property(lambda self: self.base.family)
    tower = property(lambda self: self.base.tower)
    layers = property(lambda self: self.base.layers)
    layers_kept = property(lambda self: self.base.layers_kept)
    tower_prefix = llava.TOWER
    projector_prefix = (llava.PROJECTOR, NEWLINE)

    @property
    def grid(self) -> tuple[int, int]:
        """Tiles (down, across) of the resolution the picture is resized into."""
        width, height = self.image
        h, w = best_resolution(height, width, self.pinpoints)
        side = self.base.image_size
        return h // side, w // side

    @property
    def tiles(self) -> int:
        """Tiles through the tower: the grid's and the whole picture's."""
        down, across = self.grid
        return down * across + 1

    @property
    def image_tokens(self) -> int:
        """The processor's count (_get_number_of_features): the whole picture's tokens, then
        the grid's features less the padding rows or columns, and a newline a row."""
        width, height = self.image
        side = self.base.image_size // self.base.patch
        down, across = self.grid
        rows, columns = side * down, side * across
        if width / height > columns / rows:
            rows -= (rows - int(round(height * (columns / width), 7))) // 2 * 2
        else:
            columns -= (columns - int(round(width * (rows / height), 7))) // 2 * 2
        return self.base.image_tokens + rows * columns + rows

    @property
    def positions(self) -> int:
        return self.base.positions

    def for_image(self, size: tuple[int, int] | None) -> "LlavaNextVision":
        return self if size is None else replace(self, image=size)

    def image_note(self) -> str:
        (width, height), (down, across) = self.image, self.grid
        side = self.base.image_size
        return (f"each {width}x{height} pixels (assumed; --image-size sets it): "
                f"{down}x{across} tiles of {side}x{side} and the whole picture, "
                f"{self.image_tokens} tokens an image")

    def tower_note(self) -> str:
        return f"{self.base.tower_note()}, for each of {self.tiles} tiles an image"

    def parameters(self) -> list[Param]:
        return self.base.parameters() + [
            Param(NEWLINE, self.base.text_hidden, "position", NEWLINE)]

    def unreached(self) -> tuple[str, ...]:
        return self.base.unreached()

    def image_bytes(self, reg: walk.Regime, checkpointing: bool,
                    training: Training = Training()) -> int:
        """Every tile as a LLaVA image (the unpadding and newlines save nothing)."""
        return self.tiles * llava_activations.image_bytes(self.base, reg, checkpointing,
                                                           training)


def read(config: dict[str, Any], where: str,
         processor: dict[str, Any] | None = None) -> tuple[dict[str, Any], LlavaNextVision]:
    text, base = llava.read(config, where, processor, CONFIG)
    pinpoints = config.get("image_grid_pinpoints") or DEFAULT_PINPOINTS
    try:
        pinpoints = tuple((int(h), int(w)) for h, w in pinpoints)
    except (TypeError, ValueError):
        raise ConfigError([f"{where}: image_grid_pinpoints must be [height, width] pairs"]) \
            from None
    if any(h % base.image_size or w % base.image_size or h <= 0 or w <= 0
           for h, w in pinpoints) or not pinpoints:
        raise ConfigError([f"{where}: image_grid_pinpoints must be multiples of the tower's "
                           f"image_size {base.image_size}"])
    return text, LlavaNextVision(base=base, pinpoints=pinpoints)
