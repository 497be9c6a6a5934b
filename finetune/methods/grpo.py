"""Group relative policy optimisation through TRL's GRPOTrainer: completions generated
for each prompt are scored by the rewards section, and each one's advantage is its
reward against its group's mean (scaled by the group's spread); the KL to the reference
(beta > 0) is a term of the per-token loss.

Reward sources, the reference model without PEFT and the exact resume of the
generation window (the "grpo" part of finetune's state record) are shared with rloo:
see methods/online.py.
"""

from __future__ import annotations

from dataclasses import replace

from trl import GRPOTrainer

from finetune.data.prompts import checked_prompts, completion_budget, prompt_limit
from finetune.errors import ConfigError
from finetune.methods import Job, vision_lengths
from finetune.methods.online import GenerationState, build_online_trainer
from finetune.methods.online import checked_reward as _checked  # noqa: F401 (tests use it)
from finetune.methods.sft_vision import refuse_images
from finetune.model.vision import is_processor
from finetune.trainers.vision import VisionCheckpoints


class ResumableGRPOTrainer(GenerationState, GRPOTrainer):
    """GRPOTrainer whose checkpoints carry its generation window (methods/online.py), as
    the "grpo" part of finetune's state record (callbacks.ResumeState)."""

    state_part = "grpo"


class ResumableVisionGRPOTrainer(VisionCheckpoints, ResumableGRPOTrainer):
    """A vision-language model's: its checkpoints' weights loaded back (trainers/vision.py)."""


def prepare(splits, tokenizer, experiment):
    """Every prompt rendered and counted against the context: a text model's refused
    when too long (data/prompts.py), a vision-language model's, with its pictures
    expanded to their image tokens, dropped and counted (methods/vision_lengths.py)."""
    if is_processor(tokenizer):
        return _vision_prompts(splits, tokenizer, experiment)
    refuse_images(splits, experiment)
    return checked_prompts(splits, tokenizer, experiment)


def _vision_prompts(splits, processor, experiment):
    sizes = experiment.vision  # for a hub model (config/rules/vision.py: a local one)
    if sizes is not None and (sizes.max_pixels, sizes.min_pixels) != (None, None):
        raise ConfigError(["vision.max_pixels, vision.min_pixels: not supported for grpo "
                           "yet (its trainer opens the pictures itself): fit the pictures "
                           "ahead"])
    limit = prompt_limit(experiment)
    setting, budget = completion_budget(experiment)
    kept = lambda rows, split: None if rows is None else vision_lengths.kept_prompts(
        rows, split, processor, limit, setting, budget, splits.notes)
    # The rows stay rows (splits.tokenized would keep a second copy of eval as eval_rows)
    return replace(splits, train=kept(splits.train, "train"), eval=kept(splits.eval, "eval"))


def build_trainer(job: Job) -> GRPOTrainer:
    vision = is_processor(job.tokenizer)
    return build_online_trainer(job, ResumableVisionGRPOTrainer if vision else ResumableGRPOTrainer)
