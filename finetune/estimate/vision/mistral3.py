"""Mistral 3 (`model_type: mistral3`, transformers models/mistral3, pixtral: Mistral Small
3.1/3.2): a Pixtral vision tower at the picture's own resolution, a projector with a patch
merger, and a mistral language model.

How it runs an image: the processor (PixtralProcessor) scales the picture down, aspect
ratio kept, until its longest edge is at most size.longest_edge (1540), then rounds both
sides up to multiples of patch_size x spatial_merge_size (28); the tower's convolution
cuts that into 14x14 patches, RMS-normalises them (ln_pre) and runs every layer over them
with 2-D rotary positions (pixtral_activations.py). The projector RMS-normalises the
chosen layer's states, folds each 2x2 group of patches into one token (patch_merger) and
runs linear_1, GELU, linear_2. The text holds one [IMG] token per merged patch, an
[IMG_BREAK] after each row of them and [IMG_END] instead of the last break: rows x
(columns + 1) tokens an image.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from finetune.errors import ConfigError
from finetune.estimate.defaults import config_defaults, with_defaults
from finetune.estimate.param import Param
from finetune.estimate.vision import pixtral_activations
from finetune.estimate.vision.common import (DEFAULT_IMAGE, Training, linear, positive,
                                             rms_norm, text_config, vision_config)

TOWER = "model.vision_tower."
PROJECTOR = "model.multi_modal_projector."
CONFIG = ("mistral3/configuration_mistral3.py", "Mistral3Config")
VISION_CONFIG = ("pixtral/configuration_pixtral.py", "PixtralVisionConfig")


@dataclass(frozen=True)
class Mistral3Vision:
    family: str                  # mistral3
    tower: str                   # pixtral
    hidden: int
    intermediate: int
    layers: int
    heads: int
    channels: int
    patch: int
    act: str                     # the tower's gated MLP's activation (silu, gelu)
    merge: int                   # spatial_merge_size: merge x merge patches make a token
    feature_layer: int           # vision_feature_layer
    projector_act: str
    projector_bias: bool
    text_hidden: int
    longest: int                 # the processor's size.longest_edge
    image: tuple[int, int] = DEFAULT_IMAGE   # the picture (width, height) before resizing
    tower_prefix: str = TOWER
    projector_prefix: str = PROJECTOR

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, columns) of merged patches: the processor's resize, in its arithmetic."""
        width, height = self.image
        ratio = max(height / self.longest, width / self.longest)
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        unit = self.patch * self.merge
        return (height - 1) // unit + 1, (width - 1) // unit + 1

    @property
    def resized(self) -> tuple[int, int]:
        rows, columns = self.grid
        unit = self.patch * self.merge
        return columns * unit, rows * unit

    @property
    def positions(self) -> int:
        """Patches the tower runs on per image."""
        rows, columns = self.grid
        return rows * columns * self.merge ** 2

    @property
    def features(self) -> int:
        """Tokens the projector makes of one image (one a merged patch)."""
        rows, columns = self.grid
        return rows * columns

    @property
    def image_tokens(self) -> int:
        """Tokens one image becomes in the text: its features and a break a row."""
        rows, columns = self.grid
        return rows * (columns + 1)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layers_kept(self) -> int:
        """Layers whose output reaches the loss (hidden_states[0] is ln_pre's output)."""
        f = self.feature_layer
        return max(f if f >= 0 else self.layers + 1 + f, 0)

    def for_image(self, size: tuple[int, int] | None) -> "Mistral3Vision":
        return self if size is None else replace(self, image=size)

    def image_note(self) -> str:
        (pw, ph), (w, h), (rows, columns) = self.image, self.resized, self.grid
        return (f"each {pw}x{ph} pixels (assumed; --image-size sets it), resized by the "
                f"processor to {w}x{h} (longest edge at most {self.longest}, multiples of "
                f"{self.patch * self.merge}): {self.image_tokens} tokens an image ({rows}x"
                f"{columns} merged patches and a break a row)")

    def tower_note(self) -> str:
        return (f"vision tower: {self.tower}, {self.layers} layers over {self.positions} "
                f"patches an image, {self.layers_kept} of them kept for the backward "
                f"(vision_feature_layer {self.feature_layer}); under sdpa its block mask is "
                "counted per image (the tower runs a batch's images as one sequence: the "
                "mask grows with the square of its patches)")

    def parameters(self) -> list[Param]:
        """The tower's and the projector's parameters, in named_parameters() order."""
        h = self.hidden
        conv = f"{TOWER}patch_conv"
        params = [Param(f"{conv}.weight", h * self.channels * self.patch ** 2, "conv", conv, h)]
        params += rms_norm(f"{TOWER}ln_pre", h)
        for n in range(self.layers):
            layer = f"{TOWER}transformer.layers.{n}"
            params += rms_norm(f"{layer}.attention_norm", h)
            for proj in ("gate_proj", "up_proj"):
                params += linear(f"{layer}.feed_forward.{proj}", h, self.intermediate, False)
            params += linear(f"{layer}.feed_forward.down_proj", self.intermediate, h, False)
            for proj in ("k_proj", "v_proj", "q_proj", "o_proj"):
                params += linear(f"{layer}.attention.{proj}", h, h, False)
            params += rms_norm(f"{layer}.ffn_norm", h)
        params += rms_norm(f"{PROJECTOR}norm", h)
        params += linear(f"{PROJECTOR}patch_merger.merging_layer", h * self.merge ** 2, h, False)
        params += linear(f"{PROJECTOR}linear_1", h, self.text_hidden, self.projector_bias)
        params += linear(f"{PROJECTOR}linear_2", self.text_hidden, self.text_hidden,
                         self.projector_bias)
        return params

    def unreached(self) -> tuple[str, ...]:
        """The layers past the feature layer: run, but no .grad."""
        return tuple(f"{TOWER}transformer.layers.{n}."
                     for n in range(self.layers_kept, self.layers))

    def image_bytes(self, reg, checkpointing: bool, training: Training = Training()) -> int:
        return pixtral_activations.image_bytes(self, reg, checkpointing, training)


def _longest(processor: dict[str, Any] | None, vision: dict[str, Any], where: str) -> int:
    """preprocessor_config.json's size.longest_edge, else the tower's image_size (the
    published processors' setting: the tower's positions reach that far)."""
    size = (processor or {}).get("size")
    if isinstance(size, dict) and "longest_edge" in size:
        return positive(size, "longest_edge", where, "preprocessor_config.size")
    return positive(vision, "image_size", where)


def read(config: dict[str, Any], where: str,
         processor: dict[str, Any] | None = None) -> tuple[dict[str, Any], Mistral3Vision]:
    kind = config["model_type"]
    if not isinstance(config.get("text_config"), dict):
        # transformers would fill it from Mistral3Config's own (Mistral Small's), not from
        # MistralConfig's defaults, which is all the estimator reads
        raise ConfigError([f"{where}: a {kind} config without a text_config object: the "
                           "estimator reads the language model's shape from it"])
    full = with_defaults(config, *CONFIG)
    text = text_config(full, kind, where, "mistral")
    towers = ("pixtral",)
    vision = vision_config(full, kind, where, towers)
    tower = vision.get("model_type", towers[0])
    vision = {**{k: v for k, v in config_defaults(*VISION_CONFIG).items() if v is not None},
              **vision}
    for key in ("patch_size", "image_size"):
        if not isinstance(vision.get(key), int):
            raise ConfigError([f"{where}: vision_config.{key} must be one integer (the "
                               f"estimator reads square patches), got {vision.get(key)!r}"])
    layer = full.get("vision_feature_layer", -1)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise ConfigError([f"{where}: vision_feature_layer must be one integer (the "
                           f"estimator does not count a list of layers), got {layer!r}"])
    shape = Mistral3Vision(
        family=kind, tower=tower, hidden=positive(vision, "hidden_size", where),
        intermediate=positive(vision, "intermediate_size", where),
        layers=positive(vision, "num_hidden_layers", where),
        heads=positive(vision, "num_attention_heads", where),
        channels=positive(vision, "num_channels", where),
        patch=positive(vision, "patch_size", where), act=str(vision.get("hidden_act")),
        merge=positive(full, "spatial_merge_size", where, "config"), feature_layer=layer,
        projector_act=str(full.get("projector_hidden_act", "gelu")),
        projector_bias=bool(full.get("multimodal_projector_bias")),
        text_hidden=positive(text, "hidden_size", where, "text_config"),
        longest=_longest(processor, vision, where))
    if not -shape.layers - 1 <= layer <= shape.layers:
        raise ConfigError([f"{where}: vision_feature_layer {layer} is not one of the tower's "
                           f"{shape.layers + 1} hidden states"])
    return text, shape
