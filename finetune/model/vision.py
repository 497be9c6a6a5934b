"""Vision-language models (image-text-to-text: LLaVA, Qwen2-VL, Gemma 3, ...): telling
one from its config (the model class that builds it), and telling a processor (image
processor + tokenizer + chat template, model/tokenizer.py load_processor) from a
tokenizer. A VLM run holds its processor wherever a text run holds the tokenizer: TRL's
SFTTrainer takes it as processing_class and collates rows with images through it."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Callable

from transformers import AutoConfig, AutoModelForImageTextToText, ProcessorMixin
from transformers.models.auto.modeling_auto import (MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

from finetune.config import vision
from finetune.config.rules.vision import PREFIX_LM
from finetune.config.schema import Experiment
from finetune.errors import DataError, one_line

MODEL_CLASS = AutoModelForImageTextToText


@functools.cache
def is_vision_source(name_or_path: str, revision: str | None, trusted: bool) -> bool:
    """A local directory or hub id (at a revision) of a vision-language model."""
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
    return is_vision_source(spec.name_or_path, spec.revision, spec.trust_remote_code)


def is_processor(processing_class) -> bool:
    return isinstance(processing_class, ProcessorMixin)


def text_tokenizer(processing_class):
    """The tokenizer of a processor, or the tokenizer itself."""
    return processing_class.tokenizer if is_processor(processing_class) else processing_class


def image_token_ids(processor) -> list[int]:
    """The tokens a processor puts in the text for pictures: its image token and the
    markers around it, those transformers' image_token_ids names (Pixtral's row breaks
    and end, InternVL's <img>/</img>) and those it leaves out (_markers)."""
    tokenizer = text_tokenizer(processor)
    named = [tokenizer.convert_tokens_to_ids(token) for token in _markers(processor)]
    return list(dict.fromkeys(i for i in [*processor.image_token_ids, *named]
                              if i is not None and i != tokenizer.unk_token_id))


def _markers(processor) -> list[str]:
    """The marker tokens a processor puts around its image tokens that its image_token_ids
    (transformers 5.23) leaves out, read from its tokenizer as the processor reads them:
    Qwen2-VL's and Qwen2.5-VL's <|vision_start|>/<|vision_end|>, Gemma 3's start and end
    of image, Idefics3's and SmolVLM's <fake_token_around_image>, <global-img> and tile
    tags <row_r_col_c> (up to 6 x 6, as the processor counts them). The newlines some put
    between tiles and around a picture are text tokens, and train."""
    tokenizer = text_tokenizer(processor)
    kind = type(processor).__name__
    if kind in ("Qwen2VLProcessor", "Qwen2_5_VLProcessor"):
        return [getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>",
                getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>"]
    if kind == "Gemma3Processor":
        return [tokenizer.boi_token, tokenizer.eoi_token]
    if kind in ("Idefics3Processor", "SmolVLMProcessor"):
        return [processor.fake_image_token,
                getattr(processor, "global_image_token", None) or processor.global_image_tag,
                *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
    return []


def is_vision_model(model) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def runs_flash_attention(config) -> bool:
    """Whether transformers runs this model with flash attention: not Llama 3.2 Vision
    (mllama), whose cross-attention layers take 4D masks (its class says so,
    _supports_flash_attn); attn_implementation auto then takes sdpa. True for a model that
    is not a vision-language one (its own check is transformers' at load)."""
    if config.model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return True
    return getattr(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)], "_supports_flash_attn",
                   True)


def load_saved_weights(model, directory) -> None:
    """Weights a VLM's save_pretrained wrote (final/, a checkpoint) into `model`, in place.
    transformers saves these models under their checkpoints' key names (LLaVA's
    `language_model.model.*`, not the module's `model.language_model.*`) and maps them
    back only in from_pretrained: so they are loaded through it, then copied. A
    ValueError when they do not fit the model, as load_full_weights raises."""
    if not any((Path(directory) / name).is_file() for name in
               ("model.safetensors", "model.safetensors.index.json")):
        raise FileNotFoundError(f"{directory}: no model.safetensors")
    dtype = next(model.parameters()).dtype
    saved, info = type(model).from_pretrained(str(directory), dtype=dtype, device_map="cpu",
                                              output_loading_info=True)
    missing, unexpected = info.get("missing_keys") or [], info.get("unexpected_keys") or []
    mismatched = info.get("mismatched_keys") or []
    if missing or unexpected or mismatched:
        raise ValueError(f"{directory}: weights do not match the model (missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
                         + (f", of other shapes {sorted(mismatched)[:5]}" if mismatched else "")
                         + ")")
    model.load_state_dict(saved.state_dict())



def with_images(messages: list[dict], images: list) -> list[dict]:
    """The conversation with its images in its image parts (or, for text turns, before the
    first user turn's text), as TRL's collator renders it; on a copy: TRL's
    prepare_multimodal_messages fills the parts it is given in place."""
    from trl.data_utils import prepare_multimodal_messages

    return prepare_multimodal_messages(copy.deepcopy(messages), images=images or [])


def chat_prompts(processor, conversations: list[list[dict]], images: list[list],
                 fit: Callable[[list], list] = list):
    """Conversations (each with its images: paths or pictures) as one left-padded batch
    with a generation prompt, through the processor as in training. fit: a conversation's
    images as the processor is to see them (vision.max_pixels: data/image_size.fitter)."""
    return processor.apply_chat_template(
        [with_images(m, fit(i)) for m, i in zip(conversations, images)],
        add_generation_prompt=True,
        tokenize=True, return_dict=True, return_tensors="pt",
        processor_kwargs={"padding": True, "padding_side": "left", "add_special_tokens": False})


# The processors of config/rules/vision.PREFIX_LM's models: PaliGemma's puts its image
# tokens and BOS before a plain text and a newline after it (the prefix), and its model
# reads token_type_ids 0 as the prefix (attended both ways) and 1 as the suffix (causal).
PREFIX_LM_PROCESSORS = {PROCESSOR_MAPPING_NAMES[model_type] for model_type in PREFIX_LM}


def prefix_lm(processor) -> bool:
    return type(processor).__name__ in PREFIX_LM_PROCESSORS


def plain_text(processor, text: str) -> str:
    """A plain prompt as the processor is to read it: led by BOS where the tokenizer puts
    one before a text (a text model's plain prompt is tokenized so), unless the processor
    places it (PaliGemma) or the text has it."""
    tokenizer = processor.tokenizer
    bos = tokenizer.bos_token
    if prefix_lm(processor) or bos is None or text.startswith(bos):
        return text
    ids = tokenizer("x")["input_ids"]
    return bos + text if ids and ids[0] == tokenizer.bos_token_id else text


def plain_prompts(processor, texts: list[str], images: list[list],
                  fit: Callable[[list], list] = list):
    """Plain-text prompts with their pictures as one left-padded batch, as training
    (methods/sft_plain_vision.py) and generation encode them: the text as written, its
    image placeholders where the processor expects them (PaliGemma's processor puts its
    own), led by BOS (plain_text). fit: vision.max_pixels, as for conversations."""
    from transformers.image_utils import load_image

    pictures = [[load_image(p) if isinstance(p, str) else p for p in fit(i or [])]
                for i in images]
    if prefix_lm(processor):  # its placeholders first, as its processor would put them
        texts = [t if processor.image_token in t else processor.image_token * len(p) + t
                 for t, p in zip(texts, pictures)]
    encoded = processor(images=pictures if any(pictures) else None,
                        text=[plain_text(processor, t) for t in texts], padding=True,
                        padding_side="left", add_special_tokens=False, return_tensors="pt")
    encoded.pop("labels", None)  # PaliGemma's guess at labels: the collator makes them
    return encoded


def encoded_prompt(processor, prompt: str, images: list, where: str, fit=list):
    """One plain prompt as plain_prompts encodes it (a row while the data are prepared, a
    prompt to generate from); the processor's refusal (a count of placeholders that does
    not match the pictures, a processor that needs pictures) as one line naming `where`."""
    try:
        return plain_prompts(processor, [prompt], [images or []], fit)
    except ValueError as exc:
        token = getattr(processor, "image_token", None)
        hint = f" (`{token}` for this model)" if token and not prefix_lm(processor) else ""
        raise DataError(f"{where}: the processor cannot take this plain prompt with its "
                        f"{len(images or [])} picture(s) ({one_line(str(exc))}); a plain "
                        f"prompt holds one image placeholder per picture{hint}, where the "
                        "picture goes") from None


def as_parts(messages: list[dict], pictures: int) -> list[dict]:
    """The conversation with every text content as one text part and, as TRL's
    prepare_multimodal_messages places them, `pictures` image parts before the text of the
    first user turn given as text; parts given stay. What GRPOTrainer hands its processor
    for a vision-language model (the trainer fills the image parts with the pictures)."""
    out, placed = [], False
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if message["role"] == "user" and not placed:
                parts, placed = [{"type": "image"} for _ in range(pictures)] + parts, True
            message = {**message, "content": parts}
        out.append(message)
    return out
