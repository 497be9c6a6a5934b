"""Group relative policy optimisation through TRL's GRPOTrainer: completions generated
for each prompt are scored by the rewards section, and each one's advantage is its
reward against its group's mean (scaled by the group's spread); the KL to the reference
(beta > 0) is a term of the per-token loss.

Reward sources, the reference model without PEFT and the exact resume of the
generation window (the "grpo" part of finetune's state record) are shared with rloo:
see methods/online.py.
"""

from __future__ import annotations

from trl import GRPOTrainer

from finetune.data.images import IMAGES
from finetune.data.load import ORIGIN
from finetune.data.prompts import checked_prompts, completion_budget, prompt_limit
from finetune.errors import ConfigError, DataError
from finetune.methods import Job
from finetune.methods.online import GenerationState, build_online_trainer
from finetune.methods.online import checked_reward as _checked  # noqa: F401 (tests use it)
from finetune.methods.sft_vision import refuse_images
from finetune.model.vision import chat_prompts, is_processor
from finetune.trainers.vision import VisionCheckpoints


class ResumableGRPOTrainer(GenerationState, GRPOTrainer):
    """GRPOTrainer whose checkpoints carry its generation window (methods/online.py), as
    the "grpo" part of finetune's state record (callbacks.ResumeState)."""

    state_part = "grpo"


class ResumableVisionGRPOTrainer(VisionCheckpoints, ResumableGRPOTrainer):
    """A vision-language model's: its checkpoints' weights loaded back (trainers/vision.py)."""


def prepare(splits, tokenizer, experiment):
    """Every prompt rendered and counted against the context (data/prompts.py); a
    vision-language model's with its pictures, each expanded to its image tokens."""
    if is_processor(tokenizer):
        return _vision_prompts(splits, tokenizer, experiment)
    refuse_images(splits, experiment)
    return checked_prompts(splits, tokenizer, experiment)


def _vision_prompts(splits, processor, experiment):
    """As checked_prompts, each prompt rendered by the processor with its images (as
    GRPOTrainer renders it to generate)."""
    sizes = experiment.vision  # for a hub model (config/rules/vision.py: a local one)
    if sizes is not None and (sizes.max_pixels, sizes.min_pixels) != (None, None):
        raise ConfigError(["vision.max_pixels, vision.min_pixels: not supported for grpo "
                           "yet (its trainer opens the pictures itself): fit the pictures "
                           "ahead"])
    limit = prompt_limit(experiment)
    setting, budget = completion_budget(experiment)
    for rows in (splits.train, splits.eval):
        for row in rows if rows is not None else ():
            if not isinstance(row["prompt"], list):
                raise DataError(f"{row[ORIGIN]}: a vision-language model generates from "
                                "conversational prompts (`prompt` a list of messages)")
            count = chat_prompts(processor, [row["prompt"]], [row.get(IMAGES) or []]
                                 )["input_ids"].shape[1]
            if limit is not None and count > limit:
                raise DataError(
                    f"{row[ORIGIN]}: the prompt has {count} tokens with its image tokens; "
                    f"with {setting} {budget} that exceeds the model's context of "
                    f"{limit + budget} tokens (max_position_embeddings): shorten the "
                    f"prompt, or lower {setting}")
    return splits


def build_trainer(job: Job) -> GRPOTrainer:
    vision = is_processor(job.tokenizer)
    return build_online_trainer(job, ResumableVisionGRPOTrainer if vision else ResumableGRPOTrainer)
