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

import copy
import dataclasses
from typing import Any

from transformers import AutoModelForCausalLM
from trl import KTOTrainer
from trl.data_utils import common_prefix_length

from finetune.config.effective import value
from finetune.config.schema import Experiment
from finetune.data.load import ORIGIN, Splits
from finetune.data.mix import seed_of
from finetune.errors import DataError
from finetune.methods import Job
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
    max_length = value(experiment, "max_length")
    for split, rows in (("train", splits.train), ("eval", splits.eval)):
        lengths = [(prompt_length(tokenizer, row), row[ORIGIN]) for row in rows or ()]
        shortest, where = min(lengths, default=(0, ""))
        if max_length is not None and shortest >= max_length:
            raise DataError(f"data.{split}: no row fits training.max_length {max_length}: "
                            "KTOTrainer drops a row whose prompt alone is that long (nothing "
                            f"of its completion would be left), and the shortest prompt, "
                            f"{where}, has {shortest} tokens; raise training.max_length, or "
                            "shorten the prompts")
    return splits


def _reference(job: Job):
    spec = job.experiment
    if spec.kto.ref_model:
        ref = AutoModelForCausalLM.from_pretrained(
            spec.kto.ref_model, dtype=job.hardware.model_dtype(spec, "reference"),
            trust_remote_code=spec.model.trust_remote_code)
    elif spec.peft.type != "none":
        return None
    else:
        ref = copy.deepcopy(job.model)
    ref.requires_grad_(False)
    return ref.eval()


def build_trainer(job: Job) -> KTOTrainer:
    return KTOTrainer(model=job.model, ref_model=_reference(job), args=job.args,
                      train_dataset=job.data.train, eval_dataset=job.data.eval,
                      processing_class=job.tokenizer, callbacks=job.callbacks)
