"""Example reward functions for grpo, rloo and ppo (named in YAML as rewards.py:<function>).

Each is called with keyword arguments: prompts, completions (text, or message lists for
chat data), completion_ids, and every other data column, one entry per completion; it
returns one float per completion (or None where it does not apply)."""


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def length_near(completions, target: int = 200, **kwargs) -> list[float]:
    """1 at `target` characters, falling linearly to 0 at twice (or zero) that length."""
    return [max(0.0, 1 - abs(len(_text(c)) - target) / target) for c in completions]


def no_repeats(completions, **kwargs) -> list[float]:
    """The share of distinct words: penalises degenerate repetition."""
    scores = []
    for completion in completions:
        words = _text(completion).split()
        scores.append(len(set(words)) / len(words) if words else 0.0)
    return scores
