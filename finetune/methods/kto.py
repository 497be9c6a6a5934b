"""Kahneman-Tversky optimisation through TRL's KTOTrainer: single completions labelled
desirable or not (preference pairs arrive here already unpaired, data/load.py).

KTOTrainer samples its training rows in order (its KL term pairs each row's prompt with
its neighbour's completion, fixed when it prepares the data), so nothing would shuffle
them: a file sorted by label, or unpaired pairs (all chosen answers, then all rejected
ones), would train on one label at a time. prepare shuffles both splits once, with the
data seed. The reference model is passed explicitly, as for dpo: a frozen copy of the
starting policy, the model named in kto.ref_model, or under (Q)LoRA none (TRL then keeps
a frozen copy of the starting adapter).

A vision-language model (its processor is the processing class) trains on unpaired rows
with images (`images` beside prompt, completion and label; pairs with images unpaired,
each of the two rows keeping the pictures: data/load.py) through TRL's own vision path:
the rows stay untokenized and DataCollatorForVisionUnpairedPreference renders each batch,
the prompt with its pictures then the completion, and the KL term's mismatched pairs by
giving each row's prompt (and pictures) the completion of the row before it in the batch.
The pictures are in the prompt, so no image token is trained. Llama 3.2 Vision is refused
(config/rules/vision.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trl import KTOTrainer
from trl.data_utils import common_prefix_length

from finetune.config.derived.effective import value
from finetune.config.schema import Experiment
from finetune.data.images import IMAGES
from finetune.data.load import ORIGIN, Splits
from finetune.data.mix import seed_of
from finetune.methods import Job, vision_lengths
from finetune.methods.pairs import (frozen_reference, pictures_fitted, require_a_row_that_fits,
                                    vision_rows)
from finetune.methods.sft_vision import refuse_images
from finetune.model.tokenizer import render_chat
from finetune.model.vision import is_processor

# The columns TRL's vision collator reads; every other one is dropped before it.
VISION_COLUMNS = ("prompt", "completion", "label", IMAGES)


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
    prompt alone fills max_length. A vision-language model's rows: _vision_rows."""
    seed = seed_of(experiment)
    shuffled = lambda rows: None if rows is None else rows.shuffle(seed=seed).flatten_indices()
    splits = dataclasses.replace(splits, train=shuffled(splits.train), eval=shuffled(splits.eval))
    if is_processor(tokenizer):
        return _vision_rows(splits, tokenizer, experiment)
    refuse_images(splits, experiment)
    require_a_row_that_fits(splits, value(experiment, "max_length"),
                            lambda row: prompt_length(tokenizer, row), "KTOTrainer", "completion")
    return splits


def vision_problems(experiment: Experiment) -> list[str]:
    """Settings TRL's KTOTrainer and its vision collator refuse for rows with images
    (validate says the same for a local model: config/rules/vision.py)."""
    training, problems = experiment.training, []
    if training.get("precompute_ref_log_probs"):
        problems.append("training.precompute_ref_log_probs: not supported for a "
                        "vision-language model (TRL renders its rows batch by batch)")
    if training.get("pad_to_multiple_of") is not None:
        problems.append("training.pad_to_multiple_of: not supported for a vision-language "
                        "model (TRL's vision preference collators do not pad to it)")
    return problems


def _vision_rows(splits: Splits, processor, experiment: Experiment) -> Splits:
    """The shuffled rows, less those whose prompt max_length would cut inside its image
    tokens or leave without a completion token (pairs.vision_rows)."""
    return vision_rows(splits, processor, experiment, vision_problems(experiment),
                       vision_lengths.kept_unpaired, VISION_COLUMNS)


def build_trainer(job: Job) -> KTOTrainer:
    trainer_class, vision = KTOTrainer, is_processor(job.tokenizer)
    if vision:  # a vision-language model
        from finetune.trainers.vision import VisionKTOTrainer as trainer_class
    trainer = trainer_class(model=job.model, ref_model=frozen_reference(job), args=job.args,
                            train_dataset=job.data.train, eval_dataset=job.data.eval,
                            processing_class=job.tokenizer, callbacks=job.callbacks)
    if vision:
        pictures_fitted(trainer, job.experiment)
    return trainer
