"""Qwen3.5 (`model_type: qwen3_5`, transformers models/qwen3_5; every Qwen3.5 checkpoint is
a vision-language model) from its config.json: Qwen3-VL's tower (qwen3_vl.py: patches,
learned positions, blocks and the merger, named alike under model.visual) without
deepstack (Qwen3_5VisionModel has no deepstack_merger_list), and a hybrid language model
of Gated DeltaNet and gated attention layers (estimate/linear_attention.py), named
model.language_model. Qwen3.5-MoE (`qwen3_5_moe`) has the same tower and defaults
(Qwen3_5MoeConfig's are Qwen3_5Config's) and mixture-of-experts MLPs in its language model
(estimate/moe.py, read as `qwen3_5_moe_text`).
"""

from __future__ import annotations

from typing import Any

from finetune.errors import ConfigError
from finetune.estimate.defaults import config_defaults, with_defaults
from finetune.estimate.vision.common import positive, vision_config
from finetune.estimate.vision.qwen2_vl import (pixel_bounds, square_patches, tower_fields,
                                               vision_int)
from finetune.estimate.vision.qwen3_vl import Qwen3Vision

CONFIG = "qwen3_5/configuration_qwen3_5.py"
MODEL_TYPE = "qwen3_5_vision"


def read(config: dict[str, Any], where: str,
         processor: dict[str, Any] | None = None) -> tuple[dict[str, Any], Qwen3Vision]:
    """(the language model's config, read as a qwen3_5_text one; the vision shape). The
    head is tied where the top level says so (Qwen3_5Config's tie_word_embeddings, default
    false), as Qwen3-VL's."""
    kind = config.get("model_type", "qwen3_5")  # or qwen3_5_moe
    full = with_defaults(config, CONFIG, "Qwen3_5Config")
    text = full.get("text_config") or {}
    if not isinstance(text, dict):
        raise ConfigError([f"{where}: text_config must be an object"])
    text = {**text, "model_type": f"{kind}_text",
            "tie_word_embeddings": bool(full.get("tie_word_embeddings"))}
    # none: Qwen3_5Config builds its vision config's defaults, as it does a text config's
    vision = vision_config({"vision_config": full.get("vision_config") or {}}, "qwen3_5", where)
    defaults = {k: v for k, v in config_defaults(CONFIG, "Qwen3_5VisionConfig").items()
                if v is not None}
    vision = {**defaults, **vision}
    square_patches(vision, where)
    low, high = pixel_bounds(processor, where)
    # Qwen3_5Config renames the vision model_type "qwen3_5" of older configs
    own = f"{kind}_vision"
    tower = vision.get("model_type", own)
    shape = Qwen3Vision(
        family="qwen3_5", tower=own if tower in (kind, MODEL_TYPE) else str(tower),
        hidden=positive(vision, "hidden_size", where),
        intermediate=positive(vision, "intermediate_size", where),
        layers=vision_int(vision, "depth", "num_hidden_layers", where),
        **tower_fields(vision, where),
        out_hidden=positive(vision, "out_hidden_size", where),
        min_pixels=low, max_pixels=high,
        position_embeddings=positive(vision, "num_position_embeddings", where))
    return text, shape
