"""Default values of a transformers config class, read from the installed transformers'
source without importing it (the estimator stays torch-free). A published config.json
often leaves out what equals the default (llava-hf's text_config names only what differs
from LlamaConfig), and transformers fills those in from the class: so must we, from the
same class, never from a copy that could fall behind."""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Any

from finetune.errors import ConfigError


def _class_body(module: str, class_name: str, what: str) -> list[ast.stmt]:
    """The body of `class_name` in transformers/models/<module>, parsed from the source."""
    spec = importlib.util.find_spec("transformers")  # finds the package, imports nothing
    if spec is None or spec.origin is None:
        raise ConfigError([f"the estimator reads {what} defaults from transformers' source, "
                           "and transformers is not installed"])
    source = Path(spec.origin).parent / "models" / module
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return node.body
    raise RuntimeError(f"{source} defines no {class_name}: transformers changed; update "
                       "finetune/estimate/defaults.py")


@functools.cache
def config_defaults(module: str, class_name: str) -> dict[str, Any]:
    """{field: default} of `class_name` in transformers/models/<module>, for the fields
    whose default is a literal (`hidden_size: int = 4096`)."""
    found = {}
    for item in _class_body(module, class_name, "config"):
        if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                and item.value is not None):
            try:
                found[item.target.id] = ast.literal_eval(item.value)
            except ValueError:  # a computed default: not one the estimate reads
                pass
    return found


def with_defaults(config: dict[str, Any], module: str, class_name: str) -> dict[str, Any]:
    """config.json's values over the class's defaults, as transformers reads them. A
    default of None is left out: the config class computes that one (llama's
    num_key_value_heads = num_attention_heads), and so does the estimator's reader."""
    defaults = {key: value for key, value in config_defaults(module, class_name).items()
                if value is not None}
    return {**defaults, **config}


def _constant(node: ast.AST) -> Any:
    """A literal, or arithmetic of literals (`56 * 56`), as a class body writes a default."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add, ast.Sub)):
        left, right = _constant(node.left), _constant(node.right)
        return {ast.Mult: left * right, ast.Add: left + right,
                ast.Sub: left - right}[type(node.op)]
    if isinstance(node, ast.Dict):
        return {_constant(k): _constant(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


@functools.cache
def class_attribute(module: str, class_name: str, name: str) -> Any:
    """A class attribute's value in transformers/models/<module> (`size = {...}` of an
    image processor), read from the source as config_defaults reads a config's."""
    for item in _class_body(module, class_name, "processor"):
        if (isinstance(item, ast.Assign) and len(item.targets) == 1
                and isinstance(item.targets[0], ast.Name) and item.targets[0].id == name):
            return _constant(item.value)
    raise RuntimeError(f"transformers/models/{module}: no {class_name}.{name}: transformers "
                       "changed; update finetune/estimate/defaults.py")
