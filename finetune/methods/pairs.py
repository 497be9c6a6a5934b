"""What the preference methods that tokenize inside their TRL trainer share (dpo, kto, and
the reference-free orpo, cpo and simpo): the prompt's length as those trainers count it,
the check that every chat row renders, made while the data is prepared so that a bad row
is named by its file and row, the check that some row is left once the trainer drops
those whose prompt fills max_length, dpo's and kto's frozen reference model, and their
rows and collator for a vision-language model (vision_rows, pictures_fitted)."""

from __future__ import annotations

import copy
from typing import Any, Callable

from transformers import AutoModelForCausalLM
from trl.data_utils import common_prefix_length, extract_prompt

from finetune.config.derived.effective import record, setting, value
from finetune.config.schema import Experiment
from finetune.data.image_size import ImagesSized, fitter
from finetune.data.images import IMAGES
from finetune.data.load import ORIGIN, Splits
from finetune.data.parallel import processes
from finetune.errors import ConfigError, DataError
from finetune.methods import Job
from finetune.model import vision
from finetune.model.load import name_only_layers_it_has
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


def require_a_row_that_fits(splits: Splits, max_length: int | None,
                            length: Callable[[dict[str, Any]], int], trainer: str,
                            answers: str) -> None:
    """The trainer drops a row whose prompt alone fills max_length: some row must be left
    in each split, else an error naming the shortest prompt."""
    for split, rows in (("train", splits.train), ("eval", splits.eval)):
        lengths = [(length(row), row[ORIGIN]) for row in rows or ()]
        shortest, where = min(lengths, default=(0, ""))
        if max_length is not None and shortest >= max_length:
            raise DataError(f"data.{split}: no row fits training.max_length {max_length}: "
                            f"{trainer} drops a row whose prompt alone is that long (nothing "
                            f"of its {answers} would be left), and the shortest prompt, "
                            f"{where}, has {shortest} tokens; raise training.max_length, or "
                            "shorten the prompts")


def frozen_reference(job: Job):
    """The reference model of the method's record (dpo, kto): the model its setting names,
    else none under (Q)LoRA (the trainer disables the adapters), else a frozen copy of
    the starting policy."""
    spec = job.experiment
    named = setting(spec, record(spec).reference.setting)
    if named:  # of the policy's kind: a vision-language model's reference is one too
        loader = vision.MODEL_CLASS if vision.is_vision_model(job.model) else AutoModelForCausalLM
        ref = loader.from_pretrained(
            named, dtype=job.hardware.model_dtype(spec, "reference"),
            trust_remote_code=spec.model.trust_remote_code)
        name_only_layers_it_has(ref)  # as the policy's: FSDP wraps it too
    elif spec.peft.type != "none":
        return None
    else:
        ref = copy.deepcopy(job.model)
    ref.requires_grad_(False)
    return ref.eval()


def vision_rows(splits: Splits, processor, experiment: Experiment, problems: list[str],
                kept: Callable, columns: tuple[str, ...],
                shaped: Callable = lambda rows: rows) -> Splits:
    """dpo's and kto's rows for a vision-language model, untokenized (TRL's vision
    collators render them batch by batch): `problems` (what TRL refuses for them) raised;
    each split `shaped`, `images` empty for a file without pictures (TRL's vision path
    renders those rows without), less the rows `kept` drops and counts (methods/
    vision_lengths.py: a prompt max_length would cut inside its image tokens), with the
    `columns` the collator reads and ORIGIN (which data/prepare.py removes)."""
    if problems:
        raise ConfigError(problems)
    max_length, fit = value(experiment, "max_length"), fitter(experiment)

    def rows(ds, split):
        ds = shaped(ds)
        if IMAGES not in ds.column_names:
            ds = ds.add_column(IMAGES, [[] for _ in range(len(ds))])
        ds = kept(ds, split, processor, max_length, fit, splits.notes,
                  processes(experiment, len(ds)))
        return ds.select_columns([*columns, ORIGIN])

    return splits.tokenized(rows)


def pictures_fitted(trainer, experiment: Experiment) -> None:
    """vision.max_pixels, min_pixels: the pictures fitted before the trainer's collator."""
    trainer.data_collator = ImagesSized(trainer.data_collator, experiment)
