"""Direct preference optimisation through TRL's DPOTrainer.

The reference model is passed explicitly: under LoRA TRL keeps a frozen copy of the
starting adapter; otherwise we hand it a frozen copy of the starting policy (or the
model named in dpo.ref_model). Left to itself TRL would reload the reference from
model.config.name_or_path, which is empty for a freshly initialised model.
"""

import copy
from typing import Any

from transformers import AutoModelForCausalLM
from trl import DPOTrainer
from trl.data_utils import common_prefix_length, extract_prompt

from finetune.data.load import ORIGIN, Splits
from finetune.model.tokenizer import render_chat
from finetune.config.schema import Experiment
from finetune.config.effective import value as effective_value
from finetune.errors import DataError
from finetune.methods import Job


def _prompt_length(tokenizer, row: dict[str, Any]) -> int:
    """The prompt's tokens as DPOTrainer counts them (_prepare_dataset: the prompt, given or
    extracted, then where its ids and those of prompt + answer part). DPOTrainer
    tokenizes itself; rendering every chat row here is what finds a template that fails
    on one, while preparing, with its file and row."""
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


def prepare(splits: Splits, tokenizer, experiment: Experiment) -> Splits:
    """Checked, not tokenized (DPOTrainer does that): every chat row renders, and some row
    is left once DPOTrainer drops those whose prompt alone fills max_length
    (truncation_mode keep_start; keep_end drops none)."""
    value = lambda key: effective_value(experiment, key)
    max_length = value("max_length") if value("truncation_mode") == "keep_start" else None
    for split, rows in (("train", splits.train), ("eval", splits.eval)):
        lengths = [(_prompt_length(tokenizer, row), row[ORIGIN]) for row in rows or ()]
        shortest, where = min(lengths, default=(0, ""))
        if max_length is not None and shortest >= max_length:
            raise DataError(f"data.{split}: no row fits training.max_length {max_length}: "
                            "DPOTrainer drops a row whose prompt alone is that long (nothing "
                            f"of its answers would be left), and the shortest prompt, "
                            f"{where}, has {shortest} tokens; raise training.max_length, or "
                            "shorten the prompts")
    return splits


def _reference(job: Job):
    spec = job.experiment
    if spec.dpo.ref_model:
        ref = AutoModelForCausalLM.from_pretrained(
            spec.dpo.ref_model, dtype=job.hardware.model_dtype(spec, "reference"),
            trust_remote_code=spec.model.trust_remote_code)
    elif spec.peft.type != "none":
        return None
    else:
        ref = copy.deepcopy(job.model)
    ref.requires_grad_(False)
    return ref.eval()


def build_trainer(job: Job) -> DPOTrainer:
    trainer_class = DPOTrainer
    if job.experiment.data.weight_column is not None:  # a weight per preference pair
        from finetune.trainers.weighted import WeightedDPOTrainer as trainer_class
    return trainer_class(model=job.model, ref_model=_reference(job), args=job.args,
                         train_dataset=job.data.train, eval_dataset=job.data.eval,
                         processing_class=job.tokenizer, callbacks=job.callbacks)
