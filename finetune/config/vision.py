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


def torchvision_refusal(model_type: str | None) -> str | None:
    """Why a model type's processor cannot load here (one line), or None: transformers
    5.23 builds a processor that takes videos (Qwen2-VL's, Qwen2.5-VL's, SmolVLM's, ...)
    only with its video processor, and those need torchvision; Pixtral's processor needs
    it outright. Told torch-free from transformers' source, as validate needs it; the same
    line at load (model/tokenizer.py)."""
    if model_type is None or importlib.util.find_spec("torchvision") is not None:
        return None
    name = processor_classes().get(model_type)
    if name is None or not _needs_torchvision(name):
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch = f" {version('torch')}"
    except PackageNotFoundError:
        torch = ""
    return (f"a {model_type} model's processor (transformers' {name}) needs torchvision, "
            f"which is not installed: pip install torchvision (the build matching the "
            f"installed torch{torch})")


def _transformers_dir() -> Path | None:
    spec = importlib.util.find_spec("transformers")
    return None if spec is None or spec.origin is None else Path(spec.origin).parent


@functools.cache
def processor_classes() -> dict[str, str]:
    """model_type -> the processor class AutoProcessor builds: transformers' generated
    PROCESSOR_MAPPING_NAMES and the entries processing_auto.py adds to it."""
    root = _transformers_dir()
    if root is None:
        return {}
    found: dict[str, str] = {}
    for path, name in (("auto_mappings.py", "PROCESSOR_MAPPING_NAMES"),
                       ("processing_auto.py", "MISSING_PROCESSOR_MAPPING_NAMES")):
        tree = ast.parse((root / "models" / "auto" / path).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in node.targets):
                found.update((k, v) for k, v in ast.literal_eval(node.value.args[0])
                             if isinstance(v, str))
    return found


@functools.cache
def _needs_torchvision(class_name: str) -> bool:
    """A processor class that takes a video processor (an __init__ argument, or a legacy
    video_processor_class) or requires torchvision itself, or whose base does."""
    node = _processor_class(class_name)
    if node is None:
        return False
    for decorator in node.decorator_list:
        if "torchvision" in ast.unparse(decorator):
            return True
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef)
                 and n.name == "__init__"), None)
    if init is not None:
        return any("video_processor" in a.arg for a in init.args.args + init.args.kwonlyargs)
    if any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and
                                             t.id == "video_processor_class" for t in n.targets)
           for n in node.body):
        return True
    return any(isinstance(b, ast.Name) and b.id != "ProcessorMixin" and _needs_torchvision(b.id)
               for b in node.bases)


def _processor_class(class_name: str) -> ast.ClassDef | None:
    """Where transformers defines a processor class: models/*/processing_*.py."""
    root = _transformers_dir()
    for path in sorted(root.glob("models/*/processing_*.py")) if root else []:
        text = path.read_text(encoding="utf-8")
        if f"class {class_name}(" in text:
            return next((n for n in ast.parse(text).body if isinstance(n, ast.ClassDef)
                         and n.name == class_name), None)
    return None
