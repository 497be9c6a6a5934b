"""Mixture-of-experts models whose experts transformers 5 fuses into 3-D parameters
(Qwen3-MoE, DeepSeek-V3, GLM-4.5, ...) and onto which peft maps LoRA targets that named
them when they were nn.Linear (all-linear among them): LoRA on those parameters (peft's
ParamWrapper) takes no dropout, so finetune's default peft.dropout stops such a run.
Validate tells it for a local model, torch-free, from the installed transformers' and
peft's own tables, read from their source as config/stateful.py reads transformers';
training tells it for any model from peft's conversion itself (model/peft.py)."""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

from finetune.config import vision

ENTRY = re.compile(r'^\s*"([\w-]+)":\s*"([\w-]+)",', re.M)
KEY = re.compile(r'^\s{4}"([\w-]+)":', re.M)
# The v4 names peft maps onto the fused parameters and the router (its
# _MOE_TARGET_MODULE_MAPPING): a target list naming one reaches the experts.
V4_NAMES = ("gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _block(path: Path, name: str) -> str:
    """The text of the dict literal `name = {...}` in a source file ("" if absent)."""
    text = path.read_text(encoding="utf-8")
    start = text.find(f"\n{name}")
    if start < 0:
        return ""
    end = text.find("\n}", start)
    return text[start:end]


def _source(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # finds the package, imports nothing
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / relative
    return path if path.is_file() else None


@functools.cache
def fused_expert_types() -> frozenset[str]:
    """The model types peft converts: transformers' conversion pattern is one whose
    experts peft fuses (peft.utils.transformers_weight_conversion._convert_peft_config_moe)."""
    patterns = _source("transformers", "conversion_mapping.py")
    fused = _source("peft", "utils/transformers_weight_conversion.py")
    if patterns is None or fused is None:
        return frozenset()
    bases = set(KEY.findall(_block(fused, "_MOE_FUSED_TARGETS")))
    pairs = ENTRY.findall(_block(patterns, "_MODEL_TO_CONVERSION_PATTERN"))
    return frozenset(model_type for model_type, base in pairs if base in bases)


def reaches_experts(targets: str | list[str]) -> bool:
    """all-linear, or a list naming an expert projection or the router; a regex is left
    to training (peft probes it against every v4 name)."""
    if isinstance(targets, str):
        return targets.lower() == "all-linear"
    return any(t.rpartition(".")[2] in V4_NAMES for t in targets)


def refusal(model_type: str, dropout: float, reached: str) -> str:
    """Why this LoRA cannot train (one line, after "peft.dropout: "); reached: what peft
    adapts, or the setting that reaches it."""
    return (f"{dropout} cannot go with LoRA on {model_type}'s experts, which "
            f"peft adapts as fused parameters ({reached}) and without dropout: set "
            "peft.dropout: 0 to adapt the experts, or peft.target_modules: [q_proj, k_proj, "
            "v_proj, o_proj] to adapt the attention and leave the experts whole")


def check(exp) -> list[tuple[tuple, str]]:
    """A local model of such a type with LoRA reaching its experts and a dropout."""
    spec = exp.peft
    if spec.type == "none" or not spec.dropout or not reaches_experts(spec.target_modules):
        return []
    found = vision.model_type(exp.model.name_or_path)
    if found not in fused_expert_types():
        return []
    reached = f"peft.target_modules {spec.target_modules!r} reaches them"
    return [(("peft", "dropout"), refusal(found, spec.dropout, reached))]
