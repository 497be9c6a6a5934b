"""Idefics3 and SmolVLM (`model_type: idefics3`, `smolvlm`; transformers models/idefics3,
smolvlm): a SigLIP-layout vision tower (siglip.py) over tiles of the picture, a connector
(pixel shuffle, then one Linear without bias) and a llama language model, named
model.text_model.

How they run an image: the processor rescales the picture so its longest edge is
size.longest_edge (4 x 364 for Idefics3; the aspect ratio kept, upscaling a small one),
rounds both sides up to multiples of max_image_size (the tile, 364), cuts that into tiles
and adds the whole picture resized to one tile (do_image_splitting; without it, the
picture resized to one tile). Each tile runs through the tower; the connector folds
scale_factor x scale_factor patches into one token: (tile / patch)^2 / scale_factor^2
tokens a tile (169 for Idefics3-8B, 64 for SmolVLM). The text adds a few marker tokens a
tile (<fake_token_around_image>, <row_r_col_c>, a newline a row), not counted here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from finetune.errors import ConfigError
from finetune.estimate import walk
from finetune.estimate.defaults import class_attribute, with_defaults
from finetune.estimate.param import Param
from finetune.estimate.vision import siglip
from finetune.estimate.vision.common import (DEFAULT_IMAGE, PIXEL_BYTES, Training, positive,
                                             text_config, vision_config)

TOWER = "model.vision_model."
PROJECTOR = "model.connector."
TEXT_PREFIX = "model.text_model."
MAX_IMAGE_SIZE = 4096  # the processors' absolute maximum side
# Per model type: (config module, top class, vision class, vision model type, processor).
CONFIGS = {
    "idefics3": ("idefics3/configuration_idefics3.py", "Idefics3Config", "Idefics3VisionConfig",
                 "idefics3_vision", ("idefics3/image_processing_idefics3.py",
                                     "Idefics3ImageProcessor")),
    "smolvlm": ("smolvlm/configuration_smolvlm.py", "SmolVLMConfig", "SmolVLMVisionConfig",
                "smolvlm_vision", ("smolvlm/image_processing_smolvlm.py",
                                   "SmolVLMImageProcessor")),
}


def _rescale(height: int, width: int, longest: int) -> tuple[int, int]:
    """The processor's resize: the longest edge to `longest` (the other even), then under
    MAX_IMAGE_SIZE."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


@dataclass(frozen=True)
class Idefics3Vision:
    family: str
    tower: str                   # the vision config's model type
    tower_shape: siglip.Siglip
    scale: int                   # scale_factor: scale x scale patches fold into one token
    text_hidden: int
    longest: int                 # the processor's size.longest_edge
    tile: int                    # its max_image_size.longest_edge
    splitting: bool              # do_image_splitting
    image: tuple[int, int] = DEFAULT_IMAGE
    tower_prefix: str = TOWER
    projector_prefix: str = PROJECTOR

    layers = property(lambda self: self.tower_shape.layers)
    positions = property(lambda self: self.tower_shape.positions)

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, columns) of tiles; (0, 0) where the picture is one tile."""
        if not self.splitting:
            return 0, 0
        width, height = self.image
        height, width = _rescale(height, width, self.longest)
        aspect = width / height
        if width >= height:
            width = math.ceil(width / self.tile) * self.tile
            height = math.ceil(int(width / aspect) / self.tile) * self.tile
        else:
            height = math.ceil(height / self.tile) * self.tile
            width = math.ceil(int(height * aspect) / self.tile) * self.tile
        if height > self.tile or width > self.tile:
            return (height - self.tile) // self.tile + 1, (width - self.tile) // self.tile + 1
        return 0, 0

    @property
    def tiles(self) -> int:
        rows, columns = self.grid
        return rows * columns + 1 if rows else 1

    @property
    def tile_tokens(self) -> int:
        return self.positions // self.scale ** 2

    @property
    def image_tokens(self) -> int:
        return self.tiles * self.tile_tokens

    def for_image(self, size: tuple[int, int] | None) -> "Idefics3Vision":
        return self if size is None else replace(self, image=size)

    def image_note(self) -> str:
        (width, height), (rows, columns) = self.image, self.grid
        cut = (f"{rows}x{columns} tiles of {self.tile}x{self.tile} and the whole picture"
               if rows else "one tile")
        return (f"each {width}x{height} pixels (assumed; --image-size sets it): {cut}, "
                f"{self.tile_tokens} tokens a tile, {self.image_tokens} an image (and a few "
                "marker tokens a tile, not counted)")

    def tower_note(self) -> str:
        return (f"vision tower: {self.tower}, {self.layers} layers over {self.positions} patches a tile, "
                f"for each of {self.tiles} tiles an image, all kept for the backward")

    def parameters(self) -> list[Param]:
        name = f"{PROJECTOR}modality_projection.proj"
        features = self.tower_shape.hidden * self.scale ** 2
        return self.tower_shape.parameters() + [
            Param(f"{name}.weight", features * self.text_hidden, "linear", name,
                  self.text_hidden)]

    def unreached(self) -> tuple[str, ...]:
        return ()

    def image_bytes(self, reg: walk.Regime, checkpointing: bool,
                    training: Training = Training()) -> int:
        """Per tile: its fp32 pixels and bool pixel mask, the tower's saves (siglip.py,
        and the int64 position ids its embedding reads), the connector Linear's 16-bit
        input per token."""
        t = self.tower_shape
        per_tile = t.channels * t.image_size ** 2 * PIXEL_BYTES + t.image_size ** 2
        if training.tower:
            per_tile += t.image_bytes(reg, checkpointing) + 8 * t.positions
        w = walk._Walk()
        walk._linear(w, w.new(t.hidden * self.scale ** 2, reg.residual), self.text_hidden,
                    replace(reg, base_trainable=training.projector), False)
        if training.tower or training.projector:
            per_tile += self.tile_tokens * w.total
        return self.tiles * per_tile


def _processor(processor: dict[str, Any] | None, kind: str, where: str) -> tuple[int, int, bool]:
    module = CONFIGS[kind][4]
    processor = processor or {}
    found = {}
    for key in ("size", "max_image_size"):
        value = processor.get(key)
        value = value if isinstance(value, dict) else class_attribute(*module, key)
        found[key] = positive(value, "longest_edge", where, f"preprocessor_config.{key}")
    splitting = processor.get("do_image_splitting",
                              class_attribute(*module, "do_image_splitting"))
    return found["size"], found["max_image_size"], bool(splitting)


def read(config: dict[str, Any], where: str,
         processor: dict[str, Any] | None = None) -> tuple[dict[str, Any], Idefics3Vision]:
    kind = config["model_type"]
    module, top, vision_class, vision_type, _ = CONFIGS[kind]
    full = with_defaults(config, module, top)
    text = text_config(full, kind, where, "llama")
    vision = vision_config(full, kind, where)
    # published configs name the tower's type as the model's own (idefics3) or its own
    tower = siglip.read(vision, TOWER, where, (vision_type, kind), (module, vision_class))
    scale = positive(full, "scale_factor", where, "config")
    side = tower.image_size // tower.patch
    if side % scale:
        raise ConfigError([f"{where}: scale_factor {scale} does not divide the tower's "
                           f"{side} patches a side"])
    longest, tile, splitting = _processor(processor, kind, where)
    return text, Idefics3Vision(family=kind, tower=str(vision.get("model_type", vision_type)),
                                tower_shape=tower, scale=scale,
                                text_hidden=positive(text, "hidden_size", where, "text_config"),
                                longest=longest, tile=tile, splitting=splitting)
