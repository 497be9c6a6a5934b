"""REINFORCE Leave-One-Out through TRL's RLOOTrainer: num_generations completions are
generated for each prompt and scored by the rewards section; each one's advantage is
its reward minus the mean reward of the other completions of its prompt (the
leave-one-out baseline). With beta > 0 (RLOOConfig's default 0.05) the KL to the
reference, summed over the completion's tokens, is subtracted from its reward before
the baseline (not a loss term, as in grpo).

The preparation of the prompts (a vision-language model's with their pictures), reward
sources, the reference model without PEFT and the exact resume of the generation window
(the "rloo" part of finetune's state record) are grpo's: see methods/online.py.
RLOOTrainer renders prompts and keeps its generation state as GRPOTrainer does.
"""

from __future__ import annotations

from trl import RLOOTrainer

from finetune.methods import Job
from finetune.methods.online import GenerationState, build_online_trainer, prepare_prompts
from finetune.model.vision import is_processor
from finetune.trainers.vision import VisionCheckpoints

prepare = prepare_prompts


class ResumableRLOOTrainer(GenerationState, RLOOTrainer):
    """RLOOTrainer whose checkpoints carry its generation window (methods/online.py), as
    the "rloo" part of finetune's state record (callbacks.ResumeState)."""

    state_part = "rloo"


class ResumableVisionRLOOTrainer(VisionCheckpoints, ResumableRLOOTrainer):
    """A vision-language model's: its checkpoints' weights loaded back (trainers/vision.py)."""


def build_trainer(job: Job) -> RLOOTrainer:
    vision = is_processor(job.tokenizer)
    return build_online_trainer(job, ResumableVisionRLOOTrainer if vision else ResumableRLOOTrainer)
