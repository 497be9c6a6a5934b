"""REINFORCE Leave-One-Out through TRL's RLOOTrainer: num_generations completions are
generated for each prompt and scored by the rewards section; each one's advantage is
its reward minus the mean reward of the other completions of its prompt (the
leave-one-out baseline). With beta > 0 (RLOOConfig's default 0.05) the KL to the
reference, summed over the completion's tokens, is subtracted from its reward before
the baseline (not a loss term, as in grpo).

Reward sources, the reference model without PEFT and the exact resume of the
generation window (the "rloo" part of finetune's state record) are grpo's: see
methods/online.py. RLOOTrainer keeps the same generation state as GRPOTrainer.
"""

from __future__ import annotations

from trl import RLOOTrainer

from finetune.data.prompts import checked_prompts
from finetune.methods import Job
from finetune.methods.online import GenerationState, build_online_trainer


class ResumableRLOOTrainer(GenerationState, RLOOTrainer):
    """RLOOTrainer whose checkpoints carry its generation window (methods/online.py), as
    the "rloo" part of finetune's state record (callbacks.ResumeState)."""

    state_part = "rloo"


def prepare(splits, tokenizer, experiment):
    """Every prompt rendered and counted against the context (data/prompts.py)."""
    return checked_prompts(splits, tokenizer, experiment)


def build_trainer(job: Job) -> RLOOTrainer:
    return build_online_trainer(job, ResumableRLOOTrainer)
