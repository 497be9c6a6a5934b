"""Whether a model is a vision-language model (image-text-to-text), told from its
config.json without importing torch: validate needs the answer (rows with images need
such a model; only sft trains one), and importing transformers' model mapping would load
torch. The model types are read from the installed transformers' own mapping,
MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, parsed from its source: the list is the
installed version's, never a copy of ours that could fall behind."""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
from pathlib import Path

MAPPING = "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"


@functools.cache
def image_text_model_types() -> frozenset[str]:
    """The model types transformers' AutoModelForImageTextToText builds."""
    spec = importlib.util.find_spec("transformers")  # finds the package, imports nothing
    if spec is None or spec.origin is None:
        return frozenset()
    source = Path(spec.origin).parent / "models" / "auto" / "modeling_auto.py"
    tree = ast.parse(source.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == MAPPING for t in node.targets):
            pairs = ast.literal_eval(node.value.args[0])  # OrderedDict([(type, class), ...])
            return frozenset(model_type for model_type, _ in pairs)
    raise RuntimeError(f"{source} defines no {MAPPING}: transformers changed; update "
                       "finetune/config/vision.py")


def model_type(name_or_path: str) -> str | None:
    """The model_type of a local model directory's config.json; None when there is no
    readable one (a hub id: transformers reads it at training)."""
    try:
        config = json.loads((Path(name_or_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def is_vision_language(name_or_path: str) -> bool:
    """A local model whose config.json names an image-text-to-text model type."""
    found = model_type(name_or_path)
    return found is not None and found in image_text_model_types()
