"""Whether a model carries a state along the sequence (Mamba's, Gated DeltaNet's, RWKV's,
...): such a model's recurrent layers read a flattened batch (padding-free rows, packing)
as one sequence, and transformers' PyTorch code for them (what runs unless kernels such
as flash-linear-attention or mamba-ssm are installed) passes the state from one row to the
next: a tiny Qwen3.5's second packed row came out 0.04 off in its logits, a Falcon-H1's
0.002, a Llama's 1e-7 (tests/test_stateful.py). So their rows are padded, and packing
them is refused.

transformers marks these models `_is_stateful = True`. Told without importing torch
(validate is torch-free), the way config/vision.py reads the model mapping: the model
types whose modeling file says so, read from the installed transformers' source; at
training, the loaded model's own attribute (methods/sft.py)."""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

from finetune.config import vision

MARK = b"_is_stateful = True"
MODEL_TYPE = re.compile(r'^\s+model_type\s*=\s*"([\w-]+)"', re.M)


@functools.cache
def stateful_model_types() -> frozenset[str]:
    """Every model type of a transformers model directory whose modeling code marks a
    model stateful (its text, vision and audio sub-types alike)."""
    spec = importlib.util.find_spec("transformers")  # finds the package, imports nothing
    if spec is None or spec.origin is None:
        return frozenset()
    types: set[str] = set()
    for modeling in (Path(spec.origin).parent / "models").glob("*/modeling_*.py"):
        if MARK in modeling.read_bytes():
            for config in modeling.parent.glob("configuration_*.py"):
                types.update(MODEL_TYPE.findall(config.read_text(encoding="utf-8")))
    return frozenset(types)


def stateful_type(name_or_path: str) -> str | None:
    """The model type of a local model whose config.json names a stateful one, else None
    (a hub id: the training process asks the loaded model)."""
    found = vision.model_type(name_or_path)
    return found if found in stateful_model_types() else None


def refusal(model_type: str) -> str:
    """Why packing or padding-free rows are refused for this model (one line)."""
    return (f"not for model type {model_type}: it carries a recurrent state along the "
            "sequence (transformers marks it stateful), which its PyTorch layers would pass "
            "from one row of a flattened batch to the next; its rows are trained padded")
