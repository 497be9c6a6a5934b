"""InternVL (`model_type: internvl`, transformers' native InternVLForConditionalGeneration:
the -hf checkpoints of InternVL 2.5/3): an InternViT tower over tiles of the picture, a
pixel-shuffle projector and a qwen2 (or llama) language model.

How it runs an image: InternVLProcessor cuts the picture into tiles (crop_to_patches, on
by the processor's default): of the grids of min_patches..max_patches tiles it takes the
one whose aspect ratio is closest to the picture's (GotOcr2's get_optimal_tiled_canvas),
resizes the picture onto it, and adds the whole picture as one more tile where the grid
has more than one. Each tile runs through the tower: a biased patch convolution, a CLS
position, learned position embeddings, then layers of LayerNorm, attention, a layer scale
(lambda_1), LayerNorm, fc1/GELU/fc2 and another (lambda_2). The projector drops CLS,
folds 2x2 patches into one (pixel shuffle, downsample_ratio 0.5), and runs LayerNorm,
linear_1, GELU, linear_2: (image_size / patch)^2 x ratio^2 tokens a tile (256), and the
text holds them between <img> and </img>.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from finetune.errors import ConfigError
from finetune.estimate import walk
from finetune.estimate.defaults import class_attribute, config_defaults, with_defaults
from finetune.estimate.param import Param
from finetune.estimate.vision.common import (DEFAULT_IMAGE, PIXEL_BYTES, Training,
                                             activation_saves, layer_norm, layer_norm_saves,
                                             linear, positive, text_config, vision_config)
from finetune.estimate.vision.llava_activations import encoder_layer_bytes

TOWER = "model.vision_tower."
PROJECTOR = "model.multi_modal_projector."
CONFIG = ("internvl/configuration_internvl.py", "InternVLConfig")
VISION_CONFIG = ("internvl/configuration_internvl.py", "InternVLVisionConfig")
IMAGE_PROCESSOR = ("got_ocr2/image_processing_pil_got_ocr2.py", "GotOcr2ImageProcessorPil")
PROCESSOR = ("internvl/processing_internvl.py", "InternVLProcessor")
MARKERS = 2  # <img> and </img> around an image's tokens


def tiled_grid(width: int, height: int, tile: int, low: int, high: int) -> tuple[int, int]:
    """(columns, rows): GotOcr2's get_optimal_tiled_canvas, in its arithmetic."""
    grids = sorted(((c, r) for c in range(1, high + 1) for r in range(1, high + 1)
                    if low <= c * r <= high), key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for grid in grids:
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best, best_diff = grid, diff
        elif diff == best_diff and area > 0.5 * tile * tile * grid[0] * grid[1]:
            best = grid
    return best


@dataclass(frozen=True)
class InternVLVision:
    family: str                  # internvl
    tower: str                   # internvl_vision
    hidden: int
    intermediate: int
    layers: int
    heads: int
    channels: int
    image_size: int              # the tower's (and the processor's tile) side
    patch: int
    act: str
    qkv_bias: bool               # attention_bias
    shuffle: int                 # 1 / downsample_ratio: shuffle x shuffle patches a token
    projector_act: str
    text_hidden: int
    tiles_range: tuple[int, int]  # the processor's min_patches, max_patches
    cropping: bool               # crop_to_patches
    image: tuple[int, int] = DEFAULT_IMAGE
    tower_prefix: str = TOWER
    projector_prefix: str = PROJECTOR

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def positions(self) -> int:
        """Positions the tower runs on per tile: the patches and CLS."""
        return self.patches + 1

    @property
    def grid(self) -> tuple[int, int]:
        """(columns, rows) of tiles; (1, 1) where the picture is one tile."""
        low, high = self.tiles_range
        if not self.cropping or high <= 1:
            return 1, 1
        return tiled_grid(*self.image, self.image_size, low, high)

    @property
    def tiles(self) -> int:
        columns, rows = self.grid
        return columns * rows + (1 if columns * rows != 1 else 0)  # + the whole picture

    @property
    def tile_tokens(self) -> int:
        return self.patches // self.shuffle ** 2

    @property
    def features(self) -> int:
        return self.tiles * self.tile_tokens

    @property
    def image_tokens(self) -> int:
        return self.features + MARKERS

    def for_image(self, size: tuple[int, int] | None) -> "InternVLVision":
        return self if size is None else replace(self, image=size)

    def image_note(self) -> str:
        (width, height), (columns, rows) = self.image, self.grid
        cut = (f"{columns}x{rows} tiles of {self.image_size}x{self.image_size} and the whole "
               "picture" if self.tiles > 1 else "one tile")
        return (f"each {width}x{height} pixels (assumed; --image-size sets it): {cut}, "
                f"{self.tile_tokens} tokens a tile, {self.image_tokens} an image (<img> and "
                "</img> included)")

    def tower_note(self) -> str:
        return (f"vision tower: {self.tower}, {self.layers} layers over {self.positions} "
                f"positions a tile ({self.patches} patches + CLS), for each of {self.tiles} "
                f"tiles an image, all kept for the backward")

    def parameters(self) -> list[Param]:
        """The tower's and the projector's parameters, in named_parameters() order."""
        h, e = self.hidden, f"{TOWER}embeddings"
        conv = f"{e}.patch_embeddings.projection"
        params = [Param(f"{e}.cls_token", h, "position", e),
                  Param(f"{e}.position_embeddings", self.positions * h, "position", e),
                  Param(f"{conv}.weight", h * self.channels * self.patch ** 2, "conv", conv, h),
                  Param(f"{conv}.bias", h, "bias", conv)]
        for n in range(self.layers):
            layer = f"{TOWER}encoder.layer.{n}"
            params += [Param(f"{layer}.lambda_1", h, "norm", layer),
                       Param(f"{layer}.lambda_2", h, "norm", layer)]
            for proj in ("q_proj", "k_proj", "v_proj"):
                params += linear(f"{layer}.attention.{proj}", h, h, self.qkv_bias)
            params += linear(f"{layer}.attention.projection_layer", h, h, True)
            params += linear(f"{layer}.mlp.fc1", h, self.intermediate, True)
            params += linear(f"{layer}.mlp.fc2", self.intermediate, h, True)
            params += layer_norm(f"{layer}.layernorm_before", h)
            params += layer_norm(f"{layer}.layernorm_after", h)
        shuffled = h * self.shuffle ** 2
        params += layer_norm(f"{PROJECTOR}layer_norm", shuffled)
        params += linear(f"{PROJECTOR}linear_1", shuffled, self.text_hidden, True)
        params += linear(f"{PROJECTOR}linear_2", self.text_hidden, self.text_hidden, True)
        return params

    def unreached(self) -> tuple[str, ...]:
        return ()  # vision_feature_layer -1: the projector reads the last layer

    def image_bytes(self, reg: walk.Regime, checkpointing: bool,
                    training: Training = Training()) -> int:
        """Per tile: its fp32 pixels; in a trained tower the convolution's 16-bit input and
        the layers that reach the loss (CLIP's layer, activations in llava_activations, and
        the two layer scales' 16-bit inputs, for their own gradients; with checkpointing
        their inputs and one recomputed layer); the projector's LayerNorm, linears and
        GELU per token. A frozen tower saves nothing; a frozen projector only what the
        tower's gradient needs."""
        pixels = self.channels * self.image_size ** 2
        per_tile = pixels * PIXEL_BYTES
        if not training.tower and not training.projector:
            return self.tiles * per_tile
        if training.tower:
            tower = reg.for_tower()
            if tower.base_trainable and (tower.autocast or tower.residual != PIXEL_BYTES):
                per_tile += pixels * tower.compute
            layer = encoder_layer_bytes(self, tower)
            if tower.base_trainable:  # lambda * x saves x for lambda's gradient
                layer += 2 * self.hidden * (tower.compute if tower.autocast else tower.residual)
            if checkpointing:
                layers = self.layers * self.hidden * tower.residual + layer
            else:
                layers = self.layers * layer
            per_tile += self.positions * layers
        projector = reg.for_projector(training.projector)
        w = walk._Walk()
        normed = layer_norm_saves(w, w.new(self.hidden * self.shuffle ** 2, reg.residual),
                                  projector)
        first = walk._linear(w, normed, self.text_hidden, projector, False)
        walk._linear(w, activation_saves(w, first, self.projector_act), self.text_hidden,
                     projector, False)
        return self.tiles * (per_tile + self.tile_tokens * w.total)


def _side(value: Any, key: str, where: str) -> int:
    """image_size / patch_size: one integer or a square [h, w] pair."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    return positive({key: value}, key, where)


def _processor(processor: dict[str, Any] | None, image_size: int,
               where: str) -> tuple[tuple[int, int], bool]:
    """(min_patches, max_patches), crop_to_patches: preprocessor_config.json's, else the
    image processor class's; InternVLProcessor passes crop_to_patches: true on every call,
    over the image processor's own."""
    processor = processor or {}
    size = processor.get("size")
    if isinstance(size, dict) and (size.get("height"), size.get("width")) != (image_size,) * 2:
        raise ConfigError([f"{where}: preprocessor_config.size {size} is not the tower's "
                           f"image_size {image_size}: the estimator counts tiles of the "
                           "tower's size"])
    bounds = {key: processor.get(key, class_attribute(*IMAGE_PROCESSOR, key))
              for key in ("min_patches", "max_patches")}
    low, high = (positive(bounds, key, where, "preprocessor_config")
                 for key in ("min_patches", "max_patches"))
    if low > high:
        raise ConfigError([f"{where}: preprocessor_config.min_patches {low} is more than "
                           f"max_patches {high}"])
    cropping = class_attribute(*PROCESSOR, "images_kwargs").get("crop_to_patches", False)
    return (low, high), bool(cropping)


def read(config: dict[str, Any], where: str,
         processor: dict[str, Any] | None = None) -> tuple[dict[str, Any], InternVLVision]:
    kind = config["model_type"]
    full = with_defaults(config, *CONFIG)
    text = text_config(full, kind, where, "qwen2")
    towers = ("internvl_vision",)
    vision = vision_config(full, kind, where, towers)
    tower = vision.get("model_type", towers[0])
    vision = {**{k: v for k, v in config_defaults(*VISION_CONFIG).items() if v is not None},
              **vision}
    # InternViT-6B's layout (RMSNorm, q/k norms: InternVL 2.5/3's 38B and 78B) is not walked
    for key, usual in (("norm_type", "layer_norm"), ("use_qk_norm", False),
                       ("use_mask_token", False), ("use_absolute_position_embeddings", True),
                       ("use_mean_pooling", True)):
        if vision.get(key, usual) != usual:
            raise ConfigError([f"{where}: vision_config.{key} {vision.get(key)!r}: the "
                               f"estimator counts InternViT-300M's layout ({key} {usual!r})"])
    ratio = full.get("downsample_ratio", 0.5)
    shuffle = round(1 / ratio) if isinstance(ratio, (int, float)) and ratio > 0 else 0
    if shuffle < 1 or abs(shuffle * ratio - 1) > 1e-9:
        raise ConfigError([f"{where}: downsample_ratio {ratio!r} is not 1/n for an integer n"])
    layer = full.get("vision_feature_layer", -1)
    if not isinstance(layer, int) or isinstance(layer, bool) or layer != -1:
        raise ConfigError([f"{where}: vision_feature_layer {layer!r}: the estimator counts "
                           "InternVL's -1 (the last layer) only"])
    select = full.get("vision_feature_select_strategy", "default")
    if select != "default":
        raise ConfigError([f"{where}: vision_feature_select_strategy {select!r}: the "
                           "estimator counts 'default' (CLS dropped) only"])
    image_size = _side(vision.get("image_size"), "image_size", where)
    patch = _side(vision.get("patch_size"), "patch_size", where)
    side = image_size // patch
    if patch > image_size or side % shuffle:
        raise ConfigError([f"{where}: downsample_ratio {ratio} does not fold the tower's "
                           f"{side} patches a side"])
    tiles, cropping = _processor(processor, image_size, where)
    return text, InternVLVision(
        family=kind, tower=tower, hidden=positive(vision, "hidden_size", where),
        intermediate=positive(vision, "intermediate_size", where),
        layers=positive(vision, "num_hidden_layers", where),
        heads=positive(vision, "num_attention_heads", where),
        channels=positive(vision, "num_channels", where), image_size=image_size, patch=patch,
        act=str(vision.get("hidden_act")), qkv_bias=bool(vision.get("attention_bias")),
        shuffle=shuffle,
        projector_act=str(full.get("projector_hidden_act", "gelu")),
        text_hidden=positive(text, "hidden_size", where, "text_config"),
        tiles_range=tiles, cropping=cropping)
