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

from finetune.data.prompts import checked_prompts
from finetune.methods import Job
from finetune.methods.online import GenerationState, build_online_trainer
from finetune.methods.online import checked_reward as _checked  # noqa: F401 (tests use it)


class ResumableGRPOTrainer(GenerationState, GRPOTrainer):
    """GRPOTrainer whose checkpoints carry its generation window (methods/online.py), as
    the "grpo" part of finetune's state record (callbacks.ResumeState)."""

    state_part = "grpo"


def prepare(splits, tokenizer, experiment):
    """Every prompt rendered and counted against the context (data/prompts.py)."""
    return checked_prompts(splits, tokenizer, experiment)


def build_trainer(job: Job) -> GRPOTrainer:
    return build_online_trainer(job, ResumableGRPOTrainer)
