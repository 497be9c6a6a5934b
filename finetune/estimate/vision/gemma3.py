"""Gemma 3 (`model_type: gemma3`, transformers models/gemma3): a SigLIP vision tower
(siglip.py), a projector and Gemma 3's language model (shapes.py, `gemma3_text`).

How it runs an image: the processor resizes it to the tower's image_size (896: no
pan-and-scan by default), the tower runs over its (896 / 14)^2 = 4096 patches, and the
projector average-pools them to mm_tokens_per_image (256) soft tokens, normalises each
(Gemma's RMSNorm, mm_soft_emb_norm) and multiplies it by mm_input_projection_weight (a
bare matrix, vision width x text width) into the language model's width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from finetune.errors import ConfigError
from finetune.estimate import walk
from finetune.estimate.defaults import with_defaults
from finetune.estimate.param import Param
from finetune.estimate.vision import siglip
from finetune.estimate.vision.common import (PIXEL_BYTES, Training, positive, rms_norm,
                                             text_config, vision_config)

TOWER = "model.vision_tower."
PROJECTOR = "model.multi_modal_projector."


@dataclass(frozen=True)
class Gemma3Vision:
    family: str
    tower_shape: siglip.Siglip
    tokens: int                  # mm_tokens_per_image
    text_hidden: int
    tower: str = siglip.MODEL_TYPE
    tower_prefix: str = TOWER
    projector_prefix: str = PROJECTOR

    @property
    def positions(self) -> int:
        return self.tower_shape.positions

    @property
    def layers(self) -> int:
        return self.tower_shape.layers

    @property
    def image_tokens(self) -> int:
        return self.tokens

    @property
    def pixels(self) -> int:
        t = self.tower_shape
        return t.channels * t.image_size ** 2

    def for_image(self, size: tuple[int, int] | None) -> "Gemma3Vision":
        return self  # every picture is resized to image_size

    def image_note(self) -> str:
        size = self.tower_shape.image_size
        return (f"each resized to {size}x{size} by the processor: {self.positions} patches "
                f"pooled to {self.tokens} tokens an image")

    def tower_note(self) -> str:
        return (f"vision tower: {self.tower}, {self.layers} layers over {self.positions} "
                "patches an image, all kept for the backward")

    def parameters(self) -> list[Param]:
        v = self.tower_shape.hidden
        return self.tower_shape.parameters() + [
            Param(f"{PROJECTOR}mm_input_projection_weight", v * self.text_hidden, "linear",
                  PROJECTOR.rstrip("."), self.text_hidden)] + rms_norm(
            f"{PROJECTOR}mm_soft_emb_norm", v)

    def unreached(self) -> tuple[str, ...]:
        return ()

    def image_bytes(self, reg: walk.Regime, checkpointing: bool,
                    training: Training = Training()) -> int:
        """The batch's pixels, the tower's saves (siglip.py), then the projector's: the
        average pool's input (the tower's output, per patch), and per token Gemma's
        RMSNorm and the matmul's 16-bit input."""
        total = self.pixels * PIXEL_BYTES
        if not training.tower and not training.projector:
            return total
        if training.tower:
            total += self.tower_shape.image_bytes(reg, checkpointing)
        h = self.tower_shape.hidden
        stream = reg.residual
        if training.tower:
            total += self.positions * h * stream     # avg_pool2d saves its input
        w = walk._Walk()
        pooled = w.new(h, stream)
        normed = walk._gemma_norm(w, pooled, 1, training.projector, grad=training.tower)
        projector = replace(reg, base_trainable=training.projector)
        walk._linear(w, normed, self.text_hidden, projector, False)
        return total + self.tokens * w.total


def read(config: dict[str, Any], where: str,
         processor: dict[str, Any] | None = None) -> tuple[dict[str, Any], Gemma3Vision]:
    kind = config["model_type"]
    full = with_defaults(config, "gemma3/configuration_gemma3.py", "Gemma3Config")
    text = text_config(full, kind, where, "gemma3_text")
    tower = siglip.read(vision_config(full, kind, where), TOWER, where)
    tokens = positive(full, "mm_tokens_per_image", where, "config")
    side = math.isqrt(tokens)
    patches = tower.image_size // tower.patch
    if side * side != tokens or patches % side:
        raise ConfigError([f"{where}: mm_tokens_per_image {tokens} is not a square whose side "
                           f"divides the tower's {patches} patches a side"])
    return text, Gemma3Vision(family=kind, tower_shape=tower, tokens=tokens,
                              text_hidden=positive(text, "hidden_size", where, "text_config"))
