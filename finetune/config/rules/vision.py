"""What a vision-language model (config/vision.py) trains with so far: sft, the whole
model, rows collated padded. Known from a local model's config.json; a hub model's is
read at training (methods/sft_vision.py refuses the same settings there)."""

from __future__ import annotations

from typing import Iterator

from finetune.config import vision
from finetune.config.methods import method, names_where, spoken
from finetune.config.schema import Experiment

Problem = tuple[tuple, str]


def check(exp: Experiment) -> Iterator[Problem]:
    if not vision.is_vision_language(exp.model.name_or_path):
        return
    what = f"{exp.model.name_or_path} is a vision-language model"
    if not method(exp.method).vision:
        yield ("method",), f"{what}: only {spoken(names_where(lambda m: m.vision))} trains " \
                           "one yet (docs/vision.md)"
    if exp.peft.type != "none":
        yield ("peft", "type"), f"{what}: LoRA and QLoRA on one are not supported yet; " \
                                "train the whole model (peft.type: none)"
    for key in ("packing", "padding_free"):
        if exp.training.get(key):
            yield ("training", key), f"{what}: rows with images are collated padded, one " \
                                     "row per sequence (TRL's vision collator)"
