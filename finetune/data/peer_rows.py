"""Rows as other tools write them, read as their authors mean them: OpenAI's content parts
(`content: [{type: text, text}]`), LLaMA-Factory's sharegpt tool-call turns
(function_call, observation), its preference rows whose `chosen` and `rejected` are one
message each, and its kto rows (a conversation and a boolean label).
Each function takes one row and gives it in a format the methods train on, or the
problem ("FILE row N: problem" once the caller names the row); data/load.py applies them
to a file's dataset and data/scan.py to validate's rows, so both judge a row alike.

Plain Python on dicts, without `datasets` at import (validate's data pass uses them)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from finetune.data.images import IMAGES
from finetune.data.rows import Failure, check_messages
from finetune.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset

# The columns whose messages may give their content as parts.
MESSAGE_FIELDS = ("messages", "prompt", "completion", "chosen", "rejected")
# Part types a text model reads (joined as text). Rows with `images` keep their parts: a
# vision-language model's processor renders them (data/images.py).
KEPT_PARTS = ("text",)


def _joined_parts(parts: list, where: str) -> tuple[str | None, str | None]:
    """Content parts as one text, joined with "\\n" as vLLM joins them; or the problem."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind is None:
            return None, f"`{where}[{j}]` must be a content part {{type, ...}}"
        if kind not in KEPT_PARTS:
            return None, f"`{where}[{j}]` is a part of type {kind!r}: this model and data " \
                         "format take text parts only"
        if not isinstance(part.get("text"), str):
            return None, f"`{where}[{j}]` is a text part without `text`"
        texts.append(part["text"])
    return "\n".join(texts), None


def _message_text(message: Any, where: str) -> tuple[Any, bool, str | None]:
    """A message with list content as text: (message, changed, problem)."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message, False, None
    text, problem = _joined_parts(message["content"], f"{where}.content")
    return ({**message, "content": text} if problem is None else message), True, problem


def text_parts_row(row: dict[str, Any]) -> tuple[dict[str, Any], int, str | None]:
    """The row with every message's content parts joined as text; how many messages had
    parts; the problem (a part that is not text). A row with `images` is left as it is."""
    if IMAGES in row:
        return row, 0, None
    out, changed = dict(row), 0
    for field in MESSAGE_FIELDS:
        value, problem = row.get(field), None
        if isinstance(value, dict):  # one message (LLaMA-Factory's chosen/rejected)
            out[field], was, problem = _message_text(value, field)
            changed += was
        elif isinstance(value, list):
            messages = []
            for i, message in enumerate(value):
                message, was, problem = _message_text(message, f"{field}[{i}]")
                changed += was
                if problem:
                    break
                messages.append(message)
            out[field] = messages if problem is None else value
        else:
            continue
        if problem:
            return row, 0, problem
    return out, changed, None


# LLaMA-Factory's sharegpt speaker of an assistant's tool call(s): `value` is the call,
# {name, arguments}, or a list of them, as JSON text.
CALL_SPEAKER = "function_call"


def _calls(value: str) -> tuple[list[dict[str, Any]] | None, str | None]:
    """A function_call turn's value as OpenAI tool calls, `arguments` kept as JSON text
    (Arrow gives a file one schema: each call's own argument types would not fit it);
    data/formats.py chat_message gives the template the object."""
    try:
        decoded = json.loads(value)
    except json.JSONDecodeError as exc:
        return None, f"is not JSON ({exc.msg}); a function_call turn is a call " \
                     "{name, arguments} or a list of them"
    calls = []
    for call in decoded if isinstance(decoded, list) else [decoded]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or \
                not call["name"]:
            return None, "must be a call {name, arguments} or a list of them: a call " \
                         "without `name`"
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return None, f"has call {call['name']!r} whose `arguments` is not an object"
        calls.append({"type": "function", "function": {
            "name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
    return (calls, None) if calls else (None, "is an empty list of calls")


def _is_call(turn: dict[str, Any], roles: dict[str, str]) -> bool:
    return turn.get("from") == CALL_SPEAKER and roles.get(CALL_SPEAKER) == "assistant"


def tool_turns_problem(turns: list[dict[str, Any]], roles: dict[str, str]) -> str | None:
    """Why a sharegpt conversation's function_call turns are not tool calls, or None."""
    for i, turn in enumerate(turns):
        if _is_call(turn, roles):
            problem = _calls(turn["value"])[1]
            if problem:
                return f"`conversations[{i}].value` (a function_call turn) {problem}"
    return None


def has_calls(row: dict[str, Any], roles: dict[str, str]) -> bool:
    return any(_is_call(t, roles) for t in row["conversations"])


TOOL_FIELDS = ("role", "content", "tool_calls", "name")


def messages_feature():
    """The `messages` of sharegpt rows with tool calls, typed for every row alike."""
    from datasets import List, Value

    text = Value("string")
    call = {"type": text, "function": {"name": text, "arguments": text}}
    return List({"role": text, "content": text, "tool_calls": List(call), "name": text})


def sharegpt_messages(row: dict[str, Any], roles: dict[str, str],
                      tool_fields: bool = False) -> list[dict[str, Any]]:
    """A checked sharegpt conversation as messages: a function_call turn as an assistant
    message with `tool_calls`, an observation (a tool turn) with the `name` of the call
    it answers (the calls of the turn before, in order). tool_fields: every message with
    every key of messages_feature."""
    system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    messages, pending = [], []
    for turn in row["conversations"]:
        message = {"role": roles[turn["from"]], "content": turn["value"]}
        if _is_call(turn, roles):
            calls = _calls(turn["value"])[0]
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            pending = [c["function"]["name"] for c in calls]
        elif message["role"] == "tool" and pending:
            message["name"] = pending.pop(0)
        messages.append(message)
    messages = system + messages
    return [{k: m.get(k) for k in TOOL_FIELDS} for m in messages] if tool_fields else messages


def _joins_input(columns: dict[str, str]) -> bool:
    """Does a hand column mapping read alpaca's `instruction` as the prompt, leaving its
    `input` unmapped (data.<split>[i].columns)?"""
    return columns.get("prompt") == "instruction" and "input" not in columns and \
        "input" not in columns.values()


def alpaca_input_row(row: dict[str, Any],
                     columns: dict[str, str]) -> tuple[dict[str, Any], bool, str | None]:
    """A row whose mapped prompt is alpaca's instruction, its non-empty `input` joined after
    a blank line as alpaca does (data/formats.py reads unmapped alpaca rows so): (row,
    joined, problem)."""
    value = row.get("input")
    if not _joins_input(columns) or value is None or (isinstance(value, str)
                                                       and not value.strip()):
        return row, False, None
    if not isinstance(value, str):
        return row, False, f"`input` must be text, got {type(value).__name__}"
    if not isinstance(row.get("prompt"), str):
        return row, False, "`input` is not empty and the prompt (columns: {prompt: " \
                           "instruction}) is not text to join it to: map `input` too"
    kept = {k: v for k, v in row.items() if k != "input"}
    return {**kept, "prompt": f"{row['prompt']}\n\n{value}"}, True, None


def _one_message(value: Any, field: str, roles: dict[str, str]) -> tuple[Any, str | None]:
    """A single {role, content} or {from, value} message as OpenAI's {role, content}."""
    if isinstance(value, dict) and value.get("from") is not None:
        if value["from"] not in roles:
            return None, f"`{field}.from` is {value['from']!r}, not a known speaker: map it " \
                         "to a role with data.roles"
        value = {"role": roles[value["from"]], "content": value.get("value")}
    if not isinstance(value, dict) or value.get("role") is None or \
            not isinstance(value.get("content"), str):
        return None, f"`{field}` must be one message ({{role, content}} or {{from, value}})"
    return {"role": value["role"], "content": value["content"]}, None


def _prompt_turns(row: dict[str, Any], roles: dict[str, str]) -> tuple[Any, str | None]:
    """The prompt of a row whose answers are single messages: `prompt` as given, else
    sharegpt's `conversations` (with its `system`), else `messages`."""
    if row.get("prompt") is not None:
        return row["prompt"], None
    if row.get("conversations") is not None:
        turns = row["conversations"]
        if not isinstance(turns, list) or not turns:
            return None, "`conversations` must be a non-empty list of {from, value} turns"
        prompt = [{"role": "system", "content": row["system"]}] if row.get("system") else []
        for i, turn in enumerate(turns):
            message, problem = _one_message(turn, f"conversations[{i}]", roles)
            if problem:
                return None, problem
            prompt.append(message)
        return prompt, None
    if row.get("messages") is not None:
        return row["messages"], None
    return None, "`chosen` and `rejected` are single messages, and the row gives no prompt " \
                 "before them (`prompt`, `conversations` or `messages`)"


# The columns a row with single-message answers may give its prompt in, consumed by it.
PROMPT_SOURCES = ("conversations", "system", "messages")


def single_answers_row(row: dict[str, Any],
                       roles: dict[str, str]) -> tuple[dict[str, Any], bool, str | None]:
    """A preference row whose `chosen` and `rejected` are one message each (LLaMA-Factory's
    dpo rows) as message lists after its prompt: (row, converted, problem)."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if not isinstance(chosen, dict) and not isinstance(rejected, dict):
        return row, False, None
    if not isinstance(chosen, dict) or not isinstance(rejected, dict):
        return row, False, "`chosen` and `rejected` must both be one message or both lists"
    answers = {}
    for field, value in (("chosen", chosen), ("rejected", rejected)):
        answers[field], problem = _one_message(value, field, roles)
        if problem:
            return row, False, problem
    prompt, problem = _prompt_turns(row, roles)
    if problem:
        return row, False, problem
    kept = {k: v for k, v in row.items() if k not in PROMPT_SOURCES}
    return {**kept, "prompt": prompt, "chosen": [answers["chosen"]],
            "rejected": [answers["rejected"]]}, True, None


def labelled_messages_problem(row: dict[str, Any], roles: dict[str, str]) -> str | None:
    """Why a kto row given as a conversation and a label (LLaMA-Factory's) is not one."""
    messages = row.get("messages")
    if messages is None:
        return "missing `messages`"
    problem = check_messages(messages, "messages")
    if problem:
        return problem
    if messages[-1]["role"] != "assistant":
        return f"the last turn of `messages` is {messages[-1]['role']!r}: kto takes the " \
               "last turn, an assistant's, as the completion to label"
    if len(messages) < 2:
        return "`messages` has no turn before its last assistant turn to prompt it"
    return None


def labelled_messages_row(row: dict[str, Any]) -> dict[str, Any]:
    """A checked kto conversation as an unpaired row: the turns before the last as the
    prompt, the last (an assistant turn) as the completion; the label as given."""
    messages = row["messages"]
    return {"prompt": messages[:-1], "completion": messages[-1:], "label": row.get("label")}


def _plain_text(feature) -> bool:
    """A column whose messages' content is text in every row (so no row has parts)."""
    from datasets import LargeList, List, Value

    if isinstance(feature, Value):
        return True
    inner = feature.feature if isinstance(feature, (List, LargeList)) else feature
    return isinstance(inner, dict) and \
        inner.get("content") in (Value("string"), Value("large_string"))


def _changed_rows(rows, convert, failure: Failure) -> int:
    """How many rows a row conversion (row -> (row, changed, problem)) changes; every row
    checked first, the first problem the error naming its row."""
    changed = 0
    for number, row in enumerate(rows, 1):
        _, was, problem = convert(row)
        if problem:
            raise DataError(failure(number, problem))
        changed += was
    return changed


def text_parts(label: str, ds: Dataset, failure: Failure) -> tuple[Dataset, str | None]:
    """A file's rows with their messages' content parts joined as text, and a note; a file
    with `images` keeps its parts for a vision-language model's processor."""
    if IMAGES in ds.column_names:
        return ds, None
    fields = [f for f in MESSAGE_FIELDS
              if f in ds.column_names and not _plain_text(ds.features[f])]
    if not fields:
        return ds, None
    joined = _changed_rows(ds.select_columns(fields), text_parts_row, failure)
    if not joined:
        return ds, None
    out = ds.map(lambda row: text_parts_row({f: row[f] for f in fields})[0],
                 desc="content parts as text")
    return out, f"{label}: {joined} message(s) gave their content as parts " \
                "([{type: text, text}]): read as their texts joined by newlines"


def single_answers(label: str, ds: Dataset, roles: dict[str, str],
                   failure: Failure) -> tuple[Dataset, str | None]:
    """Preference rows whose `chosen` and `rejected` are one message each, as message lists
    after the prompt the row gives (single_answers_row), and a note."""
    from datasets import LargeList, List

    if all(isinstance(ds.features.get(f), (List, LargeList)) for f in ("chosen", "rejected")):
        return ds, None
    converted = _changed_rows(ds, lambda row: single_answers_row(row, roles), failure)
    if not converted:
        return ds, None
    consumed = [c for c in PROMPT_SOURCES if c in ds.column_names]
    given = "/".join(f"`{c}`" for c in ("prompt",) + PROMPT_SOURCES[:1] + PROMPT_SOURCES[2:]
                     if c in ds.column_names)
    out = ds.map(lambda row: single_answers_row(row, roles)[0], remove_columns=consumed,
                 desc="single-message answers")
    return out, f"{label}: `chosen`/`rejected` given as one message each ({converted} " \
                f"row(s)): read as one-message answers after the prompt ({given})"


def alpaca_input(label: str, ds: Dataset, columns: dict[str, str],
                 failure: Failure) -> tuple[Dataset, str | None]:
    """Rows whose prompt is alpaca's instruction by a hand mapping, with `input` joined to
    it (alpaca_input_row), and a note."""
    if "input" not in ds.column_names or not _joins_input(columns):
        return ds, None
    joined = _changed_rows(ds.select_columns(["prompt", "input"]),
                           lambda row: alpaca_input_row(row, columns), failure)
    if not joined:
        return ds, None
    out = ds.map(lambda row: {"prompt": alpaca_input_row(row, columns)[0]["prompt"]},
                 remove_columns=["input"], desc="alpaca inputs")
    return out, f"{label}: columns maps `prompt` from alpaca's `instruction`: the `input` of " \
                f"{joined} row(s) joined to it after a blank line, as alpaca does"
