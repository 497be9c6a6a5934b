"""Tokenize SFT rows into input_ids and labels (-100 where a token is not trained), with
an optional weight on every token. What is trained follows TRL's SFTConfig:
assistant_only_loss (messages: only assistant turns), completion_only_loss
(prompt/completion: only the completion; TRL's default). finetune tokenizes instead of
SFTTrainer so the result can be cached on disk and shared by every rank and later runs.

A token's weight is its row's weight (data.weight_column, default 1) times its assistant
turn's weight (`weight` on the message, default 1). Turns are located by rendering the
chat template on growing prefixes of the conversation: the tokens between "messages up to
turn i with the generation prompt" and "messages through turn i" are turn i's. A template
whose renderings are not prefixes of each other cannot be split that way: such a
conversation is rendered through TRL's training version of the template where TRL ships
one (model/chat_template.training_version: Qwen3's, whose original drops the think block
of every assistant turn before the last user turn), and refused otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from datasets import Dataset

from finetune.data.formats import chat_message, row_tools
from finetune.data.load import ORIGIN, WEIGHT
from finetune.model.chat_template import training_version
from finetune.model.tokenizer import render_chat
from finetune.errors import DataError

IGNORE = -100


@dataclass(frozen=True)
class Masking:
    """Which tokens are trained and how rows are cut; from the TRL config's settings."""

    assistant_only: bool = False
    completion_only: bool = True
    max_length: int | None = None
    keep_end: bool = False  # truncation_mode keep_end: cut the start instead of the end
    weighted: bool = False  # add a token_weights column


def _render(tokenizer, messages: list[dict[str, Any]], generation_prompt: bool,
            label: str, tools: list[dict[str, Any]] | None = None,
            template: str | None = None) -> list[int]:
    plain = [chat_message(m) for m in messages]
    return render_chat(tokenizer, plain, label, generation_prompt, tools, template)


Tokens = tuple[list[int], list[bool], list[float]]  # ids, trained?, weight of each
Version = Callable[[], "str | None"]  # the template's training version, found once a run


def _altered(message: dict[str, Any]) -> dict[str, Any]:
    """A tool call (its function renamed) or a tool result (its content extended) changed,
    so that a template that renders it renders it differently."""
    if message.get("tool_calls"):
        return {**message, "tool_calls": [
            {**c, "function": {**c["function"], "name": c["function"]["name"] + "_"}}
            for c in message["tool_calls"]]}
    return {**message, "content": f"{message.get('content') or ''}_"}


def _check_tool_parts(tokenizer, messages: list[dict[str, Any]], ids: list[int], label: str,
                      tools: list[dict[str, Any]] | None, template: str | None = None) -> None:
    """A template that ignores `tools`, a tool call or a tool result renders the row without
    it and raises nothing: the row would train as if it had none. Each part is changed in
    turn; a rendering the change leaves alike lost it."""
    fix = "use a chat template that renders tools, tool calls and tool results " \
          "(tokenizer.chat_template)"
    if tools and _render(tokenizer, messages, False, label, None, template) == ids:
        raise DataError(f"{label}: the chat template renders no `tools` (the row's function "
                        f"schemas would be lost); {fix}")
    for i, message in enumerate(messages):
        if message.get("tool_calls") or message["role"] == "tool":
            changed = messages[:i] + [_altered(message)] + messages[i + 1:]
            if _render(tokenizer, changed, False, label, tools, template) == ids:
                what = "tool call" if message.get("tool_calls") else "tool result"
                raise DataError(f"{label}: the chat template leaves out `messages[{i}]` (a "
                                f"{what}): the row would train without it; {fix}")


def _conversation(tokenizer, messages: list[dict[str, Any]], weight: float, masking: Masking,
                  label: str, tools: list[dict[str, Any]] | None, version: Version,
                  template: str | None = None) -> tuple[Tokens, str | None]:
    """The conversation's tokens, and the template they were rendered with: `template`
    (None: the tokenizer's own), or version() (TRL's training version of it) where that
    one cannot split the conversation into turns."""
    ids = _render(tokenizer, messages, False, label, tools, template)
    _check_tool_parts(tokenizer, messages, ids, label, tools, template)
    needs_turns = masking.assistant_only or any(m.get("weight") is not None for m in messages)
    trained, weights = [not masking.assistant_only] * len(ids), [weight] * len(ids)
    if not needs_turns:
        return (ids, trained, weights), template
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:i], True, label, tools, template) if i else []
        end = _render(tokenizer, messages[: i + 1], False, label, tools, template)
        if ids[:len(start)] != start or ids[:len(end)] != end:
            other = None if template else version()
            if other:
                return _conversation(tokenizer, messages, weight, masking, label, tools,
                                     version, other)
            raise DataError(f"{label}: the chat template does not render this conversation "
                            "turn by turn (a prefix renders differently), so assistant turns "
                            "cannot be located for assistant_only_loss (on by default for "
                            "conversations) or per-turn weights; use a template that does "
                            "(tokenizer.chat_template), or set training.assistant_only_loss: "
                            "false to train on every turn")
        turn = weight * (1.0 if message.get("weight") is None else float(message["weight"]))
        span = range(len(start), len(end))
        for position in span:
            trained[position], weights[position] = True, turn
    return (ids, trained, weights), template


def _prompt_completion(tokenizer, row: dict[str, Any], weight: float, masking: Masking,
                       label: str, version: Version) -> Tokens:
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, list):
        completion = [{**m, "weight": None} for m in completion]
        tools = row_tools(row, label)
        (ids, trained, weights), template = _conversation(tokenizer, prompt + completion,
                                                          weight, masking, label, tools, version)
        prompt_length = len(_render(tokenizer, prompt, True, label, tools, template))
    else:
        # As TRL: the joined text is tokenized, and the completion starts where it and the
        # prompt alone stop agreeing (tokens may merge across the boundary).
        head = tokenizer(prompt)["input_ids"]
        ids = tokenizer(prompt + completion)["input_ids"]
        if not ids or ids[-1] != tokenizer.eos_token_id:
            ids.append(tokenizer.eos_token_id)
        prompt_length = next((i for i, (a, b) in enumerate(zip(head, ids)) if a != b),
                             min(len(head), len(ids)))
        trained, weights = [True] * len(ids), [weight] * len(ids)
    if masking.completion_only:
        trained[:prompt_length] = [False] * prompt_length
    return ids, trained, weights


def _text(tokenizer, row: dict[str, Any], weight: float) -> Tokens:
    ids = tokenizer(row["text"])["input_ids"]
    if not ids or ids[-1] != tokenizer.eos_token_id:
        ids.append(tokenizer.eos_token_id)
    return ids, [True] * len(ids), [weight] * len(ids)


def row_tokenizer(tokenizer, fmt: str, masking: Masking, split: str):
    """(row, index) -> input_ids, labels and (masking.weighted) token_weights."""
    version = functools.cache(lambda: training_version(tokenizer))
    cut = None if masking.max_length is None else (
        slice(-masking.max_length, None) if masking.keep_end else slice(None, masking.max_length))

    def one(row: dict[str, Any], index: int) -> dict[str, Any]:
        label = row.get(ORIGIN) or f"data.{split} row {index + 1}"
        weight = float(row.get(WEIGHT, 1.0))
        if fmt == "messages":
            (ids, trained, weights), _ = _conversation(tokenizer, row["messages"], weight,
                                                       masking, label, row_tools(row, label),
                                                       version)
        elif fmt == "prompt_completion":
            ids, trained, weights = _prompt_completion(tokenizer, row, weight, masking, label,
                                                       version)
        else:
            ids, trained, weights = _text(tokenizer, row, weight)
        if not any(trained):  # before any truncation: the row itself has nothing to train
            raise DataError(f"{label}: nothing to train: {_untrained_reason(fmt, masking)}")
        if cut is not None:
            ids, trained, weights = ids[cut], trained[cut], weights[cut]
        out = {"input_ids": ids, "labels": [t if keep else IGNORE for t, keep in zip(ids, trained)]}
        if masking.weighted:
            out["token_weights"] = [w if keep else 0.0 for w, keep in zip(weights, trained)]
        return out

    return one


def tokenize(dataset: Dataset, tokenizer, fmt: str, masking: Masking, split: str,
             num_proc: int | None = None) -> Dataset:
    """input_ids, labels and (masking.weighted) token_weights per row. Rows left with no
    trained token after truncation are dropped, as TRL does; none left is an error.
    num_proc: processes (data/parallel.py); the result is the same with any count."""
    one = row_tokenizer(tokenizer, fmt, masking, split)
    tokenized = dataset.map(one, with_indices=True, remove_columns=dataset.column_names,
                            num_proc=num_proc, desc=f"tokenizing {split}")
    kept = tokenized.filter(lambda row: any(t != IGNORE for t in row["labels"]),
                            num_proc=num_proc)
    if len(kept) == 0:
        raise DataError(f"data.{split}: no row has a trained token left after truncation to "
                        f"max_length {masking.max_length}")
    return kept


def tokenize_stream(stream, tokenizer, masking: Masking):
    """A stream of text rows (data/stream.py), tokenized row by row as it is read. A text
    row always trains its tokens (its EOS at least, whatever max_length cuts), so none is
    dropped."""
    one = row_tokenizer(tokenizer, "text", masking, "train")
    return stream.map(one, with_indices=True, remove_columns=stream.column_names)


def _untrained_reason(fmt: str, masking: Masking) -> str:
    if masking.assistant_only:
        return "training.assistant_only_loss trains assistant turns only, and " \
               f"{'the completion' if fmt == 'prompt_completion' else 'the row'} has none"
    return "the completion adds no token to the prompt"


def uses_token_weights(dataset: Dataset, fmt: str) -> bool:
    """Does any assistant message carry a weight of its own?"""
    if fmt != "messages":
        return False
    return any(m.get("weight") is not None for row in dataset["messages"] for m in row)
