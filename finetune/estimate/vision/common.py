"""What every vision-language family shares: reading sizes from a config, completing the
language model's config as transformers does, the parameters of common modules, and the
tensors common ops save for the backward (walked as activations.py walks a decoder layer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.errors import ConfigError
from finetune.estimate import walk
from finetune.estimate.defaults import with_defaults
from finetune.estimate.param import Param

# The config class transformers fills a text_config's missing keys from, per model type.
TEXT_CONFIG_CLASSES = {
    "llama": ("llama/configuration_llama.py", "LlamaConfig"),
    "mistral": ("mistral/configuration_mistral.py", "MistralConfig"),
    "qwen2": ("qwen2/configuration_qwen2.py", "Qwen2Config"),
    "qwen3": ("qwen3/configuration_qwen3.py", "Qwen3Config"),
    "gemma": ("gemma/configuration_gemma.py", "GemmaConfig"),
    "gemma2": ("gemma2/configuration_gemma2.py", "Gemma2Config"),
    "gemma3_text": ("gemma3/configuration_gemma3.py", "Gemma3TextConfig"),
}
PIXEL_BYTES = 4  # the processors' pixel_values are fp32
# A picture of this many pixels (width, height) where the tokens depend on its size and the
# caller does not say (estimate's image_size, --image-size): COCO's usual photo.
DEFAULT_IMAGE = (640, 480)


@dataclass(frozen=True)
class Training:
    """Which parts of the vision side train. A frozen part holds its weights without
    gradients or optimizer states, and saves nothing for the backward unless a trained
    part before it needs its input gradient (the tower comes first, so a frozen tower
    saves nothing at all)."""
    tower: bool = True
    projector: bool = True


def positive(config: dict[str, Any], key: str, where: str, what: str = "vision_config") -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= 2**24:
        raise ConfigError([f"{where}: {what}.{key} must be an integer in 1..{2**24:,}, "
                           f"got {str(value)[:40]}"])
    return value


def text_config(full: dict[str, Any], kind: str, where: str, default_type: str) -> dict[str, Any]:
    """The language model's config as transformers completes it: its class's defaults
    under what the config names; tied when the top level or the text config says so."""
    text = full.get("text_config") or {}
    if not isinstance(text, dict):
        raise ConfigError([f"{where}: text_config must be an object"])
    text_type = text.get("model_type", default_type)
    if text_type not in TEXT_CONFIG_CLASSES:
        raise ConfigError([f"{where}: a {kind} model with a {text_type!r} language model is "
                           f"not counted by the estimator (it counts "
                           f"{', '.join(TEXT_CONFIG_CLASSES)})"])
    text = with_defaults({**text, "model_type": text_type}, *TEXT_CONFIG_CLASSES[text_type])
    text["tie_word_embeddings"] = bool(full.get("tie_word_embeddings")
                                       or text.get("tie_word_embeddings"))
    return text


def vision_config(full: dict[str, Any], kind: str, where: str,
                  towers: tuple[str, ...] = ()) -> dict[str, Any]:
    """The vision tower's config; its model_type (the first of towers where it names
    none) one of towers, where given."""
    vision = full.get("vision_config")
    if not isinstance(vision, dict):
        raise ConfigError([f"{where}: {kind} config without a vision_config object: the "
                           "estimator reads the vision tower's shape from it"])
    tower = vision.get("model_type", towers[0]) if towers else None
    if towers and tower not in towers:
        raise ConfigError([f"{where}: a {kind} model with a {tower!r} vision tower is not "
                           f"counted by the estimator (it counts {', '.join(towers)})"])
    return vision


def linear(name: str, inp: int, out: int, bias: bool) -> list[Param]:
    params = [Param(f"{name}.weight", inp * out, "linear", name, out)]
    return params + ([Param(f"{name}.bias", out, "bias", name)] if bias else [])


def layer_norm(name: str, size: int) -> list[Param]:
    return [Param(f"{name}.weight", size, "norm", name), Param(f"{name}.bias", size, "norm", name)]


def rms_norm(name: str, size: int) -> list[Param]:
    return [Param(f"{name}.weight", size, "norm", name)]


# What ops save, per position (see activations.py for the walk and its dtype rules).

def layer_norm_saves(w: walk._Walk, x: walk._T, reg: walk.Regime) -> walk._T:
    """LayerNorm saves its input and a mean and rstd per row. CUDA's autocast runs it in
    fp32 (a 16-bit input is cast, the output is fp32); the CPU's runs it in the input's
    dtype, as does a run without autocast."""
    fp32 = reg.autocast and reg.cuda
    xf = w.cast(x, 4) if fp32 else x
    w.save(xf, w.new(2, 4))
    return w.new(x.elems, 4 if fp32 else x.nbytes)


def activation_saves(w: walk._Walk, x: walk._T, name: str) -> walk._T:
    """quick_gelu is x * sigmoid(1.702 x): the product saves x and the sigmoid (which the
    sigmoid's own backward reads too); gelu and its tanh form save their input."""
    w.save(x)
    if name == "quick_gelu":
        w.save(w.new(x.elems, x.nbytes))
    return w.new(x.elems, x.nbytes)


def stream_bytes(reg: walk.Regime) -> int:
    """Bytes of a tower's hidden states when they leave a 16-bit matmul (a patch
    convolution under autocast) rather than an fp32 embedding: the compute dtype under
    autocast, else the weights' own."""
    return reg.compute if reg.autocast else reg.residual
