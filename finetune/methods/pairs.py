"""What the preference methods that tokenize inside their TRL trainer share (dpo, and the
reference-free orpo, cpo and simpo): the prompt's length as those trainers count it, and
the check that every chat row renders, made while the data is prepared so that a bad row
is named by its file and row."""

from __future__ import annotations

from typing import Any

from trl.data_utils import common_prefix_length, extract_prompt

from finetune.config.effective import value
from finetune.config.schema import Experiment
from finetune.data.load import ORIGIN, Splits
from finetune.errors import DataError
from finetune.model.tokenizer import render_chat

# ORPOTrainer and CPOTrainer read training.max_length None as this.
TRL_FALLBACK_LENGTH = 512


def prompt_length(tokenizer, row: dict[str, Any]) -> int:
    """The prompt's tokens as the trainers count them (the prompt, given or extracted,
    then where its ids and those of prompt + answer part). Rendering every chat row
    here is what finds a template that fails on one, while preparing."""
    if "prompt" not in row:
        row = {**row, **extract_prompt(row)}
    prompt, where = row["prompt"], row[ORIGIN]
    if isinstance(prompt, list):
        prompt_ids = render_chat(tokenizer, prompt, f"{where}, `prompt`", generation_prompt=True)
        answers = [render_chat(tokenizer, prompt + row[k], f"{where}, `prompt + {k}`")
                   for k in ("chosen", "rejected")]
    else:
        eos = tokenizer.eos_token or ""
        prompt_ids = tokenizer(prompt)["input_ids"]
        answers = [tokenizer(prompt + row[k] + ("" if row[k].endswith(eos) else eos))["input_ids"]
                   for k in ("chosen", "rejected")]
    return min(common_prefix_length(prompt_ids, ids) for ids in answers)


def prepare_unreferenced(splits: Splits, tokenizer, experiment: Experiment,
                         trainer: str) -> Splits:
    """orpo, cpo, simpo: checked, not tokenized (the trainer does that). The trainer keeps
    a pair's whole prompt and cuts its answers to max_length; a prompt that alone fills
    it leaves no answer token, whose log-probability is then 0/0 (NaN under simpo's
    average): such a row is an error naming it, not a NaN loss later."""
    max_length = value(experiment, "max_length") or TRL_FALLBACK_LENGTH
    for split, rows in (("train", splits.train), ("eval", splits.eval)):
        for row in rows or ():
            length = prompt_length(tokenizer, row)
            if length >= max_length:
                raise DataError(f"{row[ORIGIN]}: the prompt alone has {length} tokens, "
                                f"training.max_length is {max_length}: {trainer} keeps the "
                                "whole prompt and cuts the answers, so nothing of them would "
                                "be left to train; raise training.max_length, or shorten "
                                "the prompt")
    return splits
