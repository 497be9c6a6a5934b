"""A vision-language model's vision tower and projector, from its config.json (torch-free):
their parameters (named as transformers names them) and the tokens one image becomes in
the language model's sequence (the activations one image saves: vision_activations.py).

Counted: LLaVA (`model_type: llava`: a CLIP vision tower, a two-layer projector, a
llama/mistral/qwen2/qwen3 language model), the layout of llava-hf's LLaVA-1.5. Other
vision-language types are refused by name rather than guessed (shapes.shape_of).

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

# Vision-language model types the estimator counts, and the vision towers it knows in them.
COUNTED = {"llava": ("clip_vision_model",)}
# The config class transformers fills a text_config's missing keys from, per model type.
TEXT_CONFIG_CLASSES = {
    "llama": ("llama/configuration_llama.py", "LlamaConfig"),
    "mistral": ("mistral/configuration_mistral.py", "MistralConfig"),
    "qwen2": ("qwen2/configuration_qwen2.py", "Qwen2Config"),
    "qwen3": ("qwen3/configuration_qwen3.py", "Qwen3Config"),
}
TOWER = "model.vision_tower."
PROJECTOR = "model.multi_modal_projector."
LANGUAGE_MODEL = "model.language_model."
PIXEL_BYTES = 4  # the processor's pixel_values are fp32


@dataclass(frozen=True)
class VisionShape:
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


def _int(config: dict[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= 2**24:
        raise ConfigError([f"{where}: vision_config.{key} must be an integer in 1..{2**24:,} "
                           f"(the estimator reads square images of one size), got "
                           f"{str(value)[:40]}"])
    return value


def split_config(config: dict[str, Any], where: str) -> tuple[dict[str, Any], VisionShape]:
    """(the language model's config, as transformers completes it; the vision shape)."""
    kind = config["model_type"]
    full = with_defaults(config, "llava/configuration_llava.py", "LlavaConfig")
    text = full.get("text_config") or {}
    if not isinstance(text, dict):
        raise ConfigError([f"{where}: text_config must be an object"])
    text_type = text.get("model_type", "llama")  # LlavaConfig's default text model
    if text_type not in TEXT_CONFIG_CLASSES:
        raise ConfigError([f"{where}: a {kind} model with a {text_type!r} language model is "
                           f"not counted by the estimator (it counts "
                           f"{', '.join(TEXT_CONFIG_CLASSES)})"])
    text = with_defaults({**text, "model_type": text_type}, *TEXT_CONFIG_CLASSES[text_type])
    # LlavaConfig ties the LM head when either it or its text_config says so.
    text["tie_word_embeddings"] = bool(full.get("tie_word_embeddings")
                                       or text.get("tie_word_embeddings"))
    vision = full.get("vision_config")
    if not isinstance(vision, dict):
        raise ConfigError([f"{where}: {kind} config without a vision_config object: the "
                           "estimator reads the vision tower's shape from it"])
    tower = vision.get("model_type", "clip_vision_model")
    if tower not in COUNTED[kind]:
        raise ConfigError([f"{where}: a {kind} model with a {tower!r} vision tower is not "
                           f"counted by the estimator (it counts {', '.join(COUNTED[kind])})"])
    vision = with_defaults(vision, "clip/configuration_clip.py", "CLIPVisionConfig")
    layers = full.get("vision_feature_layer", -2)
    layers = (layers,) if isinstance(layers, int) else tuple(layers)
    if not layers or not all(isinstance(n, int) for n in layers):
        raise ConfigError([f"{where}: vision_feature_layer must be an integer or a list of them"])
    select = full.get("vision_feature_select_strategy", "default")
    if select not in ("default", "full"):
        raise ConfigError([f"{where}: vision_feature_select_strategy {select!r} is not "
                           "'default' or 'full'"])
    shape = VisionShape(
        family=kind, tower=tower, hidden=_int(vision, "hidden_size", where),
        intermediate=_int(vision, "intermediate_size", where),
        layers=_int(vision, "num_hidden_layers", where),
        heads=_int(vision, "num_attention_heads", where),
        channels=_int(vision, "num_channels", where),
        image_size=_int(vision, "image_size", where), patch=_int(vision, "patch_size", where),
        act=str(vision.get("hidden_act", "quick_gelu")), feature_layers=layers, select=select,
        projector_act=str(full.get("projector_hidden_act", "gelu")),
        projector_bias=bool(full.get("multimodal_projector_bias", True)),
        text_hidden=_int(text, "hidden_size", where))
    if shape.patch > shape.image_size:
        raise ConfigError([f"{where}: vision_config.patch_size {shape.patch} is larger than "
                           f"image_size {shape.image_size}"])
    return text, shape


def _linear(name: str, inp: int, out: int, bias: bool) -> list[Param]:
    params = [Param(f"{name}.weight", inp * out, "linear", name, out)]
    return params + ([Param(f"{name}.bias", out, "bias", name)] if bias else [])


def _layer_norm(name: str, size: int) -> list[Param]:
    return [Param(f"{name}.weight", size, "norm", name), Param(f"{name}.bias", size, "norm", name)]


def vision_parameters(v: VisionShape) -> list[Param]:
    """The vision tower's and the projector's parameters, in named_parameters() order."""
    h, e = v.hidden, f"{TOWER}embeddings"
    params = [Param(f"{e}.class_embedding", h, "position", e),
              Param(f"{e}.patch_embedding.weight", h * v.channels * v.patch ** 2, "conv",
                    f"{e}.patch_embedding", h),
              Param(f"{e}.position_embedding.weight", v.positions * h, "position",
                    f"{e}.position_embedding")]
    params += _layer_norm(f"{TOWER}pre_layrnorm", h)  # sic: transformers' name
    for n in range(v.layers):
        layer = f"{TOWER}encoder.layers.{n}"
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            params += _linear(f"{layer}.self_attn.{proj}", h, h, True)
        params += _layer_norm(f"{layer}.layer_norm1", h)
        params += _linear(f"{layer}.mlp.fc1", h, v.intermediate, True)
        params += _linear(f"{layer}.mlp.fc2", v.intermediate, h, True)
        params += _layer_norm(f"{layer}.layer_norm2", h)
    params += _layer_norm(f"{TOWER}post_layernorm", h)
    features = h * len(v.feature_layers)  # the selected layers' states, concatenated
    params += _linear(f"{PROJECTOR}linear_1", features, v.text_hidden, v.projector_bias)
    params += _linear(f"{PROJECTOR}linear_2", v.text_hidden, v.text_hidden, v.projector_bias)
    return params


def unreached(v: VisionShape) -> tuple[str, ...]:
    """Modules the loss never reaches: the post-LayerNorm (LLaVA reads hidden states, not
    the pooled output) and the encoder layers past the deepest feature layer. They train
    in name only: no .grad, so torch's optimizers keep no state for them."""
    layers = tuple(f"{TOWER}encoder.layers.{n}." for n in range(v.layers_kept, v.layers))
    return (f"{TOWER}post_layernorm.",) + layers
