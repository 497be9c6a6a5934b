"""LLaVA (`model_type: llava`: a CLIP vision tower, a two-layer projector, a
llama/mistral/qwen2/qwen3 language model; llava-hf's LLaVA-1.5 layout) from its
config.json: the parameters by name as transformers builds them, the tokens one image
becomes, and what one image saves for the backward (llava_activations.py).

How LLaVA runs an image (transformers models/llava, models/clip): the CLIP tower embeds
(image_size / patch_size)^2 patches plus a CLS position, runs every encoder layer, and
the hidden states of `vision_feature_layer` (-2 by default: the last layer's output is
not used) go, without the CLS position under `vision_feature_select_strategy: default`,
through linear_1, the activation and linear_2 into the image's placeholder tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.errors import ConfigError
from finetune.estimate.defaults import with_defaults
from finetune.estimate.param import Param
from finetune.estimate.vision import llava_activations
from finetune.estimate.vision.common import (Training, layer_norm, linear, positive,
                                             text_config, vision_config)

TOWERS = ("clip_vision_model",)
TOWER = "model.vision_tower."
PROJECTOR = "model.multi_modal_projector."


@dataclass(frozen=True)
class LlavaVision:
    family: str                  # llava
    tower: str                   # clip_vision_model
    hidden: int
    intermediate: int
    layers: int
    heads: int
    channels: int
    image_size: int
    patch: int
    act: str                     # the tower's MLP activation (quick_gelu, gelu)
    feature_layers: tuple[int, ...]  # vision_feature_layer(s), as in the config
    select: str                  # vision_feature_select_strategy: default (drops CLS) or full
    projector_act: str
    projector_bias: bool
    text_hidden: int
    tower_prefix: str = TOWER
    projector_prefix: str = PROJECTOR

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def positions(self) -> int:
        """Positions the tower runs on per image: the patches and the CLS position."""
        return self.patches + 1

    @property
    def image_tokens(self) -> int:
        """Tokens one image becomes in the language model's sequence."""
        return self.patches if self.select == "default" else self.positions

    @property
    def layers_kept(self) -> int:
        """Encoder layers whose output reaches the loss: hidden_states[0] is the
        embeddings, [n] layer n's output; a layer past the deepest one read is run, but
        its graph is freed when the forward returns."""
        deepest = max(f if f >= 0 else self.layers + 1 + f for f in self.feature_layers)
        return max(deepest, 0)

    def for_image(self, size: tuple[int, int] | None) -> "LlavaVision":
        """The processor resizes every image to image_size: one cost for any picture."""
        return self

    def image_note(self) -> str:
        return (f"each resized to {self.image_size}x{self.image_size} by the processor: "
                f"{self.image_tokens} tokens an image ({self.patches} patches"
                f"{'' if self.select == 'default' else ' + CLS'})")

    def tower_note(self) -> str:
        return (f"vision tower: {self.tower}, {self.layers} layers over {self.positions} "
                f"positions an image ({self.patches} patches + CLS), {self.layers_kept} of "
                f"them kept for the backward (vision_feature_layer "
                f"{', '.join(map(str, self.feature_layers))})")

    def parameters(self) -> list[Param]:
        """The vision tower's and the projector's parameters, in named_parameters() order."""
        h, e = self.hidden, f"{TOWER}embeddings"
        params = [Param(f"{e}.class_embedding", h, "position", e),
                  Param(f"{e}.patch_embedding.weight", h * self.channels * self.patch ** 2,
                        "conv", f"{e}.patch_embedding", h),
                  Param(f"{e}.position_embedding.weight", self.positions * h, "position",
                        f"{e}.position_embedding")]
        params += layer_norm(f"{TOWER}pre_layrnorm", h)  # sic: transformers' name
        for n in range(self.layers):
            layer = f"{TOWER}encoder.layers.{n}"
            for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
                params += linear(f"{layer}.self_attn.{proj}", h, h, True)
            params += layer_norm(f"{layer}.layer_norm1", h)
            params += linear(f"{layer}.mlp.fc1", h, self.intermediate, True)
            params += linear(f"{layer}.mlp.fc2", self.intermediate, h, True)
            params += layer_norm(f"{layer}.layer_norm2", h)
        params += layer_norm(f"{TOWER}post_layernorm", h)
        features = h * len(self.feature_layers)  # the selected layers' states, concatenated
        params += linear(f"{PROJECTOR}linear_1", features, self.text_hidden, self.projector_bias)
        params += linear(f"{PROJECTOR}linear_2", self.text_hidden, self.text_hidden,
                         self.projector_bias)
        return params

    def unreached(self) -> tuple[str, ...]:
        """Modules the loss never reaches: the post-LayerNorm (LLaVA reads hidden states,
        not the pooled output) and the encoder layers past the deepest feature layer. They
        train in name only: no .grad, so torch's optimizers keep no state for them."""
        layers = tuple(f"{TOWER}encoder.layers.{n}." for n in range(self.layers_kept, self.layers))
        return (f"{TOWER}post_layernorm.",) + layers

    def image_bytes(self, reg, checkpointing: bool, training: Training = Training()) -> int:
        return llava_activations.image_bytes(self, reg, checkpointing, training)


def read(config: dict[str, Any], where: str,
         processor: dict[str, Any] | None = None,
         config_class: tuple[str, str] = ("llava/configuration_llava.py", "LlavaConfig"),
         ) -> tuple[dict[str, Any], LlavaVision]:
    """(the language model's config, as transformers completes it; the vision shape).
    config_class: the top-level config's (LLaVA-NeXT reads its own through here)."""
    kind = config["model_type"]
    full = with_defaults(config, *config_class)
    text = text_config(full, kind, where, "llama")  # LlavaConfig's default text model
    vision = vision_config(full, kind, where, TOWERS)
    tower = vision.get("model_type", TOWERS[0])
    vision = with_defaults(vision, "clip/configuration_clip.py", "CLIPVisionConfig")
    layers = full.get("vision_feature_layer", -2)
    layers = (layers,) if isinstance(layers, int) else tuple(layers)
    if not layers or not all(isinstance(n, int) for n in layers):
        raise ConfigError([f"{where}: vision_feature_layer must be an integer or a list of them"])
    select = full.get("vision_feature_select_strategy", "default")
    if select not in ("default", "full"):
        raise ConfigError([f"{where}: vision_feature_select_strategy {select!r} is not "
                           "'default' or 'full'"])
    shape = LlavaVision(
        family=kind, tower=tower, hidden=positive(vision, "hidden_size", where),
        intermediate=positive(vision, "intermediate_size", where),
        layers=positive(vision, "num_hidden_layers", where),
        heads=positive(vision, "num_attention_heads", where),
        channels=positive(vision, "num_channels", where),
        image_size=positive(vision, "image_size", where),
        patch=positive(vision, "patch_size", where),
        act=str(vision.get("hidden_act", "quick_gelu")), feature_layers=layers, select=select,
        projector_act=str(full.get("projector_hidden_act", "gelu")),
        projector_bias=bool(full.get("multimodal_projector_bias", True)),
        text_hidden=positive(text, "hidden_size", where, "text_config"))
    if shape.patch > shape.image_size:
        raise ConfigError([f"{where}: vision_config.patch_size {shape.patch} is larger than "
                           f"image_size {shape.image_size}"])
    return text, shape
