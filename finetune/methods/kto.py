"""Kahneman-Tversky optimisation through TRL's KTOTrainer: single completions labelled
desirable or not (preference pairs arrive here already unpaired, data/load.py).

KTOTrainer samples its training rows in order (its KL term pairs each row's prompt with
its neighbour's completion, fixed when it prepares the data), so nothing would shuffle
them: a file sorted by label, or unpaired pairs (all chosen answers, then all rejected
ones), would train on one label at a time. prepare shuffles both splits once, with the
data seed. The reference model is passed explicitly, as for dpo: a frozen copy of the
starting policy, the model named in kto.ref_model, or under (Q)LoRA none (TRL then keeps
a frozen copy of the starting adapter).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trl import KTOTrainer
from trl.data_utils import common_prefix_length

from finetune.config.derived.effective import value
from finetune.config.schema import Experiment
from finetune.data.load import ORIGIN, Splits
from finetune.data.mix import seed_of
from finetune.methods import Job
from finetune.methods.pairs import frozen_reference, require_a_row_that_fits
from finetune.model.tokenizer import render_chat


def prompt_length(tokenizer, row: dict[str, Any]) -> int:
    """The prompt's tokens as KTOTrainer counts them (where the ids of the prompt and of
    prompt + completion part); rendering every chat row here finds a template that fails
    on one while preparing, with its file and row."""
    prompt, completion, where = row["prompt"], row["completion"], row[ORIGIN]
    if isinstance(prompt, list):
        prompt_ids = render_chat(tokenizer, prompt, f"{where}, `prompt`", generation_prompt=True)
        whole = render_chat(tokenizer, prompt + completion, f"{where}, `prompt + completion`")
    else:
        eos = tokenizer.eos_token or ""
        prompt_ids = tokenizer(prompt)["input_ids"]
        whole = tokenizer(prompt + completion + ("" if completion.endswith(eos) else eos))[
            "input_ids"]
    return common_prefix_length(prompt_ids, whole)


def prepare(splits: Splits, tokenizer, experiment: Experiment) -> Splits:
    """Shuffled once (see the module's note) and checked, not tokenized (KTOTrainer does
    that): every chat row renders, and some row is left once KTOTrainer drops those whose
    prompt alone fills max_length."""
    seed = seed_of(experiment)
    shuffled = lambda rows: None if rows is None else rows.shuffle(seed=seed).flatten_indices()
    splits = dataclasses.replace(splits, train=shuffled(splits.train), eval=shuffled(splits.eval))
    require_a_row_that_fits(splits, value(experiment, "max_length"),
                            lambda row: prompt_length(tokenizer, row), "KTOTrainer", "completion")
    return splits


def build_trainer(job: Job) -> KTOTrainer:
    return KTOTrainer(model=job.model, ref_model=frozen_reference(job), args=job.args,
                      train_dataset=job.data.train, eval_dataset=job.data.eval,
                      processing_class=job.tokenizer, callbacks=job.callbacks)
