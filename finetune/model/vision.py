"""Vision-language models (image-text-to-text: LLaVA, Qwen2-VL, Gemma 3, ...): telling
one from its config (the model class that builds it), and telling a processor (image
processor + tokenizer + chat template, model/tokenizer.py load_processor) from a
tokenizer. A VLM run holds its processor wherever a text run holds the tokenizer: TRL's
SFTTrainer takes it as processing_class and collates rows with images through it."""

from __future__ import annotations

import functools

from transformers import AutoConfig, AutoModelForImageTextToText, ProcessorMixin
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from finetune.config import vision
from finetune.config.schema import Experiment

MODEL_CLASS = AutoModelForImageTextToText


@functools.cache
def _is_vision_language(name_or_path: str, revision: str | None, trusted: bool) -> bool:
    local = vision.model_type(name_or_path)
    if local is not None:
        return local in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    try:  # a hub id: its config (cached by the hub client; loading the model reads it too)
        config = AutoConfig.from_pretrained(name_or_path, revision=revision,
                                            trust_remote_code=trusted)
    except (OSError, ValueError):
        return False  # loading the model reports why
    return config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def is_vision_language(experiment: Experiment) -> bool:
    spec = experiment.model
    return _is_vision_language(spec.name_or_path, spec.revision, spec.trust_remote_code)


def is_processor(processing_class) -> bool:
    return isinstance(processing_class, ProcessorMixin)


def text_tokenizer(processing_class):
    """The tokenizer of a processor, or the tokenizer itself."""
    return processing_class.tokenizer if is_processor(processing_class) else processing_class
