"""Direct preference optimisation through TRL's DPOTrainer.

The reference model is passed explicitly: under LoRA TRL keeps a frozen copy of the
starting adapter; otherwise we hand it a frozen copy of the starting policy (or the
model named in dpo.ref_model). Left to itself TRL would reload the reference from
model.config.name_or_path, which is empty for a freshly initialised model.

A vision-language model (its processor is the processing class) trains on preference
rows with images (data/rows.py) through TRL's own vision path: the rows stay untokenized
and DataCollatorForVisionPreference renders the prompt with its pictures and the answers
for each batch. TRL reads the prompt of such rows as given, so a row without one gets
the turns chosen and rejected share (TRL's extract_prompt, as it does for text rows).
Llama 3.2 Vision's pairs are mended after it (MllamaPairs).
"""

from __future__ import annotations

from trl import DPOTrainer
from trl.data_utils import extract_prompt

from finetune.config.derived.effective import value as effective_value
from finetune.config.schema import Experiment
from finetune.data.images import IMAGES
from finetune.data.load import Splits
from finetune.data.rows import WEIGHT
from finetune.methods import Job, vision_lengths
from finetune.methods.pairs import (frozen_reference, pictures_fitted, prompt_length,
                                    require_a_row_that_fits, vision_rows)
from finetune.methods.sft_vision import refuse_images
from finetune.model.vision import is_processor

# The columns TRL's vision collator reads; every other one is dropped before it.
VISION_COLUMNS = ("prompt", "chosen", "rejected", IMAGES)


def prepare(splits: Splits, tokenizer, experiment: Experiment) -> Splits:
    """Checked, not tokenized (DPOTrainer does that): every chat row renders, and some row
    is left once DPOTrainer drops those whose prompt alone fills max_length
    (truncation_mode keep_start; keep_end drops none)."""
    if is_processor(tokenizer):
        return _vision_rows(splits, tokenizer, experiment)
    refuse_images(splits, experiment)
    value = lambda key: effective_value(experiment, key)
    max_length = value("max_length") if value("truncation_mode") == "keep_start" else None
    require_a_row_that_fits(splits, max_length, lambda row: prompt_length(tokenizer, row),
                            "DPOTrainer", "answers")
    return splits


def vision_problems(experiment: Experiment) -> list[str]:
    """Settings TRL's DPOTrainer refuses or ignores for rows with images (validate says
    the same for a local model: config/rules/vision.py)."""
    training, problems = experiment.training, []
    if training.get("truncation_mode") == "keep_end":
        problems.append("training.truncation_mode: keep_end would cut the image tokens off "
                        "the prompt; a vision-language model's pairs are cut at the end "
                        "(keep_start)")
    if training.get("precompute_ref_log_probs"):
        problems.append("training.precompute_ref_log_probs: not supported for a "
                        "vision-language model (TRL renders its rows batch by batch)")
    for key in ("packing", "padding_free"):
        if training.get(key):
            problems.append(f"training.{key}: not supported for a vision-language model "
                            "(TRL's vision collator pads, one pair per row)")
    return problems


def _vision_rows(splits: Splits, processor, experiment: Experiment) -> Splits:
    """Each pair with its prompt (TRL's extract_prompt where none is given), less the
    pairs whose prompt max_length would cut inside its image tokens (pairs.vision_rows)."""
    with_prompt = lambda ds: ds if "prompt" in ds.column_names else ds.map(extract_prompt)
    columns = (*VISION_COLUMNS, WEIGHT) if experiment.data.weight_column is not None \
        else VISION_COLUMNS  # a weight per pair (trainers/weighted.py)
    return vision_rows(splits, processor, experiment, vision_problems(experiment),
                       vision_lengths.kept_pairs, columns, with_prompt)


def build_trainer(job: Job) -> DPOTrainer:
    trainer_class, vision = DPOTrainer, is_processor(job.tokenizer)
    weighted = job.experiment.data.weight_column is not None  # a weight per preference pair
    if vision and weighted:  # a vision-language model
        from finetune.trainers.weighted import WeightedVisionDPOTrainer as trainer_class
    elif vision:
        from finetune.trainers.vision import VisionDPOTrainer as trainer_class
    elif weighted:
        from finetune.trainers.weighted import WeightedDPOTrainer as trainer_class
    trainer = trainer_class(model=job.model, ref_model=frozen_reference(job), args=job.args,
                            train_dataset=job.data.train, eval_dataset=job.data.eval,
                            processing_class=job.tokenizer, callbacks=job.callbacks)
    if vision:
        pictures_fitted(trainer, job.experiment)
        if getattr(job.model.config, "model_type", None) == "mllama":  # cut after mending
            pairs = trainer.data_collator.collate  # TRL's collator, inside ImagesSized
            pairs = getattr(pairs, "collator", pairs)  # and inside WithWeights
            cut, pairs.max_length = pairs.max_length, None
            trainer.data_collator = MllamaPairs(trainer.data_collator, job.tokenizer, cut)
    return trainer


class MllamaPairs:
    """A collator wrapper for Llama 3.2 Vision (mllama) pairs, whose processor TRL's vision
    preference collator calls on prompts and answers apart:
    - the processor puts <|bos|> before every text without one, so each answer came with
      a stray <|bos|> token (trained as its first token): it is taken out, the rows packed
      left again (an answer that itself starts with <|bos|> loses it too);
    - the collator keeps the prompts' cross_attention_mask (batch x prompt tokens x
      images x tiles) beside prompt + answer ids: it is built again over those ids with
      transformers' own mllama functions, as the processor builds it for the whole text
      (each token from an image's <|image|> token on attends to that image's tiles,
      counted from the prompts' mask; right padding as the processor pads).
    The rows are cut to max_length here, after the <|bos|> is out (the collator's own cut
    would count it)."""

    def __init__(self, collate, processor, max_length: int | None = None):
        self.collate, self.processor, self.max_length = collate, processor, max_length

    def __call__(self, rows):
        import torch
        from transformers.models.mllama.processing_mllama import (
            convert_sparse_cross_attention_mask_to_dense, get_cross_attention_token_mask)

        batch = self.collate(rows)
        answer, attention = batch["completion_mask"], batch["attention_mask"]
        first = answer.argmax(dim=1)  # each row's first answer token (rows flushed left)
        at = torch.arange(len(first))
        keep = attention.bool().clone()
        keep[at, first] &= ~(answer[at, first].bool() & (batch["input_ids"][at, first] ==
                                                         self.processor.tokenizer.bos_token_id))
        order = torch.sort((~keep).int(), dim=1, stable=True).indices  # kept tokens first
        length = int(keep.sum(dim=1).max())
        if self.max_length is not None:
            length = min(length, self.max_length)
        kept = keep.gather(1, order)[:, :length]
        for key in ("input_ids", "attention_mask", "completion_mask"):
            batch[key] = (batch[key].gather(1, order)[:, :length] * kept).to(batch[key].dtype)
        if "cross_attention_mask" in batch:  # the prompts had pictures
            prompts = batch["cross_attention_mask"]
            tiles = prompts.amax(dim=1).sum(dim=-1).tolist()  # per row, per image
            ids = batch["input_ids"].masked_fill(~kept, -1).tolist()
            ranges = [get_cross_attention_token_mask(row, self.processor.image_token_id)
                      for row in ids]
            dense = convert_sparse_cross_attention_mask_to_dense(ranges, tiles,
                                                                 prompts.shape[-1], length)
            batch["cross_attention_mask"] = torch.from_numpy(dense).to(prompts.dtype)
        return batch
