"""grpo and ppo generate from their prompts: while preparing, every prompt is rendered (a
chat template that fails on one is an error naming its file and row, not a failure in
the middle of training) and counted against the model's context.

TRL 1.16's GRPOConfig has no max_prompt_length (it was removed), and our PPO trainer
none either: a prompt is generated from whole. One whose tokens plus the completion
budget exceed the model's max_position_embeddings is refused, not truncated: cutting it
would train on another prompt than the data's, and leaving it runs the model past its
positions (a 600k-token prompt ran for minutes and took 8 GB before failing)."""

from __future__ import annotations

from finetune.data.load import ORIGIN, Splits
from finetune.model.load import context_length
from finetune.model.tokenizer import render_chat
from finetune.config.schema import Experiment
from finetune.config.derived import effective
from finetune.errors import ConfigError, DataError


def completion_budget(experiment: Experiment) -> tuple[str, int]:
    """(setting, tokens): how many tokens a completion may add to its prompt."""
    path = effective.record(experiment).completion_length
    return path, effective.setting(experiment, path) or 0


def prompt_limit(experiment: Experiment) -> int | None:
    """The most tokens a prompt may have, or None when the model's context is unknown."""
    context = context_length(experiment)
    return None if context is None else context - completion_budget(experiment)[1]


def prompt_ids(tokenizer, prompt: str | list, where: str) -> list[int]:
    """As the trainers tokenize a prompt: a chat through the template with the generation
    prompt, text with the tokenizer's own special tokens."""
    if isinstance(prompt, list):
        return render_chat(tokenizer, prompt, where, generation_prompt=True)
    return tokenizer(prompt)["input_ids"]


def checked_prompts(splits: Splits, tokenizer, experiment: Experiment) -> Splits:
    limit = prompt_limit(experiment)
    setting, budget = completion_budget(experiment)
    if limit is not None and limit < 1:
        raise ConfigError([f"{setting}: {budget} leaves no room for a prompt in the model's "
                           f"context of {limit + budget} tokens (max_position_embeddings)"])
    for rows in (splits.train, splits.eval):
        for row in rows if rows is not None else ():
            count = len(prompt_ids(tokenizer, row["prompt"], f"{row[ORIGIN]}, `prompt`"))
            if limit is not None and count > limit:
                raise DataError(
                    f"{row[ORIGIN]}: the prompt has {count} tokens; with {setting} {budget} "
                    f"that exceeds the model's context of {limit + budget} tokens "
                    "(max_position_embeddings): shorten the prompt, or lower "
                    f"{setting}")
    return splits
