"""Torch-free knowledge of the TRL config classes the `training:` section passes through to.

`validate` must answer in well under a second, so it cannot import trl (~6 s). The field
names and types of each class are kept in trl_fields.json, generated from the installed
classes by `python -m finetune.config.trl_fields`; a test regenerates it and compares.
When the installed trl/transformers differ from the versions it was made with, a manifest
for them is generated once (one slow import) and cached under ~/.cache/finetune.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import json
import os
import types
import typing
from importlib import metadata
from pathlib import Path
from typing import Any

from finetune.config.methods import METHODS, method as method_record
from finetune.config.secrets import is_secret
from finetune.errors import shown

MANIFEST = Path(__file__).with_name("trl_fields.json")

# Fields finetune sets itself from another section: setting them in `training:` would
# make two sources of truth, so it is an error that says where the value belongs.
OWNED: dict[str, str] = {
    "output_dir": "output.dir",
    "bf16": "precision",
    "fp16": "precision",
    "bf16_full_eval": "precision",
    "fp16_full_eval": "precision",
    "half_precision_backend": "precision",
    "use_cpu": "distributed.device",
    "deepspeed": "distributed",
    "fsdp": "distributed",
    "fsdp_config": "distributed",
    "model_init_kwargs": "model",
    "ref_model_init_kwargs": "dpo.ref_model",
    "chat_template_path": "tokenizer.chat_template",
    "resume_from_checkpoint": "resume",
    "reward_weights": "rewards.weights",
    # distill: finetune loads the teacher of distill.teacher itself.
    "teacher_model_name_or_path": "distill.teacher",
    "teacher_model_revision": "distill.teacher",
    "teacher_model_init_kwargs": "distill.teacher",
    # TRL's configs read it only where they load models themselves; finetune loads them.
    "trust_remote_code": "model.trust_remote_code",
}

# Values finetune decides itself, accepted on top of the field's own type.
FINETUNE_VALUES: dict[str, tuple[Any, ...]] = {
    # auto: off where the run's memory estimate fits the device (config/derived/effective.py)
    "activation_checkpointing": ("auto",),
}


def _versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in ("trl", "transformers")}


def _type_spec(tp: Any) -> dict[str, Any]:
    """Reduce an annotation to {"types": [...], "choices": [...] or None}."""
    atoms: set[str] = set()
    choices: list[Any] = []

    def visit(t: Any) -> None:
        origin = typing.get_origin(t)
        if t is type(None):
            atoms.add("null")
        elif origin in (typing.Union, types.UnionType):
            for arg in typing.get_args(t):
                visit(arg)
        elif origin is typing.Literal:
            for arg in typing.get_args(t):
                if arg is False or arg is True:
                    atoms.add("bool")
                elif arg is None:
                    atoms.add("null")
                else:
                    atoms.add(type(arg).__name__)
                    choices.append(arg)
        elif isinstance(t, type) and issubclass(t, enum.Enum):
            atoms.add("str")
            choices.extend(member.value for member in t)
        elif t in (bool, int, float, str):
            atoms.add(t.__name__)
        elif t is dict or origin is dict:
            atoms.add("dict")
        elif t is list or origin is list or t is tuple or origin is tuple:
            atoms.add("list")
        else:
            atoms.add("any")

    visit(tp)
    return {"types": sorted(atoms), "choices": choices or None}


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def generate() -> dict[str, Any]:
    """Build the manifest from the installed classes (imports trl: slow)."""
    import importlib

    classes = {}
    for module_name, class_name in dict.fromkeys(m.config_class for m in METHODS.values()):
        cls = getattr(importlib.import_module(module_name), class_name)
        hints = typing.get_type_hints(cls)
        fields = {}
        for field in dataclasses.fields(cls):
            if not field.init:
                continue
            spec = _type_spec(hints.get(field.name, field.type))
            if field.default is not dataclasses.MISSING:
                spec["default"] = _jsonable(field.default)
            fields[field.name] = spec
        classes[class_name] = {"module": module_name, "fields": fields}
    return {"versions": _versions(), "classes": classes}


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "finetune"


@functools.lru_cache(maxsize=1)
def load_manifest() -> dict[str, Any]:
    manifest = json.loads(MANIFEST.read_text())
    installed = _versions()
    if manifest["versions"] == installed:
        return manifest
    cached = _cache_dir() / f"trl_fields-trl{installed['trl']}-tf{installed['transformers']}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    manifest = generate()
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def _check_value(value: Any, spec: dict[str, Any], secret: bool = False) -> tuple[Any, str | None]:
    """Return (value, problem). Numbers written as strings ('1e-4') are converted.
    A secret's value is never repeated in the problem."""
    allowed = set(spec["types"])
    if "any" in allowed:
        return value, None
    if value is None:
        return value, None if "null" in allowed else "must not be null"
    if isinstance(value, bool):
        ok = "bool" in allowed
    elif isinstance(value, int):
        ok = bool(allowed & {"int", "float"})
        if ok and "int" not in allowed:
            try:
                value = float(value)
            except OverflowError:  # 10**400: past what a float holds
                return value, f"a number of {len(str(value)[:5000])} digits is too large"
    elif isinstance(value, float):
        ok = "float" in allowed or ("int" in allowed and value.is_integer() and "str" not in allowed)
        if ok and "float" not in allowed:
            value = int(value)
    elif isinstance(value, str):
        ok = "str" in allowed
        if not ok:
            for kind, parse in (("int", int), ("float", float)):
                if kind in allowed:
                    try:
                        return parse(value), None
                    except ValueError:
                        pass
    elif isinstance(value, dict):
        ok = "dict" in allowed
    elif isinstance(value, list):
        ok = "list" in allowed
    else:
        ok = False
    if not ok:
        wanted = " or ".join(t for t in spec["types"])
        echoed = "" if secret else f" {shown(value)}"
        return value, f"expected {wanted}, got {type(value).__name__}{echoed}"
    choices = spec.get("choices")
    if choices and isinstance(value, str) and value not in choices:
        close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return value, f"{shown(value)} is not one of {', '.join(map(str, choices))}{hint}"
    return value, None


def check_training(method: str, training: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Check `training:` against the method's config class.

    Returns the values with numbers converted, and (key, problem) pairs.
    """
    where = ".".join(method_record(method).config_class)
    fields = fields_of(method)
    checked: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for key, value in training.items():
        if not isinstance(key, str):
            problems.append((key, "a key must be text"))
        elif key in OWNED:
            problems.append((key, f"not set here: finetune sets it from `{OWNED[key]}`"))
        elif key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append((key, f"unknown key: not a field of {where}{hint}"))
        elif value in FINETUNE_VALUES.get(key, ()):
            checked[key] = value
        else:
            value, problem = _check_value(value, fields[key], is_secret(key))
            if problem:
                problems.append((key, f"{problem} ({where}.{key})"))
            checked[key] = value
    return checked, problems


def fields_of(method: str) -> dict[str, dict[str, Any]]:
    """The fields of the method's config class: name -> {types, choices, default}.
    Values as a run sees them are config/derived/effective.py's (finetune's defaults first)."""
    return load_manifest()["classes"][method_record(method).config_class[1]]["fields"]


if __name__ == "__main__":
    MANIFEST.write_text(json.dumps(generate(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {MANIFEST}")
