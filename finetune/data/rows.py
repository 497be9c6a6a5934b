"""What a valid row is, per format: the checks behind "FILE row N: problem" (data/load.py
reads the files and reports)."""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from finetune.config.formats import ROLES
from finetune.data.images import IMAGES, count_problem, image_parts, images_problem, \
    parts_problem

# (row number from 1, problem) -> the error's text: how a file's reader names a bad row
Failure = Callable[[int, str], str]
# format -> (required columns, optional columns)
FORMATS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "messages": (("messages",), ("tools", IMAGES)),
    "prompt_completion": (("prompt", "completion"), ("tools", IMAGES)),
    "text": (("text",), ()),
    "preference": (("chosen", "rejected"), ("prompt", IMAGES)),
    # kto: one completion, labelled desirable (true) or not (false); no partner needed.
    "unpaired_preference": (("prompt", "completion", "label"), (IMAGES,)),
    "classification": (("text", "label"), ()),
    "prompt": (("prompt",), ()),  # every other column is kept for the reward functions
}
WEIGHT = "weight"  # the per-sample weight column, whatever data.weight_column names
# A conversation's assistant turns, [start, end) in its tokens, where preparing found them
# by prefixes (methods/vision_turns.py) for the collator (TRL drops unknown columns).
SPANS = "assistant_spans"
# Weights are relative (the loss is sum(w x loss) / sum(w)); beyond this, w x loss summed
# over a batch nears float32's range (3.4e38) and the model trains to NaN.
MAX_WEIGHT = 1e6


def check_messages(value: Any, field: str) -> str | None:
    if not isinstance(value, list):
        return f"`{field}` must be a list of messages, got {type(value).__name__}"
    if not value:
        return f"`{field}` is an empty conversation"
    for i, message in enumerate(value):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not isinstance(message, dict) or "role" not in message or \
                ("content" not in message and calls is None):
            return f"`{field}[{i}]` must have `role` and `content`"
        if message["role"] not in ROLES:
            return f"`{field}[{i}].role` is {message['role']!r}; expected one of {', '.join(ROLES)}"
        if calls is not None:
            problem = _check_tool_calls(calls, f"{field}[{i}]", message["role"])
            if problem:
                return problem
        elif parts_problem(message["content"], f"{field}[{i}].content"):  # text, or parts
            return parts_problem(message["content"], f"{field}[{i}].content")
    return None


def _check_tool_calls(calls: Any, where: str, role: str) -> str | None:
    """OpenAI's assistant tool calls: [{type: function, function: {name, arguments}}]."""
    if role != "assistant":
        return f"`{where}.tool_calls` is on a {role} message; only assistant turns call tools"
    if not isinstance(calls, list) or not calls:
        return f"`{where}.tool_calls` must be a non-empty list of calls"
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return f"`{where}.tool_calls[{j}]` must have `function` with a `name`"
    return None


def parsed_tools(value: Any) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The function schemas a row offers its conversation (a list, or the list as JSON
    text; empty text is none), or the problem."""
    if isinstance(value, str):
        if not value.strip():
            return None, None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            return None, f"`tools` is text that is not JSON ({exc})"
    if value is None:
        return None, None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        return None, f"`tools` must be a list of function schemas, got {type(value).__name__}"
    return value, None


def _check_tools(value: Any) -> str | None:
    return parsed_tools(value)[1]


def _check_text_or_messages(value: Any, field: str) -> str | None:
    if isinstance(value, str):
        return None if value.strip() else f"`{field}` is empty"
    if isinstance(value, list):
        return check_messages(value, field)
    return f"`{field}` must be text or a list of messages, got {type(value).__name__}"


def _check_weight(value: Any, field: str) -> str | None:
    if value is None:
        return f"`{field}` is missing (null, empty or NaN)"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"`{field}` must be a number, got {type(value).__name__} {value!r}"
    if not math.isfinite(value) or value < 0:
        return f"`{field}` is {value}; weights must be finite and >= 0"
    if value > MAX_WEIGHT:
        return f"`{field}` is {value:g}; weights are relative (the loss is sum(w x loss) / " \
               f"sum(w)) and at most {MAX_WEIGHT:,.0f}: scale them down"
    return None


# PaliGemma on conversations (config/rules/vision.py PREFIX_LM), said by validate
# (scan.py) and training (methods/sft_vision.py).
PREFIX_LM_ROWS = ("data.train: PaliGemma trains on plain `prompt`/`completion` rows with "
                  "`images` (its prefix and suffix, e.g. \"caption en\" and the caption), "
                  "not on conversations: its prefix attention would let every token of a "
                  "conversation see the ones after it")
# Training's vision path (methods/sft_vision.py) finds an assistant turn as a run of
# trained tokens; validate says it too (scan.py), for a local vision-language model.
TURN_WEIGHTS_WITH_IMAGES = "data.train: `weight` on messages (per-turn loss weights) for a " \
    "vision-language model needs training.assistant_only_loss (its turns are found as the " \
    "runs of trained tokens); leave it unset or true"


def turn_weighted(row: dict[str, Any]) -> bool:
    """Does a checked conversation weigh any of its turns (a message's `weight`)?"""
    return any(isinstance(m, dict) and m.get("weight") is not None
               for m in row.get("messages") or ())


def _check_turn_weights(messages: list[dict[str, Any]]) -> str | None:
    for i, message in enumerate(messages):
        if message.get("weight") is None:
            continue
        if message["role"] != "assistant":
            return f"`messages[{i}].weight` is on a {message['role']} message; only " \
                   "assistant turns are trained"
        problem = _check_weight(message["weight"], f"messages[{i}].weight")
        if problem:
            return problem
    return None


def _check_label(value: Any, labels: list[str]) -> str | None:
    if isinstance(value, str):
        return None if value in labels else \
            f"`label` {value!r} is not one of classify.labels ({', '.join(labels)})"
    if isinstance(value, bool) or not isinstance(value, int):
        return f"`label` must be a class name or index, got {type(value).__name__} {value!r}"
    return None if 0 <= value < len(labels) else \
        f"`label` {value} is out of range for {len(labels)} classes"


def check_row(row: dict[str, Any], fmt: str, labels: list[str] | None = None) -> str | None:
    required, optional = FORMATS[fmt]
    for field in required:
        if row.get(field) is None:
            return f"missing `{field}`"
    if WEIGHT in row:
        problem = _check_weight(row[WEIGHT], WEIGHT)
        if problem:
            return problem
    if fmt in ("messages", "prompt_completion") and _check_tools(row.get("tools")):
        return _check_tools(row.get("tools"))
    if fmt == "messages":
        problem = check_messages(row["messages"], "messages")
        if problem is None and not any(m["role"] == "assistant" for m in row["messages"]):
            problem = "no assistant message to learn from"
        return problem or _check_turn_weights(row["messages"]) or images_problem(row)
    if fmt == "classification":
        if not isinstance(row["text"], str) or not row["text"].strip():
            return "`text` must be a non-empty string"
        return _check_label(row["label"], labels or [])
    if fmt == "text":
        if not isinstance(row["text"], str):
            return f"`text` must be a string, got {type(row['text']).__name__}"
        return None if row["text"].strip() else "`text` is empty"
    if fmt == "unpaired_preference" and not isinstance(row["label"], bool):
        return f"`label` must be true (a desirable completion) or false (an undesirable " \
               f"one), got {type(row['label']).__name__} {row['label']!r}"
    fields = [f for f in required + optional
              if row.get(f) is not None and f not in ("tools", "label", IMAGES)]
    for field in fields:
        problem = _check_text_or_messages(row[field], field)
        if problem:
            return problem
    if len({type(row[f]) for f in fields}) > 1:
        return f"mixes plain text and message lists across {', '.join(fields)}"
    if fmt == "prompt":
        return _prompt_images_problem(row)
    if fmt in ("unpaired_preference", "prompt_completion"):
        return _completion_images_problem(row)
    return _preference_images_problem(row) if fmt == "preference" else None


def _prompt_images_problem(row: dict[str, Any]) -> str | None:
    """A prompt's pictures, as GRPOTrainer reads them: one file per image part of the
    prompt (or all at the start of its first user turn, when its turns are text)."""
    images = row.get(IMAGES)
    if not isinstance(row["prompt"], list):
        return "`images` needs a conversational `prompt` (a list of messages): a text " \
               "prompt has no place for a picture" if images else None
    return count_problem(images, row["prompt"], "prompt")


def _completion_images_problem(row: dict[str, Any]) -> str | None:
    """A prompt/completion row's pictures (sft; kto's unpaired rows), as the collators
    read them: the prompt's, none in the completion; a plain prompt (sft) places them
    with its own placeholders, which its model's processor counts while the data are
    prepared (methods/sft_plain_vision.py)."""
    if isinstance(row["completion"], list) and image_parts(row["completion"]):
        return "an image part in `completion`: pictures belong to the prompt (the " \
               "collators give them to the prompt only)"
    if isinstance(row["prompt"], str) and "label" not in row:
        return count_problem(row.get(IMAGES), [], "prompt")
    return _prompt_images_problem(row)


def _preference_images_problem(row: dict[str, Any]) -> str | None:
    """A pair's pictures, as TRL's DataCollatorForVisionPreference reads them: the images
    go to the prompt (given, or the turns chosen and rejected share), one file per image
    part there (or all at the start of its first user turn, when its turns are text);
    the answers have no image parts. Conversations only: the image parts place them."""
    images = row.get(IMAGES)
    if not isinstance(row["chosen"], list):
        return "`images` needs conversational rows (`prompt`, `chosen` and `rejected` as " \
               "lists of messages): text rows have no place for a picture" if images else None
    if row.get("prompt") is not None:
        prompt, answers = row["prompt"], (row["chosen"], row["rejected"])
    else:
        shared = _shared_turns(row["chosen"], row["rejected"])
        prompt = row["chosen"][:shared]
        answers = (row["chosen"][shared:], row["rejected"][shared:])
    for key, turns in zip(("chosen", "rejected"), answers):
        if image_parts(turns):
            return f"an image part in the answer of `{key}`: pictures belong to the prompt " \
                   "(TRL's preference collator gives them to the prompt only)"
    field = "prompt" if row.get("prompt") is not None else "the prompt turns chosen and rejected share"
    return count_problem(images, prompt, field)


def _shared_turns(chosen: list, rejected: list) -> int:
    """The prompt TRL's extract_prompt takes from a dpo row without `prompt`: the turns
    chosen and rejected share, but at most all but the last of the shorter one."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    return min(shared, min(len(chosen), len(rejected)) - 1)


def preference_problem(row: dict[str, Any], has_prompt: bool, shared_prompt: bool) -> str | None:
    """Across a file's preference rows: `prompt` on every row or on none (DPOTrainer
    fails on a null one among them, reward would read it as empty); and, for a method
    whose prompt is otherwise the leading turns chosen and rejected share
    (shared_prompt: dpo), they share one."""
    if has_prompt and row.get("prompt") is None:
        return "`prompt` is missing (null) while other rows of this file have one: give " \
               "every row a prompt, or none"
    if shared_prompt and not has_prompt and isinstance(row["chosen"], list) and \
            _shared_turns(row["chosen"], row["rejected"]) < 1:
        return "`chosen` and `rejected` share no leading turn: without `prompt`, both must " \
               "start with the same prompt turns (dpo takes those as the prompt); or give " \
               "`prompt`"
    return None
