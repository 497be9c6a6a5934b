"""A SigLIP vision tower (transformers models/siglip, `siglip_vision_model`), as Gemma 3
builds it: its parameters and what one image saves for the backward.

SigLIP embeds (image_size / patch_size)^2 patches with a biased convolution, adds a
learned position embedding (no CLS position, no pre-LayerNorm), runs every encoder layer
(CLIP's: LayerNorm, q/k/v/out projections with biases, unmasked attention, LayerNorm,
fc1/GELU-tanh/fc2) and the post-LayerNorm; its last hidden state is what the projector
reads, so every layer reaches the loss. A tower with the attention-pooling head
(vision_use_head) is refused: published vision-language configs leave it out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from finetune.errors import ConfigError
from finetune.estimate import walk
from finetune.estimate.defaults import config_defaults
from finetune.estimate.param import Param
from finetune.estimate.vision.common import (PIXEL_BYTES, layer_norm, layer_norm_saves, linear,
                                             positive)
from finetune.estimate.vision.llava_activations import encoder_layer_bytes

MODEL_TYPE = "siglip_vision_model"


@dataclass(frozen=True)
class Siglip:
    prefix: str                  # where the tower's modules are (model.vision_tower.)
    hidden: int
    intermediate: int
    layers: int
    heads: int
    channels: int
    image_size: int
    patch: int
    act: str
    head: bool                   # vision_use_head: the attention-pooling head is built

    @property
    def positions(self) -> int:
        return (self.image_size // self.patch) ** 2

    def parameters(self) -> list[Param]:
        h, e = self.hidden, f"{self.prefix}embeddings"
        params = [Param(f"{e}.patch_embedding.weight", h * self.channels * self.patch ** 2,
                        "conv", f"{e}.patch_embedding", h),
                  Param(f"{e}.patch_embedding.bias", h, "bias", f"{e}.patch_embedding"),
                  Param(f"{e}.position_embedding.weight", self.positions * h, "position",
                        f"{e}.position_embedding")]
        for n in range(self.layers):
            layer = f"{self.prefix}encoder.layers.{n}"
            params += layer_norm(f"{layer}.layer_norm1", h)
            for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
                params += linear(f"{layer}.self_attn.{proj}", h, h, True)
            params += layer_norm(f"{layer}.layer_norm2", h)
            params += linear(f"{layer}.mlp.fc1", h, self.intermediate, True)
            params += linear(f"{layer}.mlp.fc2", self.intermediate, h, True)
        return params + layer_norm(f"{self.prefix}post_layernorm", h)

    def image_bytes(self, reg: walk.Regime, checkpointing: bool) -> int:
        """What one image saves in a trained tower: the fp32 pixels' 16-bit cast (the
        pixels themselves are the caller's), every encoder layer (with checkpointing its
        input and one recomputed layer) and the post-LayerNorm. The stream is fp32 under
        autocast: the fp32 position embedding is added to the convolution's output."""
        reg = replace(reg, base_trainable=True)
        pixels = self.channels * self.image_size ** 2
        total = pixels * reg.compute if reg.autocast or reg.residual != PIXEL_BYTES else 0
        layer = encoder_layer_bytes(self, reg)
        if checkpointing:
            layers = self.layers * self.hidden * reg.residual + layer
        else:
            layers = self.layers * layer
        w = walk._Walk()
        layer_norm_saves(w, w.new(self.hidden, reg.residual), reg)  # post_layernorm
        return total + self.positions * (layers + w.total)


def read(vision: dict[str, Any], prefix: str, where: str,
         kinds: tuple[str, ...] = (MODEL_TYPE,),
         config_class: tuple[str, str] = ("siglip/configuration_siglip.py",
                                          "SiglipVisionConfig")) -> Siglip:
    """kinds, config_class: the tower's model types and config class (Idefics3's and
    SmolVLM's are SigLIP's layout under their own names)."""
    tower = vision.get("model_type", kinds[0])
    if tower not in kinds:
        raise ConfigError([f"{where}: a {tower!r} vision tower is not counted by the "
                           f"estimator here (it counts {', '.join(kinds)})"])
    defaults = config_defaults(*config_class)
    vision = {**{k: v for k, v in defaults.items() if v is not None}, **vision}
    shape = Siglip(prefix=prefix, hidden=positive(vision, "hidden_size", where),
                   intermediate=positive(vision, "intermediate_size", where),
                   layers=positive(vision, "num_hidden_layers", where),
                   heads=positive(vision, "num_attention_heads", where),
                   channels=positive(vision, "num_channels", where),
                   image_size=positive(vision, "image_size", where),
                   patch=positive(vision, "patch_size", where),
                   act=str(vision.get("hidden_act")), head=bool(vision.get("vision_use_head")))
    if shape.head:
        raise ConfigError([f"{where}: vision_config.vision_use_head is true: the estimator "
                           "does not count SigLIP's attention-pooling head in a tower"])
    if shape.patch > shape.image_size:
        raise ConfigError([f"{where}: vision_config.patch_size {shape.patch} is larger than "
                           f"image_size {shape.image_size}"])
    return shape
