"""Qwen3-VL (`model_type: qwen3_vl`, transformers models/qwen3_vl) from its config.json:
the parameters by name as transformers builds them, the tokens one image becomes, and
what one image saves for the backward (qwen3_vl_activations.py).

How it runs an image: Qwen2-VL's image processor (its smart_resize, qwen2_vl.py) resizes
the picture to multiples of patch_size x spatial_merge_size pixels (32) and cuts it into
16x16 patches, doubled in time. A 3-D convolution (with a bias) embeds each patch, and a
learned grid of num_position_embeddings positions, bilinearly interpolated to the image's
grid, is added. The blocks are Qwen2-VL's (LayerNorm, fused qkv, rotary attention over
the whole image) with a GELU-tanh MLP (linear_fc1, linear_fc2). The merger (a norm per
patch, then an MLP over each 2x2 group) makes one token per group; DeepStack adds more:
after each block in deepstack_visual_indexes a merger of its own (deepstack_merger_list,
normalising the merged group rather than each patch) makes one feature per token, and
the language model adds the k-th to the image tokens' hidden states after its k-th layer.
The mergers are the projector, as Qwen2-VL's merger is; all of them sit inside the tower
(model.visual), so they freeze and train with it. The language model is a Qwen3 (q/k
norms), named model.language_model; qwen3_vl_moe's (the same tower) has mixture-of-experts
MLPs (estimate/moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.errors import ConfigError
from finetune.estimate.defaults import config_defaults, with_defaults
from finetune.estimate.param import Param
from finetune.estimate.vision import qwen3_vl_activations
from finetune.estimate.vision.common import Training, layer_norm, linear, positive, vision_config
from finetune.estimate.vision.qwen2_vl import (TOWER, QwenVision, pixel_bounds, vision_int,
                                               square_patches, tower_fields)

MERGER = f"{TOWER}merger."
DEEPSTACK = f"{TOWER}deepstack_merger_list."
CONFIG = "qwen3_vl/configuration_qwen3_vl.py"
# model_type: (its configuration module, the classes of the whole, its text, its tower)
CLASSES = {"qwen3_vl": (CONFIG, "Qwen3VLConfig", "Qwen3VLTextConfig", "Qwen3VLVisionConfig"),
           "qwen3_vl_moe": ("qwen3_vl_moe/configuration_qwen3_vl_moe.py", "Qwen3VLMoeConfig",
                            "Qwen3VLMoeTextConfig", "Qwen3VLMoeVisionConfig")}


@dataclass(frozen=True)
class Qwen3Vision(QwenVision):
    """Qwen2-VL's processor, patches and blocks (QwenVision), with Qwen3-VL's parameters,
    position embeddings and deepstack mergers."""
    position_embeddings: int = 0     # num_position_embeddings: the learned grid
    deepstack: tuple[int, ...] = ()  # deepstack_visual_indexes: blocks a merger also reads
    text_layers: int = 0             # the language model's: a deepstack feature per layer
    projector_prefix: tuple[str, ...] = (MERGER, DEEPSTACK)

    @property
    def fed(self) -> tuple[int, ...]:
        """The deepstack blocks whose features the language model reads: the first
        text_layers of them (one per layer, from the first)."""
        return self.deepstack[:self.text_layers]

    def tower_note(self) -> str:
        blocks, n = ", ".join(map(str, self.fed)), len(self.fed)
        if n == 1:
            fed = f"; block {blocks} also feeds the language model's first layer (deepstack)"
        elif n:
            fed = (f"; blocks {blocks} also feed the language model's first {n} layers "
                   "(deepstack)")
        else:
            fed = ""
        return (f"vision tower: {self.tower}, {self.layers} blocks over {self.positions} "
                f"patches an image (attention over the whole image), all kept for the "
                f"backward{fed}")

    def parameters(self) -> list[Param]:
        """The tower's and the mergers' parameters, in named_parameters() order."""
        h, conv = self.hidden, f"{TOWER}patch_embed.proj"
        params = [Param(f"{conv}.weight", h * self.patch_values, "conv", conv, h),
                  Param(f"{conv}.bias", h, "bias", conv),
                  Param(f"{TOWER}pos_embed.weight", self.position_embeddings * h, "position",
                        f"{TOWER}pos_embed")]
        for n in range(self.layers):
            block = f"{TOWER}blocks.{n}"
            params += layer_norm(f"{block}.norm1", h) + layer_norm(f"{block}.norm2", h)
            params += linear(f"{block}.attn.qkv", h, 3 * h, True)
            params += linear(f"{block}.attn.proj", h, h, True)
            params += linear(f"{block}.mlp.linear_fc1", h, self.intermediate, True)
            params += linear(f"{block}.mlp.linear_fc2", self.intermediate, h, True)
        params += self._merger(MERGER, h)
        for k in range(len(self.deepstack)):
            params += self._merger(f"{DEEPSTACK}{k}.", h * self.merge ** 2)
        return params

    def _merger(self, prefix: str, normed: int) -> list[Param]:
        """Qwen3VLVisionPatchMerger: a LayerNorm over a patch (the merger) or over a merged
        group (deepstack's), then linear_fc1, GELU, linear_fc2 over each group."""
        merged = self.hidden * self.merge ** 2
        return (layer_norm(f"{prefix}norm", normed)
                + linear(f"{prefix}linear_fc1", merged, merged, True)
                + linear(f"{prefix}linear_fc2", merged, self.out_hidden, True))

    def unreached(self) -> tuple[str, ...]:
        """Deepstack mergers past the language model's layers: their features are made
        and never added."""
        return tuple(f"{DEEPSTACK}{k}." for k in range(len(self.fed), len(self.deepstack)))

    def image_bytes(self, reg, checkpointing: bool, training: Training = Training()) -> int:
        return qwen3_vl_activations.image_bytes(self, reg, checkpointing, training)


def _deepstack(vision: dict[str, Any], layers: int, where: str) -> tuple[int, ...]:
    blocks = vision.get("deepstack_visual_indexes")
    if not isinstance(blocks, (list, tuple)) or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b < layers for b in blocks) \
            or len(set(blocks)) != len(blocks):
        raise ConfigError([f"{where}: vision_config.deepstack_visual_indexes must be distinct "
                           f"block indexes in 0..{layers - 1} (the tower's depth {layers}), "
                           f"got {str(blocks)[:40]}"])
    return tuple(blocks)


def read(config: dict[str, Any], where: str,
         processor: dict[str, Any] | None = None) -> tuple[dict[str, Any], Qwen3Vision]:
    """(the language model's config, read as a qwen3 one; the vision shape). The head is
    tied where the top level says so (Qwen3VLConfig's tie_word_embeddings, default false):
    transformers reads nothing else for it."""
    kind = config["model_type"]
    module, whole, text_class, vision_class = CLASSES[kind]
    full = with_defaults(config, module, whole)
    text = full.get("text_config") or {}
    if not isinstance(text, dict):
        raise ConfigError([f"{where}: text_config must be an object"])
    # qwen3_vl_moe's text is read as a qwen3_moe (shapes.shape_of, moe.CONFIG)
    text = {**with_defaults(text, module, text_class),
            "model_type": "qwen3" if kind == "qwen3_vl" else "qwen3_vl_moe_text",
            "tie_word_embeddings": bool(full.get("tie_word_embeddings"))}
    vision = vision_config(full, kind, where)
    defaults = {k: v for k, v in config_defaults(module, vision_class).items()
                if v is not None}
    vision = {**defaults, **vision}
    square_patches(vision, where)
    layers = vision_int(vision, "depth", "num_hidden_layers", where)
    low, high = pixel_bounds(processor, where)
    # Qwen3VLConfig renames the vision model_type "qwen3_vl" of the published configs
    # (Qwen3VLMoeConfig "qwen3_vl_moe")
    own = f"{kind}_vision"
    tower = vision.get("model_type", own)
    shape = Qwen3Vision(
        family="qwen3_vl", tower=own if tower == kind else str(tower),
        hidden=positive(vision, "hidden_size", where),
        intermediate=positive(vision, "intermediate_size", where), layers=layers,
        **tower_fields(vision, where),
        out_hidden=positive(vision, "out_hidden_size", where),
        min_pixels=low, max_pixels=high,
        position_embeddings=positive(vision, "num_position_embeddings", where),
        deepstack=_deepstack(vision, layers, where),
        text_layers=positive(text, "num_hidden_layers", where, "text_config"))
    return text, shape
