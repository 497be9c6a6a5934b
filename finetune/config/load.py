"""Experiment files -> a validated Experiment, or a ConfigError naming YAML paths and lines.

One pass, in order: read each file safely (remembering where every key is written), merge
`extends:` bases under it, apply `a.b=value` overrides, fill the name, validate the schema,
check `training:` against the TRL class, then the cross-field rules. Imports no torch.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from finetune.config import paths, rules, trl_fields, yamltext
from finetune.config.rules import models
from finetune.config.inputs import Input, declared, mark_at
from finetune.config.methods import METHODS
from finetune.config.schema import Experiment
from finetune.config.secrets import REDACTED, is_secret, scrub
from finetune.errors import ConfigError, clip, shown

Loc = tuple  # a path into the experiment: ("training", "learning_rate") or ("data", "train", 0)
# The settings that name a model directory or hub id: a near miss beside the file is named.
MODEL_INPUTS = tuple(loc for loc, mark in declared(Experiment).items()
                     if isinstance(mark, Input) and mark.kind in ("model", "teacher"))
MAX_FILES = 64  # files one experiment reads, itself and its bases, counted each time read


def parse_scalar(text: str, where: str = "command line",
                 budget: yamltext.Budget | None = None) -> Any:
    """Type a command-line value the way YAML would."""
    return yamltext.compose(text, where, budget)[1] if text.strip() else None


def dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, str) and not part.isprintable():
            part = repr(part)  # a key with a newline must not break the one-line error
        if isinstance(part, str):
            part = clip(part)  # a 10 kB key is named, not echoed
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _Origins:
    """Where each key was last written: loc -> 'file:line' or 'override'."""

    def __init__(self) -> None:
        self.where: dict[Loc, str] = {}
        # One experiment's files, bases and overrides share one bound on values and files,
        # so fanned-out `extends:` or many overrides cannot multiply the work.
        self.budget = yamltext.Budget()
        self.files_read = 0
        # a bare model name that is a near miss of a directory next to its file:
        # loc -> (value, problem), reported if no later file or override replaces it
        self.near_misses: dict[Loc, tuple[str, str]] = {}

    def of(self, loc: Loc) -> str | None:
        for end in range(len(loc), 0, -1):
            if loc[:end] in self.where:
                return self.where[loc[:end]]
        return None


def _read_yaml(path: Path, origins: _Origins, problems: list[str]) -> dict[str, Any]:
    try:
        with path.open("rb") as file:  # no further than the limit: it may be huge
            raw = file.read(yamltext.MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read experiment file: {exc.strerror}"]) from None
    node, data = yamltext.compose(yamltext.decode(raw, str(path)), str(path), origins.budget)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: an experiment file must be a mapping of sections"])

    def walk(n: yaml.Node, loc: Loc) -> None:
        if isinstance(n, yaml.MappingNode):
            seen = set()
            for key_node, value_node in n.value:
                key = key_node.value
                here = f"{path}:{key_node.start_mark.line + 1}"
                if key in seen:
                    problems.append(f"{here}: {dotted(loc + (key,))}: duplicate key")
                seen.add(key)
                origins.where[loc + (key,)] = here
                walk(value_node, loc + (key,))
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                origins.where[loc + (i,)] = f"{path}:{item.start_mark.line + 1}"
                walk(item, loc + (i,))

    walk(node, ())
    return data


def _local(value: Any, base: Path) -> Any:
    """Make a relative path absolute against the file that names it, when it is local.

    A bare relative name that exists next to the file is local; one starting with ./ or
    ../ is local whether it exists or not (validation reports it missing); anything else
    is left as written (a hub id).
    """
    if not isinstance(value, str) or not value or paths.problem(value):
        return value  # validation names what is wrong with it
    if value.startswith("~"):
        return str(Path(value).expanduser())
    if Path(value).is_absolute():
        return value
    candidate = base / value
    if value.startswith(("./", "../")) or paths.exists(candidate):
        return str(paths.resolve(candidate))
    return value


def is_input_path(loc: Loc) -> bool:
    """Does the key at loc (an experiment file as written) name an input resolved against
    the YAML file? The schema's types say (config/inputs.py)."""
    mark = mark_at(Experiment, loc)
    return isinstance(mark, Input) and mark.relative_to == "yaml"


def _resolve(value: Any, loc: Loc, base: Path) -> Any:
    """Input paths are relative to the YAML file that names them (outputs: to the CWD).
    An inline chat template is text, not a path; of 'file.py:function' the file is."""
    if isinstance(value, dict):
        return {k: _resolve(v, loc + (k,), base) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, loc + (i,), base) for i, v in enumerate(value)]
    if not isinstance(value, str) or not is_input_path(loc):
        return value
    kind = mark_at(Experiment, loc).kind
    if kind == "template" and ("{{" in value or "{%" in value):
        return value
    if kind == "data" and value.lower().endswith(rules.DATA_SUFFIXES) and \
            not Path(value).is_absolute() and not value.startswith("~") and \
            not paths.problem(value):
        # A data file by its suffix, never a hub dataset id: missing, it is named where it
        # was looked for (next to the YAML file), with the file beside it it may mean.
        return str(paths.resolve(base / value))
    if kind == "code":
        if ".py:" not in value:
            return value  # an importable module
        file, _, function = value.rpartition(":")  # a file of reward functions
        return f"{_local(file, base)}:{function}"
    return _local(value, base)


def _get(data: Any, loc: Loc) -> Any:
    for key in loc:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _load_file(path: Path, origins: _Origins, problems: list[str],
               chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """`chain`: the files that extend this one, as written (a symlink named as such)."""
    where = f"{chain[-1]}: extends: " if chain else ""
    bad = paths.problem(str(path))
    if bad:
        raise ConfigError([f"{where}{shown(str(path))}: {bad}"])
    written = Path(os.path.abspath(path.expanduser()))
    path = paths.resolve(written)
    if path in [paths.resolve(p) for p in chain]:
        # named as written, a symlink followed by its target: a.yaml -> b.yaml -> a.yaml
        loop = " -> ".join(str(p) if paths.resolve(p) == p else f"{p} -> {paths.resolve(p)}"
                           for p in chain + (written,))
        raise ConfigError([f"{where}loop: {loop}"])
    if not paths.is_file(path):
        links = paths.link_loop(written)
        if links:
            raise ConfigError([f"{where}{written}: a symlink loop: "
                               f"{' -> '.join(map(str, links))}"])
        raise ConfigError([f"{where}{path}: no such experiment file"])
    origins.files_read += 1
    if origins.files_read > MAX_FILES:
        raise ConfigError([f"{where}{path}: more than {MAX_FILES} experiment files read "
                           "through extends: (a base named many times is read each time)"])
    data = _read_yaml(path, origins, problems)
    for loc in MODEL_INPUTS:
        value = _get(data, loc)
        hint = models.near_miss(value, path.parent) if isinstance(value, str) else None
        if hint:
            origins.near_misses[loc] = (value, hint)
    data = _resolve(data, (), path.parent)
    parents = data.pop("extends", None)
    if parents is None:
        return data
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError([f"{path}: extends: expected a file name or a list of them"])
    # Bases are read first so the file's own keys (and their line numbers) win.
    own = dict(origins.where)
    merged: dict[str, Any] = {}
    for parent in parents:
        merged = _merge(merged, _load_file(path.parent / parent, origins, problems,
                                           chain + (written,)))
    origins.where.update(own)
    return _merge(merged, data)


def _named(override: str) -> str:
    """How an override is named in errors: never a secret's value (also when the `=` was
    mistyped: `training.hub_token:hf_...`), never more than a line."""
    key, equals, _ = override.partition("=")
    if not equals:
        key = re.split(r"[^\w.]", override, maxsplit=1)[0]
    if any(is_secret(word) for word in re.split(r"[^\w]+", key if equals else override)):
        override = f"{key}={REDACTED}" if equals else f"{key}...{REDACTED}"
    return clip(override)


def apply_override(data: dict[str, Any], override: str, origins: _Origins) -> None:
    shown = _named(override)
    if "=" not in override:
        raise ConfigError([f"override {shown!r}: expected key.sub=value"])
    key, _, text = override.partition("=")
    override = shown  # how it is named in errors
    # ASCII digits only: str.isdigit() is also true for '²' and '٣', which int() refuses.
    parts: list[Any] = [int(p) if p.isascii() and p.isdigit() else p
                        for p in key.strip().split(".")]
    if not all(str(p) for p in parts):
        raise ConfigError([f"override {override!r}: empty key segment"])
    value = _resolve(parse_scalar(text, f"override {override!r}", origins.budget), tuple(parts),
                     Path.cwd())
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            raise ConfigError([f"override {override!r}: {dotted(tuple(parts[:i + 1]))} "
                               "is not a section"])
    last = parts[-1]
    if isinstance(node, list) and isinstance(last, int) and last < len(node):
        node[last] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError([f"override {override!r}: {dotted(tuple(parts[:-1]))} is not a section"])
    origins.where[tuple(parts)] = "command line"


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _submodel(arg)
        if found:
            return found
    return None


def _fields_at(loc: Loc) -> list[str]:
    """Field names of the section that holds the key at loc (for suggestions)."""
    model: type[BaseModel] | None = Experiment
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        model = _submodel(field.annotation) if field else None
    return list(model.model_fields) if model else []


def _describe(error: dict[str, Any]) -> str:
    kind, loc = error["type"], error["loc"]
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(str(loc[-1]), _fields_at(loc), n=1)
        return "unknown key" + (f", did you mean {close[0]}?" if close else "")
    if kind == "missing":
        return "required, but missing"
    message = error["msg"]
    if kind == "value_error":  # our own validators: their message, without pydantic's prefix
        message = str(error["ctx"]["error"])
    secret = any(isinstance(part, str) and is_secret(part) for part in loc)
    got = shown(error.get("input"))
    if "input" in error and kind not in ("model_type", "dict_type") and not secret and \
            got not in message:
        message += f" (got {got})"
    return message


def _problem(origins: _Origins, loc: Loc, message: str, default: str) -> str:
    where = origins.of(loc) or default
    return f"{where}: {dotted(loc)}: {message}"


def _training_fields_at_top(data: dict[str, Any], method: Any, origins: _Origins,
                            default: str) -> list[str]:
    """A flat, TRL-style file (learning_rate, num_train_epochs... at the top) gets one hint
    naming those keys, taken out so they are not each an unknown key. Which keys: the
    method's config class's fields (any method's when the method is not known)."""
    known = [method] if isinstance(method, str) and method in METHODS else list(METHODS)
    fields = {name for m in known for name in trl_fields.fields_of(m)}
    top = [key for key in data if isinstance(key, str) and key not in Experiment.model_fields
           and key in fields]
    moved = [key for key in top if key not in trl_fields.OWNED]
    problems = [f"{origins.of((moved[0],)) or default}: {', '.join(moved)}: these are "
                "`training:` fields: move them under `training:`"] if moved else []
    problems += [_problem(origins, (key,), "unknown key: finetune sets it from "
                          f"`{trl_fields.OWNED[key]}`", default)
                 for key in top if key in trl_fields.OWNED]
    for key in top:
        del data[key]
    return problems


def load_experiment(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Experiment:
    try:
        return _load_experiment(Path(path), overrides)
    except ConfigError as exc:  # an override or a path may carry credentials
        raise ConfigError([scrub(problem) for problem in exc.problems]) from None


def _load_experiment(path: Path, overrides: list[str] | tuple[str, ...]) -> Experiment:
    origins = _Origins()
    problems: list[str] = []
    data = _load_file(path, origins, problems)
    for override in overrides:
        apply_override(data, override, origins)
    data.setdefault("name", path.stem)
    for loc, (value, hint) in origins.near_misses.items():
        if _get(data, loc) == value:  # not replaced by an override or a later file
            problems.append(_problem(origins, loc, hint, str(path)))
    method = data.get("method")
    problems += _training_fields_at_top(data, method, origins, str(path))
    # The training section is checked even when the schema fails, so every problem of
    # the file is reported in one go.
    training = data.get("training")
    if isinstance(method, str) and method in METHODS and \
            isinstance(training, dict):
        data["training"], training_problems = trl_fields.check_training(method, training)
        problems += [_problem(origins, ("training", key), msg, str(path))
                     for key, msg in training_problems]
    try:
        experiment = Experiment.model_validate(data)
    except ValidationError as exc:
        problems += [_problem(origins, tuple(err["loc"]), _describe(err), str(path))
                     for err in exc.errors()]
    if problems:
        raise ConfigError(problems)
    problems = [_problem(origins, loc, msg, str(path)) for loc, msg in rules.check(experiment)]
    if problems:
        raise ConfigError(problems)
    return experiment
