"""Source formats: row schemas that finetune converts, while reading the data, into one of
the formats a method trains on (data/rows.py FORMATS; data/formats.py converts). Torch-free:
the schema and the rules name them."""

from __future__ import annotations

# The roles a message may have once converted (OpenAI's chat format).
ROLES = ("system", "user", "assistant", "tool")

# source format -> (its required columns, the formats it becomes, in order of preference):
# it is read by the methods that train on one of those.
SOURCES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # instruction [+ input] as the user turn, output as the assistant's; optional system.
    "alpaca": (("instruction", "output"), ("prompt_completion", "prompt")),
    # conversations of {from, value} turns; optional system and tools columns, and image
    # or images (LLaVA's rows: `<image>` placeholders in the turns; data/peer_rows.py).
    "sharegpt": (("conversations",), ("messages",)),
    # kto rows as LLaMA-Factory writes them: a conversation whose last turn, an assistant's,
    # is labelled desirable (true) or not (false).
    "labelled_messages": (("messages", "label"), ("unpaired_preference",)),
}

# sharegpt's usual speaker names (`from`), over which data.roles applies.
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant",
    "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant", "function_call": "assistant", "observation": "tool",
    "function": "tool", "tool": "tool",
}


def target(fmt: str, formats: tuple[str, ...]) -> str | None:
    """The format a source format becomes for a method reading `formats` (None: none)."""
    return next((f for f in SOURCES[fmt][1] if f in formats), None) if fmt in SOURCES else None


def accepted(formats: tuple[str, ...]) -> tuple[str, ...]:
    """A method's own formats, then the source formats it reads through conversion."""
    return formats + tuple(s for s in SOURCES if target(s, formats))


def trained(fmt: str, formats: tuple[str, ...]) -> str:
    """The format the rows have once read: a source format's target, or fmt itself."""
    return target(fmt, formats) or fmt
