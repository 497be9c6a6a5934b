"""Tokenize SFT rows with a weight on every trained token.

A token's weight is its row's weight (data.weight_column, default 1) times its assistant
turn's weight (`weight` on the message, default 1). Turns are located by rendering the
chat template on growing prefixes of the conversation: the tokens between "messages up to
turn i with the generation prompt" and "messages through turn i" are turn i's. A template
whose renderings are not prefixes of each other cannot be split that way and is refused.
"""

from __future__ import annotations

from typing import Any

from datasets import Dataset

from finetune.build.data import WEIGHT
from finetune.errors import DataError


def _render(tokenizer, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    return list(tokenizer.apply_chat_template(plain, tokenize=True, return_dict=True,
                                              add_generation_prompt=generation_prompt)["input_ids"])


def _conversation(tokenizer, messages: list[dict[str, Any]], weight: float,
                  label: str) -> tuple[list[int], list[int], list[float]]:
    ids = _render(tokenizer, messages, False)
    labels, weights = [-100] * len(ids), [0.0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:i], True) if i else []
        end = _render(tokenizer, messages[: i + 1], False)
        if ids[:len(start)] != start or ids[:len(end)] != end:
            raise DataError(f"{label}: the chat template does not render this conversation "
                            "turn by turn (a prefix renders differently), so per-turn weights "
                            "cannot be placed; use a template that does, or drop the weights")
        turn = weight * (1.0 if message.get("weight") is None else float(message["weight"]))
        for position in range(len(start), len(end)):
            labels[position] = ids[position]
            weights[position] = turn
    return ids, labels, weights


def _prompt_completion(tokenizer, row: dict[str, Any], weight: float,
                       label: str) -> tuple[list[int], list[int], list[float]]:
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, list):
        completion = [{**m, "weight": None} for m in completion]
        ids, labels, weights = _conversation(tokenizer, prompt + completion, weight, label)
        trained_from = len(_render(tokenizer, prompt, True))
        labels[:trained_from] = [-100] * trained_from
        weights[:trained_from] = [0.0] * trained_from
        return ids, labels, weights
    head = tokenizer(prompt)["input_ids"]
    tail = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return head + tail, [-100] * len(head) + tail, [0.0] * len(head) + [weight] * len(tail)


def _text(tokenizer, row: dict[str, Any], weight: float) -> tuple[list[int], list[int], list[float]]:
    ids = tokenizer(row["text"])["input_ids"] + [tokenizer.eos_token_id]
    return ids, list(ids), [weight] * len(ids)


def tokenize(dataset: Dataset, tokenizer, fmt: str, max_length: int | None,
             split: str) -> Dataset:
    """input_ids, labels (-100 where untrained) and token_weights per row, truncated on
    the right to max_length."""

    def one(row: dict[str, Any], index: int) -> dict[str, Any]:
        label = f"data.{split} row {index + 1}"
        weight = float(row.get(WEIGHT, 1.0))
        if fmt == "messages":
            ids, labels, weights = _conversation(tokenizer, row["messages"], weight, label)
        elif fmt == "prompt_completion":
            ids, labels, weights = _prompt_completion(tokenizer, row, weight, label)
        else:
            ids, labels, weights = _text(tokenizer, row, weight)
        if max_length is not None:
            ids, labels, weights = ids[:max_length], labels[:max_length], weights[:max_length]
        return {"input_ids": ids, "labels": labels, "token_weights": weights}

    return dataset.map(one, with_indices=True, remove_columns=dataset.column_names)


def uses_token_weights(dataset: Dataset, fmt: str) -> bool:
    """Does any assistant message carry a weight of its own?"""
    if fmt != "messages":
        return False
    return any(m.get("weight") is not None for row in dataset["messages"] for m in row)
