"""A vision-language model's vision tower and projector, from its config.json (torch-free),
one module per family: LLaVA (llava.py), LLaVA-NeXT (llava_next.py), Qwen2-VL and
Qwen2.5-VL (qwen2_vl.py), Qwen3-VL (qwen3_vl.py, on Qwen2-VL's shape; qwen3_vl_moe's
mixture-of-experts language model in estimate/moe.py), Qwen3.5 (qwen3_5.py:
Qwen3-VL's tower; its hybrid language model in estimate/linear_attention.py; qwen3_5_moe's
with mixture-of-experts MLPs), Gemma 3 (gemma3.py),
PaliGemma (paligemma.py), Idefics3 and SmolVLM (idefics3.py), their SigLIP-layout towers
in siglip.py, Mistral 3 (mistral3.py, its Pixtral tower's activations in
pixtral_activations.py), InternVL (internvl.py) and Llama 3.2 Vision (mllama.py; its
language model's cross-attention layers in estimate/cross_attention.py).

Each family's read(config, where, processor) returns the language model's config (read
by shapes.shape_of as a text model's) and a vision shape that answers, for the rest of
the estimate: its parameters() by name as transformers builds them, image_tokens (one
image's tokens in the language model's sequence), unreached() (module prefixes the loss
never reaches), image_bytes(regime, checkpointing, training) (what one image saves for
the backward, with a frozen tower or projector as `training` says), for_image(size) (the
shape for pictures of that size, where the tokens depend on it), tower_prefix and
projector_prefix, and image_note()/tower_note() (what the report says it assumed).
Other vision-language types are refused by name rather than guessed (shapes.shape_of).
"""

from __future__ import annotations

from typing import Any

from finetune.estimate.vision import (gemma3, idefics3, internvl, llava, llava_next, mistral3,
                                      mllama, paligemma, qwen2_vl, qwen3_5, qwen3_vl)
from finetune.estimate.vision.common import Training


FAMILIES = {"llava": llava, "qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_vl, "qwen3_vl": qwen3_vl,
            "qwen3_vl_moe": qwen3_vl, "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5,
            "gemma3": gemma3,
            "paligemma": paligemma, "llava_next": llava_next, "idefics3": idefics3,
            "smolvlm": idefics3, "mistral3": mistral3, "internvl": internvl, "mllama": mllama}
COUNTED = tuple(FAMILIES)
LANGUAGE_MODEL = "model.language_model."
# Every family's tower and projector: a VLM's tp_plan is its language model's (Qwen's
# mergers are inside its tower, model.visual).
VISION_PREFIXES = (llava.TOWER, llava.PROJECTOR, qwen2_vl.TOWER, gemma3.TOWER, gemma3.PROJECTOR,
                   paligemma.TOWER, paligemma.PROJECTOR, llava_next.NEWLINE, idefics3.TOWER,
                   idefics3.PROJECTOR, mllama.TOWER, mllama.PROJECTOR)


def read(config: dict[str, Any], where: str, processor: dict[str, Any] | None = None):
    """(the language model's config; the vision shape) of a counted model type."""
    return FAMILIES[config["model_type"]].read(config, where, processor)


def language(model_type: str, shape, tower):
    """The language model's shape as the family changes it (mllama: cross-attention
    layers, extra embedding rows)."""
    change = getattr(FAMILIES[model_type], "language", None)
    return change(shape, tower) if change else shape


def text_prefix(model_type: str) -> str:
    """Where the family's language model's modules are."""
    return getattr(FAMILIES[model_type], "TEXT_PREFIX", LANGUAGE_MODEL)


def part_of(name: str, vision) -> str:
    """language_model, vision_tower or projector: where a parameter belongs."""
    if name.startswith(vision.projector_prefix):
        return "projector"
    if name.startswith(vision.tower_prefix):
        return "vision_tower"
    return "language_model"


__all__ = ["COUNTED", "LANGUAGE_MODEL", "Training", "VISION_PREFIXES", "language",
           "part_of", "read", "text_prefix"]
