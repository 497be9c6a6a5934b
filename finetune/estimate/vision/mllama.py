"""Llama 3.2 Vision (`model_type: mllama`): a two-stage vision tower over tiles, a one-Linear
projector, and a Llama language model with cross-attention layers
(finetune/estimate/cross_attention.py) that read the image instead of image tokens.

How it runs an image (transformers models/mllama): MllamaImageProcessor picks, among the
tile grids of at most max_image_tiles tiles, the canvas that upscales the picture least (or
downscales it least), resizes the picture onto it (aspect ratio kept), pads it and cuts it
into image_size tiles; pixel_values are padded with empty tiles to max_image_tiles. The
tower embeds each tile's patches (a bias-free convolution), adds a gated tile-aspect
embedding, a CLS position, gated position and tile-position embeddings, a LayerNorm, pads
each tile's positions to a multiple of 8, and runs its local layers (CLIP-like, no biases
in attention) then, after a LayerNorm and another gated tile embedding, its global layers
(with tanh gates on attention and MLP) over all tiles as one sequence, under a mask of
the padding; the last layer's states and the local layers' at intermediate_layers_indices
are concatenated (vision_output_dim) and the projector maps each to the text's hidden
size. The text holds one `<|image|>` token an image; the language model's cross-attention
layers attend to every tile's positions. The tower's layers are plain modules, not
GradientCheckpointingLayers: activation checkpointing leaves them whole.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from finetune.errors import ConfigError
from finetune.estimate import walk
from finetune.estimate.defaults import class_attribute, with_defaults
from finetune.estimate.param import Param
from finetune.estimate.vision.common import (DEFAULT_IMAGE, PIXEL_BYTES, Training, layer_norm,
                                             layer_norm_saves, linear, positive, stream_bytes)
from finetune.estimate.vision.llava_activations import encoder_layer_bytes

TOWER = "model.vision_model."
PROJECTOR = "model.multi_modal_projector."
MODULE = "mllama/configuration_mllama.py"
IMAGE_PROCESSOR = ("mllama/image_processing_pil_mllama.py", "MllamaImageProcessorPil")
# What MllamaTextConfig's and MllamaVisionConfig's __post_init__ fill in for a null value
CROSS_ATTENTION_LAYERS = (3, 8, 13, 18, 23, 28, 33, 38)
INTERMEDIATE_LAYERS = (3, 7, 15, 23, 30)
ASPECT_RATIOS = 8  # [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]]
EXTRA_EMBEDDINGS = 8  # MllamaTextModel's embed_tokens holds vocab_size + 8 rows
POSITION_ALIGN = 8   # the tower pads each tile's positions to a multiple of 8


def tiled_canvas(width: int, height: int, tile: int, most: int) -> tuple[int, int]:
    """(rows, columns) of tiles: MllamaImageProcessor's get_optimal_tiled_canvas, in its
    arithmetic (the least upscaling, else the least downscaling; the smaller canvas on a
    tie)."""
    grids = [(r, c) for r in range(1, most + 1) for c in range(1, most + 1) if r * c <= most]
    scales = [min(r * tile / height, c * tile / width) for r, c in grids]
    up = [s for s in scales if s >= 1]
    chosen = min(up) if up else max(scales)
    fitting = [g for g, s in zip(grids, scales) if s == chosen]
    return min(fitting, key=lambda g: g[0] * g[1])


@dataclass(frozen=True)
class MllamaVision:
    family: str                  # mllama
    tower: str                   # mllama_vision_model
    hidden: int
    intermediate: int
    layers: int                  # the local encoder's
    global_layers: int
    heads: int
    channels: int
    image_size: int              # a tile's side, the tower's and the processor's
    patch: int
    act: str
    intermediate_layers: tuple[int, ...]
    aspect_ratios: int           # len(supported_aspect_ratios)
    max_tiles: int               # max_num_tiles (the processor's max_image_tiles)
    output_dim: int              # vision_output_dim
    text_hidden: int
    cross_layers: tuple[int, ...]
    image: tuple[int, int] = DEFAULT_IMAGE
    tower_prefix: str = TOWER
    projector_prefix: str = PROJECTOR
    image_tokens: int = 1        # one <|image|> token an image

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def positions(self) -> int:
        """A tile's positions: its patches and CLS."""
        return self.patches + 1

    @property
    def sequence(self) -> int:
        """Positions the tower's layers run over per image: every tile (the padded ones
        too), each padded to a multiple of 8."""
        return self.max_tiles * -(-self.positions // POSITION_ALIGN) * POSITION_ALIGN

    @property
    def vision_keys(self) -> int:
        """Keys (and values) an image gives every cross-attention layer."""
        return self.max_tiles * self.positions

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, columns) of tiles the processor cuts the picture into."""
        return tiled_canvas(*self.image, self.image_size, self.max_tiles)

    @property
    def tiles(self) -> int:
        rows, columns = self.grid
        return rows * columns

    def for_image(self, size: tuple[int, int] | None) -> "MllamaVision":
        return self if size is None else replace(self, image=size)

    def image_note(self) -> str:
        (width, height), (rows, columns) = self.image, self.grid
        return (f"each {width}x{height} pixels (assumed; --image-size sets it): {columns}x{rows} "
                f"tiles of {self.image_size}x{self.image_size} (padded to {self.max_tiles}), "
                "1 token an image (<|image|>; the language model's cross-attention layers "
                f"read its {self.vision_keys} vision positions)")

    def tower_note(self) -> str:
        return (f"vision tower: {self.tower}, {self.layers} local and {self.global_layers} "
                f"global layers over {self.sequence} positions an image ({self.max_tiles} "
                f"tiles of {self.positions} positions padded to a multiple of 8), all kept "
                "for the backward (its layers are not checkpointed)")

    def parameters(self) -> list[Param]:
        """The tower's and the projector's parameters (named_parameters() order)."""
        h, a, t, p = self.hidden, self.aspect_ratios + 1, self.max_tiles, self.positions
        gated, pre, post = (f"{TOWER}{name}" for name in (
            "gated_positional_embedding", "pre_tile_positional_embedding",
            "post_tile_positional_embedding"))
        params = [Param(f"{TOWER}class_embedding", h, "position", TOWER.rstrip(".")),
                  Param(f"{TOWER}patch_embedding.weight", h * self.channels * self.patch ** 2,
                        "conv", f"{TOWER}patch_embedding", h),
                  Param(f"{gated}.gate", 1, "norm", gated),
                  Param(f"{gated}.embedding", p * h, "position", gated),
                  Param(f"{gated}.tile_embedding.weight", a * t * p * h, "position",
                        f"{gated}.tile_embedding")]
        for tile in (pre, post):
            params += [Param(f"{tile}.gate", 1, "norm", tile),
                       Param(f"{tile}.embedding.weight", a * t * h, "position",
                             f"{tile}.embedding")]
        params += layer_norm(f"{TOWER}layernorm_pre", h) + layer_norm(f"{TOWER}layernorm_post", h)
        for encoder, count in (("transformer", self.layers),
                               ("global_transformer", self.global_layers)):
            for n in range(count):
                layer = f"{TOWER}{encoder}.layers.{n}"
                if encoder == "global_transformer":
                    params += [Param(f"{layer}.gate_attn", 1, "norm", layer),
                               Param(f"{layer}.gate_ffn", 1, "norm", layer)]
                for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    params += linear(f"{layer}.self_attn.{proj}", h, h, False)
                params += linear(f"{layer}.mlp.fc1", h, self.intermediate, True)
                params += linear(f"{layer}.mlp.fc2", self.intermediate, h, True)
                params += layer_norm(f"{layer}.input_layernorm", h)
                params += layer_norm(f"{layer}.post_attention_layernorm", h)
        return params + linear(PROJECTOR.rstrip("."), self.output_dim, self.text_hidden, True)

    def unreached(self) -> tuple[str, ...]:
        return ()  # the last local layer feeds layernorm_post: every module is read

    def image_bytes(self, reg: walk.Regime, checkpointing: bool,
                    training: Training = Training()) -> int:
        """Per image: its fp32 pixels (max_tiles tiles); in a tower on the backward's path
        the convolution's 16-bit input, the embeddings' and gates' saves, the LayerNorms,
        the local and global layers over every position (CLIP's layer; the global ones'
        gated attention and MLP outputs, for the gates), sdpa's mask (once: every layer
        reads the same one); the projector's input per position. Checkpointing changes
        nothing here: the tower's layers are not checkpointed."""
        pixels = self.max_tiles * self.channels * self.image_size ** 2
        total = pixels * PIXEL_BYTES
        if not training.tower and not training.projector:
            return total
        if training.tower:
            total += self._tower_bytes(reg.for_tower(), pixels)
        projector = reg.for_projector(training.projector)
        w = walk._Walk()
        walk._linear(w, w.new(self.output_dim, reg.residual), self.text_hidden, projector,
                     False)
        return total + self.vision_keys * w.total

    def _tower_bytes(self, tower: walk.Regime, pixels: int) -> int:
        h, t, p, s = self.hidden, self.max_tiles, self.positions, self.sequence
        res, trained = tower.residual, tower.base_trainable
        total = 0
        if trained:
            if tower.autocast or res != PIXEL_BYTES:
                total += pixels * tower.compute       # the convolution's 16-bit input
            # the aspect ratio id the embeddings read (int64), the pre- and post-tile and
            # the tile-position embeddings (for their gates), and the gates' scalars
            total += 8 + (2 * t * h + t * p * h) * res + (5 + 2 * self.global_layers) * res
        else:  # the global layers' gates, on the hidden states' gradient path
            total += 2 * self.global_layers * res
        w = walk._Walk()
        layer_norm_saves(w, w.new(h, res), tower)                    # layernorm_pre
        total += t * p * w.total
        w = walk._Walk()
        layer_norm_saves(w, w.new(h, res), tower)                    # layernorm_post
        total += s * w.total
        shape = SimpleNamespace(hidden=h, heads=self.heads, positions=s,
                                intermediate=self.intermediate, act=self.act)
        layer = encoder_layer_bytes(shape, tower)
        gates = 2 * h * (tower.compute if tower.autocast else res) if trained else 0
        total += s * (self.layers * layer + self.global_layers * (layer + gates))
        if tower.attention == "sdpa":
            total += s * s * stream_bytes(tower)   # the padding mask, in the stream's dtype
        return total


def _side(value: Any, key: str, where: str) -> int:
    """image_size / patch_size: one integer or a square pair."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    return positive({key: value}, key, where)


def _indices(value: Any, default: tuple[int, ...], key: str, count: int, where: str,
             what: str) -> tuple[int, ...]:
    """A list of layer indices (null: the config class's default), each a layer's."""
    found = default if value is None else value
    if not isinstance(found, (list, tuple)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n < count for n in found):
        raise ConfigError([f"{where}: {what}.{key} must be a list of layer indices in "
                           f"0..{count - 1}, got {str(value)[:60]}"])
    return tuple(found)


def _processor(processor: dict[str, Any] | None, image_size: int, tiles: int, where: str):
    """The processor's tile must be the tower's, and its max_image_tiles the tower's
    max_num_tiles (the model's tile embeddings are sized by it)."""
    processor = processor or {}
    size = processor.get("size")
    if size is not None and (not isinstance(size, dict) or
                             (size.get("height"), size.get("width")) != (image_size,) * 2):
        raise ConfigError([f"{where}: preprocessor_config.size {size} is not the tower's "
                           f"image_size {image_size}: the estimator counts tiles of the "
                           "tower's size"])
    most = processor.get("max_image_tiles", class_attribute(*IMAGE_PROCESSOR, "max_image_tiles"))
    if most != tiles:
        raise ConfigError([f"{where}: preprocessor_config.max_image_tiles {most!r} is not "
                           f"vision_config.max_num_tiles {tiles}"])


def read(config: dict[str, Any], where: str,
         processor: dict[str, Any] | None = None) -> tuple[dict[str, Any], MllamaVision]:
    kind = config["model_type"]
    full = with_defaults(config, MODULE, "MllamaConfig")
    text, vision = full.get("text_config") or {}, full.get("vision_config") or {}
    if not isinstance(text, dict) or not isinstance(vision, dict):
        raise ConfigError([f"{where}: text_config and vision_config must be objects"])
    for part, expected in ((text, "mllama_text_model"), (vision, "mllama_vision_model")):
        if part.get("model_type", expected) != expected:
            raise ConfigError([f"{where}: a {kind} model with a {part['model_type']!r} part "
                               f"is not counted by the estimator (it counts {expected})"])
    text = with_defaults(text, MODULE, "MllamaTextConfig")
    vision = with_defaults(vision, MODULE, "MllamaVisionConfig")
    if "num_attention_heads" in vision:  # MllamaVisionConfig's attribute_map
        vision["attention_heads"] = vision.pop("num_attention_heads")
    hidden = positive(text, "hidden_size", where, "text_config")
    heads = positive(text, "num_attention_heads", where, "text_config")
    layers = positive(text, "num_hidden_layers", where, "text_config")
    cross = _indices(text.get("cross_attention_layers"), CROSS_ATTENTION_LAYERS,
                     "cross_attention_layers", layers, where, "text_config")
    # the language model as shapes.shape_of reads a llama: head_dim is hidden / heads
    # (mllama's attention reads no head_dim), nothing tied (MllamaForConditionalGeneration
    # ties no weights), no biases
    language = {key: text[key] for key in ("hidden_size", "intermediate_size",
                                           "num_hidden_layers", "num_attention_heads",
                                           "num_key_value_heads", "vocab_size",
                                           "max_position_embeddings") if key in text}
    language.update(model_type="llama", head_dim=hidden // heads, tie_word_embeddings=False)
    v_hidden = positive(vision, "hidden_size", where)
    v_layers = positive(vision, "num_hidden_layers", where)
    image_size = _side(vision.get("image_size"), "image_size", where)
    patch = _side(vision.get("patch_size"), "patch_size", where)
    if patch > image_size:
        raise ConfigError([f"{where}: vision_config.patch_size {patch} is larger than "
                           f"image_size {image_size}"])
    intermediate = _indices(vision.get("intermediate_layers_indices"), INTERMEDIATE_LAYERS,
                            "intermediate_layers_indices", v_layers, where, "vision_config")
    output = positive(vision, "vision_output_dim", where)
    if output != v_hidden * (len(intermediate) + 1):
        raise ConfigError([f"{where}: vision_config.vision_output_dim {output} is not "
                           f"hidden_size x (len(intermediate_layers_indices) + 1) = "
                           f"{v_hidden * (len(intermediate) + 1)}: the projector reads "
                           "the concatenated states"])
    ratios = vision.get("supported_aspect_ratios")
    if ratios is not None and not isinstance(ratios, list):
        raise ConfigError([f"{where}: vision_config.supported_aspect_ratios must be a list"])
    tiles = positive(vision, "max_num_tiles", where)
    _processor(processor, image_size, tiles, where)
    return language, MllamaVision(
        family=kind, tower="mllama_vision_model", hidden=v_hidden,
        intermediate=positive(vision, "intermediate_size", where), layers=v_layers,
        global_layers=positive(vision, "num_global_layers", where),
        heads=positive(vision, "attention_heads", where),
        channels=positive(vision, "num_channels", where), image_size=image_size, patch=patch,
        act=str(vision.get("hidden_act", "gelu")), intermediate_layers=intermediate,
        aspect_ratios=ASPECT_RATIOS if ratios is None else len(ratios), max_tiles=tiles,
        output_dim=output, text_hidden=hidden, cross_layers=cross)


def language(shape, tower: MllamaVision):
    """The language model's shape: its cross-attention layers and embedding rows."""
    return replace(shape, cross_layers=tower.cross_layers, extra_embeddings=EXTRA_EMBEDDINGS,
                   tied=False)
