"""Qwen2-VL and Qwen2.5-VL (`model_type: qwen2_vl`, `qwen2_5_vl`) from their config.json:
the parameters by name as transformers builds them, the tokens one image becomes, and
what one image saves for the backward (qwen2_vl_activations.py).

How they run an image (transformers models/qwen2_vl, qwen2_5_vl): the processor resizes
the picture to multiples of patch_size x spatial_merge_size pixels (28) with a pixel count
between its min_pixels and max_pixels (smart_resize), and cuts it into 14x14 patches
(doubled in time: temporal_patch_size 2). A 3-D convolution embeds each patch; the
blocks (Qwen2-VL: LayerNorm, fused qkv, rotary attention over the image, quick-GELU MLP;
Qwen2.5-VL: RMSNorm, a gated SiLU MLP, attention within windows of window_size pixels
but in the fullatt_block_indexes blocks) run over every patch, and the merger (the
projector: a norm, then an MLP over each 2x2 group of patches) makes one token per
group. The language model is qwen2's, named model.language_model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from finetune.errors import ConfigError
from finetune.estimate.defaults import class_attribute, config_defaults, with_defaults
from finetune.estimate.param import Param
from finetune.estimate.vision import qwen2_vl_activations
from finetune.estimate.vision.common import (DEFAULT_IMAGE, Training, layer_norm, linear,
                                             positive, rms_norm, vision_config)

TOWER = "model.visual."
PROJECTOR = "model.visual.merger."
# Per model type: its config module and classes (top level, text, vision).
CONFIGS = {
    "qwen2_vl": ("qwen2_vl/configuration_qwen2_vl.py", "Qwen2VLConfig", "Qwen2VLTextConfig",
                 "Qwen2VLVisionConfig"),
    "qwen2_5_vl": ("qwen2_5_vl/configuration_qwen2_5_vl.py", "Qwen2_5_VLConfig",
                   "Qwen2_5_VLTextConfig", "Qwen2_5_VLVisionConfig"),
}
# Both use Qwen2-VL's image processor; its class default size is the fallback when the
# model directory has no preprocessor_config.json.
IMAGE_PROCESSOR = ("qwen2_vl/image_processing_qwen2_vl.py", "Qwen2VLImageProcessor")
MAX_ASPECT = 200  # smart_resize refuses more


@dataclass(frozen=True)
class QwenVision:
    family: str                  # qwen2_vl or qwen2_5_vl (qwen3_vl: qwen3_vl.Qwen3Vision)
    tower: str                   # the vision config's model type
    hidden: int                  # the tower's width (Qwen2-VL: embed_dim)
    intermediate: int            # its MLP's
    layers: int
    heads: int
    channels: int
    patch: int
    temporal_patch: int
    merge: int                   # spatial_merge_size: merge x merge patches make a token
    act: str
    out_hidden: int              # the merger's output: the language model's width
    min_pixels: int
    max_pixels: int
    window: int = 0              # Qwen2.5-VL: window_size in pixels (0: full attention)
    full_blocks: tuple[int, ...] = ()  # Qwen2.5-VL: blocks that attend over the whole image
    image: tuple[int, int] = DEFAULT_IMAGE   # the picture (width, height) before resizing
    tower_prefix: str = TOWER
    projector_prefix: str = PROJECTOR

    @property
    def qwen25(self) -> bool:
        return self.family == "qwen2_5_vl"

    @property
    def resized(self) -> tuple[int, int]:
        """(width, height) the processor resizes the picture to (smart_resize)."""
        width, height = self.image
        factor = self.patch * self.merge
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return w, h

    @property
    def positions(self) -> int:
        """Patches the tower runs on per image."""
        w, h = self.resized
        return (w // self.patch) * (h // self.patch)

    @property
    def image_tokens(self) -> int:
        return self.positions // self.merge ** 2

    @property
    def layers_kept(self) -> int:
        return self.layers  # the merger reads the last block: every block reaches the loss

    @property
    def patch_values(self) -> int:
        """pixel_values elements per patch (fp32): channels x time x patch x patch."""
        return self.channels * self.temporal_patch * self.patch ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def window_positions(self, block: int) -> int:
        """Keys each position attends to in `block` (a whole image, or its window)."""
        if not self.window or block in self.full_blocks:
            return self.positions
        return min(self.positions, (self.window // self.patch) ** 2)

    def for_image(self, size: tuple[int, int] | None) -> "QwenVision":
        if size is None:
            return self
        width, height = size
        if max(width, height) / min(width, height) > MAX_ASPECT:
            raise ConfigError([f"--image-size: {width}x{height} has an aspect ratio over "
                               f"{MAX_ASPECT}, which Qwen2-VL's processor refuses"])
        return replace(self, image=size)

    def image_note(self) -> str:
        (w, h), (pw, ph) = self.resized, self.image
        return (f"each {pw}x{ph} pixels (assumed; --image-size sets it), resized by the "
                f"processor to {w}x{h} (multiples of {self.patch * self.merge}, "
                f"{self.min_pixels:,} to {self.max_pixels:,} pixels): {self.image_tokens} "
                f"tokens an image ({self.positions} patches, merged {self.merge}x{self.merge})")

    def tower_note(self) -> str:
        attention = (f"attention within {self.window}-pixel windows but in blocks "
                     f"{', '.join(map(str, self.full_blocks))}" if self.window
                     else "attention over the whole image")
        return (f"vision tower: {self.tower}, {self.layers} blocks over {self.positions} "
                f"patches an image ({attention}), all kept for the backward")

    def parameters(self) -> list[Param]:
        """The tower's and the merger's parameters, in named_parameters() order."""
        h, norm = self.hidden, rms_norm if self.qwen25 else layer_norm
        params = [Param(f"{TOWER}patch_embed.proj.weight",
                        h * self.patch_values, "conv", f"{TOWER}patch_embed.proj", h)]
        for n in range(self.layers):
            block = f"{TOWER}blocks.{n}"
            params += norm(f"{block}.norm1", h) + norm(f"{block}.norm2", h)
            params += linear(f"{block}.attn.qkv", h, 3 * h, True)
            params += linear(f"{block}.attn.proj", h, h, True)
            if self.qwen25:
                for proj in ("gate_proj", "up_proj"):
                    params += linear(f"{block}.mlp.{proj}", h, self.intermediate, True)
                params += linear(f"{block}.mlp.down_proj", self.intermediate, h, True)
            else:
                params += linear(f"{block}.mlp.fc1", h, self.intermediate, True)
                params += linear(f"{block}.mlp.fc2", self.intermediate, h, True)
        merged = h * self.merge ** 2
        params += norm(f"{PROJECTOR}ln_q", h)
        params += linear(f"{PROJECTOR}mlp.0", merged, merged, True)
        params += linear(f"{PROJECTOR}mlp.2", merged, self.out_hidden, True)
        return params

    def unreached(self) -> tuple[str, ...]:
        return ()

    def image_bytes(self, reg, checkpointing: bool, training: Training = Training()) -> int:
        return qwen2_vl_activations.image_bytes(self, reg, checkpointing, training)


def pixel_bounds(processor: dict[str, Any] | None, where: str) -> tuple[int, int]:
    """(min_pixels, max_pixels) as the image processor reads them: its size, with
    min_pixels/max_pixels over it (preprocessor_config.json, else the class default)."""
    size = dict(class_attribute(*IMAGE_PROCESSOR, "size"))
    processor = processor or {}
    if isinstance(processor.get("size"), dict):
        size.update(processor["size"])
    bounds = {"shortest_edge": processor.get("min_pixels", size.get("shortest_edge")),
              "longest_edge": processor.get("max_pixels", size.get("longest_edge"))}
    low, high = (positive(bounds, key, where, "preprocessor_config.size")
                 for key in ("shortest_edge", "longest_edge"))
    if low > high:
        raise ConfigError([f"{where}: the processor's min_pixels {low:,} is more than its "
                           f"max_pixels {high:,}"])
    return low, high


def vision_int(vision: dict[str, Any], key: str, alias: str, where: str) -> int:
    """transformers' attribute_map lets a config name num_heads/depth by their usual names."""
    return positive({key: vision.get(key, vision.get(alias))}, key, where)


def tower_fields(vision: dict[str, Any], where: str) -> dict[str, Any]:
    """What every Qwen tower's config gives alike: heads, channels, patches, merge, act."""
    return dict(heads=vision_int(vision, "num_heads", "num_attention_heads", where),
                channels=positive(vision, "in_channels", where),
                patch=positive(vision, "patch_size", where),
                temporal_patch=positive(vision, "temporal_patch_size", where),
                merge=positive(vision, "spatial_merge_size", where),
                act=str(vision.get("hidden_act")))


def square_patches(vision: dict[str, Any], where: str) -> None:
    """transformers' config also takes a patch size per axis: the estimator reads one."""
    for key in ("patch_size", "temporal_patch_size"):
        if not isinstance(vision.get(key), int):
            raise ConfigError([f"{where}: vision_config.{key} must be one integer (the "
                               f"estimator reads square patches), got {vision.get(key)!r}"])


def read(config: dict[str, Any], where: str,
         processor: dict[str, Any] | None = None) -> tuple[dict[str, Any], QwenVision]:
    """(the language model's config, read as a qwen2 one; the vision shape). A published
    config often keeps the text settings at the top level (no text_config): transformers
    reads them from there."""
    kind = config["model_type"]
    module, top, text_class, vision_class = CONFIGS[kind]
    full = with_defaults(config, module, top)
    text = full.get("text_config")
    if text is None:
        text = {k: v for k, v in full.items() if k not in ("vision_config", "text_config")}
    if not isinstance(text, dict):
        raise ConfigError([f"{where}: text_config must be an object"])
    text = {**with_defaults(text, module, text_class), "model_type": "qwen2"}
    text.pop("head_dim", None)  # its attention's head_dim is hidden_size // heads
    text["tie_word_embeddings"] = bool(full.get("tie_word_embeddings")
                                       or text.get("tie_word_embeddings"))
    vision = vision_config(full, kind, where)
    defaults = {k: v for k, v in config_defaults(module, vision_class).items() if v is not None}
    vision = {**defaults, **vision}
    qwen25 = kind == "qwen2_5_vl"
    hidden = positive(vision, "hidden_size" if qwen25 else "embed_dim", where)
    if qwen25:
        intermediate = positive(vision, "intermediate_size", where)
    else:
        intermediate = int(hidden * vision.get("mlp_ratio", 4))
    square_patches(vision, where)
    blocks = vision.get("fullatt_block_indexes", ()) if qwen25 else ()
    low, high = pixel_bounds(processor, where)
    shape = QwenVision(
        family=kind, tower=str(vision.get("model_type", f"{kind}_vision")), hidden=hidden,
        intermediate=intermediate, layers=vision_int(vision, "depth", "num_hidden_layers", where),
        **tower_fields(vision, where),
        out_hidden=positive(vision, "out_hidden_size" if qwen25 else "hidden_size", where),
        min_pixels=low, max_pixels=high,
        window=positive(vision, "window_size", where) if qwen25 else 0,
        full_blocks=tuple(blocks))
    return text, shape

