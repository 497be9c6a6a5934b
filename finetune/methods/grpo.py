"""Group relative policy optimisation through TRL's GRPOTrainer: completions generated
for each prompt are scored by the rewards section, and each one's advantage is its
reward against its group's mean (scaled by the group's spread); the KL to the reference
(beta > 0) is a term of the per-token loss.

The preparation of the prompts (a vision-language model's with their pictures), reward
sources, the reference model without PEFT and the exact resume of the generation window
(the "grpo" part of finetune's state record) are shared with rloo: see methods/online.py.
"""

from __future__ import annotations

from trl import GRPOTrainer

from finetune.methods import Job
from finetune.methods.online import GenerationState, build_online_trainer, prepare_prompts
from finetune.methods.online import checked_reward as _checked  # noqa: F401 (tests use it)
from finetune.model.vision import is_processor
from finetune.trainers.vision import VisionCheckpoints

prepare = prepare_prompts


class ResumableGRPOTrainer(GenerationState, GRPOTrainer):
    """GRPOTrainer whose checkpoints carry its generation window (methods/online.py), as
    the "grpo" part of finetune's state record (callbacks.ResumeState)."""

    state_part = "grpo"


class ResumableVisionGRPOTrainer(VisionCheckpoints, ResumableGRPOTrainer):
    """A vision-language model's: its checkpoints' weights loaded back (trainers/vision.py)."""


def build_trainer(job: Job) -> GRPOTrainer:
    vision = is_processor(job.tokenizer)
    return build_online_trainer(job, ResumableVisionGRPOTrainer if vision else ResumableGRPOTrainer)
