"""What a vision-language model (config/vision.py) trains with so far: sft, whole or with
(Q)LoRA, rows collated padded; and the `vision:` section, which only such a model takes.
Known from a local model's config.json; a hub model's is read at training
(methods/sft_vision.py and model/vision_parts.py refuse the same settings there)."""

from __future__ import annotations

from typing import Iterator

from finetune.config import vision
from finetune.config.methods import method, names_where, spoken
from finetune.config.schema import Experiment

Problem = tuple[tuple, str]


def check(exp: Experiment) -> Iterator[Problem]:
    yield from _section(exp)
    if not vision.is_vision_language(exp.model.name_or_path):
        return
    what = f"{exp.model.name_or_path} is a vision-language model"
    if not method(exp.method).vision:
        yield ("method",), f"{what}: only {spoken(names_where(lambda m: m.vision))} trains " \
                           "one yet (docs/vision.md)"
    for key in ("packing", "padding_free"):
        if exp.training.get(key):
            yield ("training", key), f"{what}: rows with images are collated padded, one " \
                                     "row per sequence (TRL's vision collator)"


def _section(exp: Experiment) -> Iterator[Problem]:
    spec = exp.vision
    if spec is None:
        return
    found = vision.model_type(exp.model.name_or_path)
    if found is not None and found not in vision.image_text_model_types():
        yield ("vision",), f"model.name_or_path {exp.model.name_or_path} is not a " \
                           f"vision-language model (model_type {found}): remove this section"
        return
    if spec.min_pixels is not None and spec.max_pixels is not None and \
            spec.min_pixels > spec.max_pixels:
        yield ("vision", "min_pixels"), f"{spec.min_pixels} is more than vision.max_pixels " \
                                        f"{spec.max_pixels}"
