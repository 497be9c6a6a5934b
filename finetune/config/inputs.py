"""Which settings name a file or directory, read from the schema's own field types.

A field typed `Annotated[str, Input(kind)]` names something finetune reads; one typed
`Annotated[str, Output()]` something it writes. Inputs are relative to the YAML file that
names them (config/load.py resolves them) unless declared relative to the current
directory; outputs are relative to the current directory. The checks read the same
declaration: config/rules/ checks every `model` input for existence, hub id form and
offline use, and the fingerprint digests the local `data` inputs training reads.
tests/config/test_inputs.py fails when a setting that looks like a path is declared
neither way. Torch-free.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Iterator, Literal

from pydantic import BaseModel

Loc = tuple  # ("dpo", "ref_model"); "*" in a pattern stands for any list index

# What an input may be:
#   model       a model directory, or a hub model id
#   teacher     a model or adapter directory, a finetune run directory (its final/), or a
#               hub model id
#   data        a data file, a directory of them, or a hub dataset id
#   file        a local file
#   template    an inline Jinja template, or a local file holding one
#   code        'module:function', or 'file.py:function' (the file part is the input)
#   checkpoint  a checkpoint directory (relative to the current directory)
Kind = Literal["model", "teacher", "data", "file", "template", "code", "checkpoint"]


@dataclass(frozen=True)
class Input:
    kind: Kind
    relative_to: Literal["yaml", "cwd"] = "yaml"


@dataclass(frozen=True)
class Output:
    """A file or directory finetune writes, relative to the current directory."""


Marks = dict  # Loc -> Input | Output


def _mark(annotation: Any, metadata: list) -> Input | Output | None:
    found = [m for m in metadata if isinstance(m, (Input, Output))]
    if typing.get_origin(annotation) is typing.Annotated:
        found += [m for m in typing.get_args(annotation)[1:] if isinstance(m, (Input, Output))]
    return found[0] if found else None


def _members(annotation: Any) -> list[Any]:
    """The types a field's annotation may hold: Optional and unions split, Annotated
    unwrapped to what it annotates (its marks are read by _mark)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def _walk(model: type[BaseModel], loc: Loc, out: Marks, raw: Marks) -> None:
    for name, field in model.model_fields.items():
        here = loc + (name,)
        mark = _mark(field.annotation, list(field.metadata))
        if mark is not None:
            out[here] = raw[here] = mark
        for member in _members(field.annotation):
            if typing.get_origin(member) is list:
                (item,) = typing.get_args(member) or (Any,)
                item_mark = _mark(item, [])
                if item_mark is not None:
                    out[here + ("*",)] = raw[here + ("*",)] = item_mark
                for inner in _members(item):
                    if isinstance(inner, type) and issubclass(inner, BaseModel):
                        _walk(inner, here + ("*",), out, raw)
                        _shorthand(inner, here, out, raw)
            elif isinstance(member, type) and issubclass(member, BaseModel):
                _walk(member, here, out, raw)


def _shorthand(item: type[BaseModel], here: Loc, out: Marks, raw: Marks) -> None:
    """A list of a section with a SHORTHAND field is also written as one section (no
    list), and a bare string stands for {SHORTHAND: string}: what the YAML may hold before
    validation shapes it (DataSection's before-validator)."""
    key = getattr(item, "SHORTHAND", None)
    if key is None or here + ("*", key) not in out:
        return
    mark = out[here + ("*", key)]
    for form in (here, here + ("*",), here + (key,)):
        raw[form] = mark


@cache
def _declared(model: type[BaseModel]) -> tuple[Marks, Marks]:
    """(the marks by validated pattern, the marks by every form a file may write)."""
    out: Marks = {}
    raw: Marks = {}
    _walk(model, (), out, raw)
    return out, raw


def declared(model: type[BaseModel]) -> Marks:
    """Every path setting of the schema rooted at `model`, as validated: pattern -> mark."""
    return dict(_declared(model)[0])


def mark_at(model: type[BaseModel], loc: Loc) -> Input | Output | None:
    """The mark of the setting at `loc` of an experiment file as written (list indexes as
    ints, shorthand forms included), or None when it names no path."""
    pattern = tuple("*" if isinstance(part, int) else part for part in loc)
    return _declared(model)[1].get(pattern)


def values(experiment: BaseModel, kind: str) -> Iterator[tuple[Loc, str]]:
    """(loc, value) of every input of `kind` the validated experiment sets."""
    for pattern, mark in _declared(type(experiment))[0].items():
        if isinstance(mark, Input) and mark.kind == kind:
            yield from _at(experiment, pattern, ())


def _at(node: Any, pattern: Loc, loc: Loc) -> Iterator[tuple[Loc, str]]:
    if node is None:
        return
    if not pattern:
        if isinstance(node, str):
            yield loc, node
        return
    head, rest = pattern[0], pattern[1:]
    if head == "*":
        for i, item in enumerate(node or []):
            yield from _at(item, rest, loc + (i,))
    else:
        yield from _at(getattr(node, head, None), rest, loc + (head,))
