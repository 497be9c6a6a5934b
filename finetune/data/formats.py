"""Rows in the schemas of public datasets, converted while reading into the formats the
methods train on (data/rows.py FORMATS): alpaca and sharegpt (config/formats.py SOURCES;
sharegpt rows with images, LLaVA's, as TRL's vision rows: data/llava_rows.py), and
preference rows whose `prompt` is text while `chosen`/`rejected` are message lists.
Each conversion checks its rows first, so a bad one is reported as "FILE row N: problem";
each returns a note saying what was done, for the start summary.

The row-level pieces (format detection, the checks, one row's conversion) are plain
Python on dicts, without `datasets` at import: `finetune validate` reads rows with them
(data/scan.py) as training does."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable, Iterable

from finetune.config.formats import SHAREGPT_ROLES, SOURCES, accepted
from finetune.config.methods import method as method_record
from finetune.data import llava_rows, peer_rows
from finetune.data.images import IMAGES
from finetune.data.rows import FORMATS, Failure, _shared_turns, check_row, parsed_tools
from finetune.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset


def _text(row: dict[str, Any], field: str, optional: bool = False) -> str | None:
    value = row.get(field)
    if value is None:
        return None if optional else f"missing `{field}`"
    if not isinstance(value, str):
        return f"`{field}` must be text, got {type(value).__name__}"
    return None if optional or value.strip() else f"`{field}` is empty"


def _alpaca_problem(row: dict[str, Any], roles: dict[str, str]) -> str | None:
    for field, optional in (("instruction", False), ("input", True), ("output", False),
                            ("system", True)):
        problem = _text(row, field, optional)
        if problem:
            return problem
    return llava_rows.placeholders_problem(row, [_alpaca_user(row), row.get("system") or ""])


def _sharegpt_problem(row: dict[str, Any], roles: dict[str, str]) -> str | None:
    turns = row.get("conversations")
    if turns is None:
        return "missing `conversations`"
    if not isinstance(turns, list) or not turns:
        return "`conversations` must be a non-empty list of {from, value} turns"
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("from") is None or turn.get("value") is None:
            return f"`conversations[{i}]` must have `from` and `value`"
        if turn["from"] not in roles:
            return f"`conversations[{i}].from` is {turn['from']!r}, not a known speaker: " \
                   "map it to a role with data.roles"
        if not isinstance(turn["value"], str):
            return f"`conversations[{i}].value` must be text, got {type(turn['value']).__name__}"
    return peer_rows.tool_turns_problem(turns, roles) or \
        _text(row, "system", optional=True) or llava_rows.image_turns_problem(row, roles)


# Source formats whose files may carry pictures (`image` or `images`, `<image>` in the text).
IMAGE_SOURCES = ("alpaca", "sharegpt")
PROBLEMS = {"alpaca": _alpaca_problem, "sharegpt": _sharegpt_problem,
            "labelled_messages": peer_rows.labelled_messages_problem}


def speaker_roles(overrides: dict[str, str]) -> dict[str, str]:
    """sharegpt's `from` names -> roles: the usual ones, under data.roles."""
    return {**SHAREGPT_ROLES, **overrides}


def fit_problem(row: dict[str, Any], fmt: str, roles: dict[str, str],
                labels: list[str] | None = None) -> str | None:
    """Why a raw row is not of format fmt (a method's own or a source format), or None."""
    if fmt in SOURCES:
        return PROBLEMS[fmt](row, roles)
    return check_row(row, fmt, labels)


def _alpaca_user(row: dict[str, Any]) -> str:
    user = row["instruction"]
    if row.get("input") and row["input"].strip():
        user = f"{user}\n\n{row['input']}"  # as the Alpaca template joins them
    return user


def _alpaca_prompt(row: dict[str, Any]) -> list[dict[str, str]]:
    system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    return system + [{"role": "user", "content": _alpaca_user(row)}]


def _converted_row(row: dict[str, Any], fmt: str, target: str, roles: dict[str, str],
                   tool_fields: bool = False, vision: bool = False) -> dict[str, Any]:
    if fmt == "alpaca":
        prompt = _alpaca_prompt(row)
        answer = [{"role": "assistant", "content": row["output"]}]
        pictures = {}
        if vision:  # a file with images: TRL's vision rows, every content as parts
            prompt, answer = llava_rows.as_parts(prompt), llava_rows.as_parts(answer)
            pictures = {IMAGES: llava_rows.given_images(row)[0]}
        if target == "prompt":
            return {"prompt": prompt, **pictures}
        return {"prompt": prompt, "completion": answer, **pictures}
    if fmt == "labelled_messages":
        return peer_rows.labelled_messages_row(row)
    if vision:  # a file with images (`image` or `images`): TRL's vision rows
        return llava_rows.image_messages(row, roles)
    return {"messages": peer_rows.sharegpt_messages(row, roles, tool_fields)}


def _used_columns(fmt: str, target: str, columns: Iterable[str]) -> list[str]:
    """The columns a conversion replaces; a prompt format keeps every other column
    (grpo/ppo's reward functions read them)."""
    extra = llava_rows.IMAGE_COLUMNS if fmt in IMAGE_SOURCES and \
        llava_rows.with_images(columns) else ()  # replaced by `images`
    used = [c for c in (SOURCES[fmt][0] + ("input", "system") + extra) if c in columns]
    return [c for c in used if c != "output"] if target == "prompt" else used


def convert_row(row: dict[str, Any], fmt: str, target: str,
                roles: dict[str, str]) -> dict[str, Any]:
    """One checked row of source format fmt as `converted` makes it: other columns kept."""
    used = _used_columns(fmt, target, row)
    kept = {k: v for k, v in row.items() if k not in used}
    vision = fmt in IMAGE_SOURCES and llava_rows.with_images(row)
    return {**kept, **_converted_row(row, fmt, target, roles, vision=vision)}


def converted(label: str, ds: Dataset, fmt: str, target: str, roles: dict[str, str],
              failure: Failure) -> tuple[Dataset, str]:
    """Rows of source format fmt as rows of format target, and a note saying so."""
    check, calls, pictured = PROBLEMS[fmt], 0, 0
    vision = fmt in IMAGE_SOURCES and llava_rows.with_images(ds.column_names)
    for number, row in enumerate(ds, 1):
        problem = check(row, roles)
        if problem:
            raise DataError(failure(number, problem))
        calls += fmt == "sharegpt" and peer_rows.has_calls(row, roles)
        pictured += vision and bool(llava_rows.given_images(row)[0])
    used = _used_columns(fmt, target, ds.column_names)
    features, kept = None, {k: v for k, v in ds.features.items() if k not in used}
    if calls or vision:  # every row's messages typed alike
        from datasets import Features

        turns = ("messages",) if fmt == "sharegpt" else \
            ("prompt",) if target == "prompt" else ("prompt", "completion")
        features = Features({**kept, **llava_rows.image_messages_features(ds.features, turns)}
                            if vision else {**kept, "messages": peer_rows.messages_feature()})
    out = ds.map(lambda row: _converted_row(row, fmt, target, roles, bool(calls), vision),
                 remove_columns=used, features=features, desc=f"converting {fmt} rows")
    what = {"prompt_completion": "prompt/completion messages (instruction and input as the "
                                 "user turn, output as the assistant's)",
            "prompt": "prompts (instruction and input as the user turn; other columns kept)",
            "messages": "messages (`from` names mapped to roles)",
            "unpaired_preference": "unpaired rows (the turns before the last as the prompt, "
                                   "the last, an assistant turn, as the completion; `label` "
                                   "as given)"}[target]
    if calls:
        what += f"; in {calls} row(s) function_call turns as assistant tool calls and " \
                "observation turns as tool results (`tools` to the chat template)"
    if vision:
        one = " (`image` as a one-item `images`)" if llava_rows.IMAGE in ds.column_names else ""
        what += f"; in {pictured} row(s) with images each {llava_rows.PLACEHOLDER} " \
                f"placeholder as an image part of its turn{one}, for TRL's vision format"
    return out, f"{label}: {fmt} rows read as {what}"


def _split_prompt(row: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """One row's list prompt, and how it was found: 'shared', 'user', or a problem."""
    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    if prompt is None or not isinstance(chosen, list) or not isinstance(rejected, list) \
            or not chosen or not rejected:
        return row, "as is"  # check_row and preference_problem report these
    shared = _shared_turns(chosen, rejected)
    if shared >= 1:
        turns = chosen[:shared]
        if not any(isinstance(t, dict) and isinstance(t.get("content"), str)
                   and prompt.strip() in t["content"] for t in turns):
            return row, "`prompt` is text that none of the leading turns `chosen` and " \
                        "`rejected` share contains: give the prompt inside them or " \
                        "outside, not both differently"
        return {"prompt": turns, "chosen": chosen[shared:], "rejected": rejected[shared:]}, \
            "shared"
    if not prompt.strip():
        return row, "`prompt` is empty"
    return {"prompt": [{"role": "user", "content": prompt}], "chosen": chosen,
            "rejected": rejected}, "user"


def _as_turns(row: dict[str, Any]) -> dict[str, Any]:
    out, kind = _split_prompt(row)
    if kind == "as is":  # a row the checks refuse later; its prompt typed as the others'
        return {"prompt": None if row["prompt"] is None
                else [{"role": "user", "content": row["prompt"]}]}
    return out


def text_prompt_row(row: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """One preference row with a text `prompt` and message-list `chosen`/`rejected` as
    text_prompts makes it, or why it cannot be."""
    kind = _split_prompt(row)[1]
    if kind not in ("shared", "user", "as is"):
        return row, kind
    return {**row, **_as_turns(row)}, None


def _is_text(feature) -> bool:
    from datasets import Value

    return isinstance(feature, Value) and feature.dtype in ("string", "large_string")


def text_prompts(label: str, ds: Dataset, failure: Failure) -> tuple[Dataset, str | None]:
    """Preference rows with a text `prompt` and message-list `chosen`/`rejected` (the
    schema of most public preference sets) with the prompt as message turns: the turns
    chosen and rejected share where they share any (TRL's implicit prompt; the text
    prompt must be among them), else the text as the user turn."""
    from datasets import LargeList, List

    features = ds.features
    if "prompt" not in features or not _is_text(features["prompt"]) or \
            not isinstance(features.get("chosen"), (List, LargeList)):
        return ds, None
    how: dict[str, int] = {}
    for number, row in enumerate(ds, 1):
        kind = _split_prompt(row)[1]
        if kind not in ("shared", "user", "as is"):
            raise DataError(failure(number, kind))
        how[kind] = how.get(kind, 0) + 1
    target = features.copy()
    target["prompt"] = features["chosen"]
    out = ds.map(_as_turns, features=target, desc="preference prompts")
    said = {"shared": "the turns chosen and rejected share (TRL's implicit prompt)",
            "user": "the text as the user turn"}
    parts = [f"{said[k]} ({how[k]} row(s))" for k in said if how.get(k)]
    note = f"{label}: `prompt` given as text, `chosen`/`rejected` as messages: the prompt " \
           f"used is {' and '.join(parts)}" if parts else None
    return out, note


def unpaired(ds: Dataset, origin: str) -> Dataset:
    """Validated preference pairs as unpaired rows (kto), with TRL's own functions: the
    prompt taken from the turns chosen and rejected share where the rows give none
    (extract_prompt, as DPOTrainer takes it), then each pair as its chosen answer labelled
    true and its rejected one labelled false (unpair_preference_dataset); a row's origin
    (column `origin`) says which answer it was."""
    from trl.data_utils import extract_prompt, unpair_preference_dataset

    if "prompt" not in ds.column_names:
        ds = ds.map(extract_prompt, desc="preference prompts")
    ds = unpair_preference_dataset(ds, desc="unpairing preference pairs")
    answer = lambda row: {origin: f"{row[origin]} ({'chosen' if row['label'] else 'rejected'})"}
    return ds.map(answer, desc="unpaired rows' origins")


def no_fit(row: dict[str, Any], tried: tuple[str, ...], roles: dict[str, str],
           labels: list[str] | None) -> str:
    """'fmt: why; fmt: why' for every format tried on a raw row."""
    return "; ".join(f"{fmt}: {fit_problem(row, fmt, roles, labels) or 'fits'}"
                     for fmt in tried)


def required(fmt: str) -> tuple[str, ...]:
    """The columns a format (a method's own or a source format) needs."""
    return SOURCES[fmt][0] if fmt in SOURCES else FORMATS[fmt][0]


def names(columns: Iterable[str]) -> str:
    """Column names as the data spells them; quoted where a name would break the line."""
    return ", ".join(c if c.isprintable() else repr(c) for c in columns)


def detect_format(columns: Iterable[str], method: str, label: str) -> str:
    """The first format the method reads (its own, then those converted) whose columns
    the file has."""
    columns = set(columns)
    candidates = accepted(method_record(method).formats)
    for name in candidates:
        if set(required(name)) <= columns:
            return name
    wanted = " or ".join("/".join(required(c)) + (f" ({c})" if c in SOURCES else "")
                         for c in candidates)
    raise DataError(f"{label}: method {method} needs columns {wanted}; found "
                    f"{names(sorted(columns)) or 'none'} (rename with data.<split>[i].columns)")


def failure_text(where: str, problem: str, raw_row: Callable[[], dict[str, Any]], fmt: str,
                 forced: bool, method: str, roles: dict[str, str],
                 labels: list[str] | None) -> str:
    """A bad row's error: with `auto`, also why each other format the method reads does
    not fit the row as the file has it (raw_row gives it, only then)."""
    tried = tuple(f for f in accepted(method_record(method).formats) if f != fmt)
    text = f"{where}: {problem}"
    if "`weight`" in problem or ".weight`" in problem:
        return text  # the format fits; a weight is wrong
    if forced or not tried:
        return f"{text} (data.format {fmt})" if forced else text
    return f"{text} (read as {fmt}; tried {no_fit(raw_row(), tried, roles, labels)})"


def _without_nulls(value: Any) -> Any:
    """A JSON value without the null keys Arrow adds: a file's rows share one schema, so a
    key one row's tool schema or call has is null in every other row's."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call as templates take it: `arguments` given as JSON text (OpenAI's API
    form, and how sharegpt's function_call turns are kept) as the object it encodes."""
    function = call.get("function")
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            return call
        if isinstance(decoded, dict):
            return {**call, "function": {**function, "arguments": decoded}}
    return call


def chat_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the chat template gets it: role, content, and the tool fields it has
    (tool_calls, tool_call_id, name); not finetune's own `weight`."""
    out = {"role": message["role"], "content": message.get("content")}
    for key in ("tool_calls", "tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = _without_nulls(message[key])
    if "tool_calls" in out:
        out["tool_calls"] = [_call(c) for c in out["tool_calls"]]
    return out


def row_tools(row: dict[str, Any], where: str) -> list[dict[str, Any]] | None:
    """The row's `tools` as the chat template takes them (transformers' apply_chat_template:
    {type: function, function: schema}); a bare function schema (LLaMA-Factory's form,
    {name, description, parameters}) is wrapped so."""
    tools, problem = parsed_tools(row.get("tools"))
    if problem:
        raise DataError(f"{where}: {problem}")
    tools = _without_nulls(tools) or None
    return None if tools is None else [
        tool if "function" in tool or "type" in tool else {"type": "function", "function": tool}
        for tool in tools]
