"""What a vision-language model (config/vision.py) trains with so far: sft, dpo and grpo, the
whole model, rows collated padded. Known from a local model's config.json; a hub model's
is read at training (methods/sft_vision.py and methods/dpo.py refuse the same settings
there)."""

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
        takers = names_where(lambda m: m.vision)
        verb = "trains" if len(takers) == 1 else "train"
        yield ("method",), f"{what}: only {spoken(takers)} {verb} one yet (docs/vision.md)"
    if exp.peft.type != "none":
        yield ("peft", "type"), f"{what}: LoRA and QLoRA on one are not supported yet; " \
                                "train the whole model (peft.type: none)"
    for key in ("packing", "padding_free"):
        if exp.training.get(key):
            yield ("training", key), f"{what}: rows with images are collated padded, one " \
                                     "row per sequence (TRL's vision collator)"
    yield from _collated(exp, what)


def _collated(exp: Experiment, what: str) -> Iterator[Problem]:
    """What TRL's vision collators and DPOTrainer refuse for rows with images
    (methods/sft_vision.py and methods/dpo.py say the same at training)."""
    training = exp.training
    if training.get("truncation_mode") == "keep_end":
        yield ("training", "truncation_mode"), f"{what}: keep_end would cut the image " \
                                              "tokens off the prompt; rows with images are " \
                                              "cut at the end (keep_start)"
    if training.get("precompute_ref_log_probs"):
        yield ("training", "precompute_ref_log_probs"), f"{what}: not supported (TRL " \
                                                        "renders its rows batch by batch)"
    if exp.data.weight_column is not None and method(exp.method).sequences == 2:
        yield ("data", "weight_column"), f"{what}: weighted pairs are not supported for " \
                                         "one yet"
