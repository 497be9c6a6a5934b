"""PaliGemma and PaliGemma 2 (`model_type: paligemma`, transformers models/paligemma): a
SigLIP vision tower (siglip.py), a one-Linear projector and a Gemma (PaliGemma) or Gemma 2
(PaliGemma 2) language model (shapes.py).

How it runs an image: the processor resizes it to the tower's image_size (224, 448 or
896), the tower runs over its (image_size / 14)^2 patches, and the projector's Linear maps
each patch's last hidden state to the language model's width: one token a patch (256 at
224 pixels), scaled by 1 / sqrt(hidden) (no saved tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from finetune.errors import ConfigError
from finetune.estimate import walk
from finetune.estimate.defaults import with_defaults
from finetune.estimate.param import Param
from finetune.estimate.vision import siglip
from finetune.estimate.vision.common import (PIXEL_BYTES, Training, linear, positive,
                                             text_config)

TOWER = "model.vision_tower."
PROJECTOR = "model.multi_modal_projector."


@dataclass(frozen=True)
class PaliGemmaVision:
    family: str
    tower_shape: siglip.Siglip
    projection: int              # projection_dim: the projector's output, the text width
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
        return self.positions

    def for_image(self, size: tuple[int, int] | None) -> "PaliGemmaVision":
        return self  # every picture is resized to image_size

    def image_note(self) -> str:
        size = self.tower_shape.image_size
        return (f"each resized to {size}x{size} by the processor: {self.image_tokens} "
                "tokens an image (one a patch)")

    def tower_note(self) -> str:
        return (f"vision tower: {self.tower}, {self.layers} layers over {self.positions} "
                "patches an image, all kept for the backward")

    def parameters(self) -> list[Param]:
        return self.tower_shape.parameters() + linear(
            f"{PROJECTOR}linear", self.tower_shape.hidden, self.projection, True)

    def unreached(self) -> tuple[str, ...]:
        return ()

    def image_bytes(self, reg: walk.Regime, checkpointing: bool,
                    training: Training = Training()) -> int:
        """The batch's pixels, the tower's saves (siglip.py), and the projector Linear's
        input when its weight trains."""
        t = self.tower_shape
        total = t.channels * t.image_size ** 2 * PIXEL_BYTES
        if training.tower:
            total += t.image_bytes(reg, checkpointing)
        w = walk._Walk()
        walk._linear(w, w.new(t.hidden, reg.residual),
                    self.projection, replace(reg, base_trainable=training.projector), False)
        return total + self.positions * w.total


def read(config: dict[str, Any], where: str,
         processor: dict[str, Any] | None = None) -> tuple[dict[str, Any], PaliGemmaVision]:
    kind = config["model_type"]
    for key in ("text_config", "vision_config"):
        if not isinstance(config.get(key), dict):
            raise ConfigError([f"{where}: a {kind} config without a {key} object: the "
                               "estimator reads the model's shape from it"])
    full = with_defaults(config, "paligemma/configuration_paligemma.py", "PaliGemmaConfig")
    text = text_config(full, kind, where, "gemma")
    tower = siglip.read(full["vision_config"], TOWER, where)
    projection = positive(full, "projection_dim", where, "config")
    if projection != text.get("hidden_size"):
        raise ConfigError([f"{where}: projection_dim {projection} is not text_config."
                           f"hidden_size {text.get('hidden_size')}"])
    return text, PaliGemmaVision(family=kind, tower_shape=tower, projection=projection)
