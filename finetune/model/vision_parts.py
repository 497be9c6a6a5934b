"""The parts of a vision-language model, by module name, and what of them trains
(the `vision:` section, config/vision_section.py): the vision tower, the projector, the
language model and the output head.

Found through transformers' own accessors, not by one architecture's names:
get_encoder(modality="image") is the vision tower (vision_tower, visual, vision_model,
...), get_decoder() the language model, get_output_embeddings() the head; the projector
is what sits beside the tower and the language model in their parent module with
weights of its own (LLaVA's and Gemma 3's multi_modal_projector, Idefics3's connector;
Qwen2-VL's merger lives inside its tower and counts as tower), and the parameters that
parent holds itself, outside every module (LLaVA-NeXT's image_newline, the learned
embedding put after each row of image features): trained with the projector.

PEFT's own `all-linear` takes every linear layer but the head: the tower and projector
too. Here all-linear (finetune's default) becomes the language model's linear layers
only (the tower's too where vision.freeze_tower is false), and names the user gives are
checked against the settings."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from finetune.config.schema import Experiment
from finetune.config.vision_section import VisionChoice, choice
from finetune.errors import RunError


@dataclass(frozen=True)
class Parts:
    tower: str               # module names, relative to the model
    language: str
    projector: tuple[str, ...]
    head: str | None
    # bare parameters beside them (LLaVA-NeXT's image_newline): trained with the projector
    # under full training; PEFT's modules_to_save takes modules only, so LoRA leaves them
    projector_parameters: tuple[str, ...] = ()


def _name(model, module, names: dict[int, str], what: str) -> str:
    found = names.get(id(module))
    if not found or module is model or module is getattr(model, "base_model", None):
        raise RunError(f"{type(model).__name__}: cannot tell its {what} (transformers' "
                       f"get_encoder/get_decoder find none); vision settings and LoRA on it "
                       "are not supported")
    return found


def parts(model) -> Parts:
    names = {id(module): name for name, module in model.named_modules()}
    tower = _name(model, model.get_encoder(modality="image"), names, "vision tower")
    language = _name(model, model.get_decoder(), names, "language model")
    head_module = model.get_output_embeddings()
    head = names.get(id(head_module)) if head_module is not None else None
    projector, loose = [], []
    for inner in sorted({tower.rpartition(".")[0], language.rpartition(".")[0]}):
        parent = model.get_submodule(inner)
        for child, module in parent.named_children():
            name = f"{inner}.{child}" if inner else child
            if name not in (tower, language, head) and name not in projector and \
                    any(True for _ in module.parameters()):
                projector.append(name)
        loose += [f"{inner}.{own}" if inner else own
                  for own, _ in parent.named_parameters(recurse=False)]
    return Parts(tower, language, tuple(projector), head, tuple(loose))


def inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def settings(experiment: Experiment) -> VisionChoice:
    return choice(experiment.vision, experiment.peft.type)


def freeze(model, experiment: Experiment) -> None:
    """Full training: the tower and the projector get no gradient where the settings say
    so (under LoRA, PEFT freezes the whole base itself)."""
    chosen = settings(experiment)
    if not chosen.freeze_tower and chosen.train_projector:
        return  # everything trains: no part needs finding
    found = parts(model)
    frozen = ([found.tower] if chosen.freeze_tower else []) + \
        ([] if chosen.train_projector else [*found.projector, *found.projector_parameters])
    for name, param in model.named_parameters():
        if any(inside(name, prefix) for prefix in frozen):
            param.requires_grad_(False)


def _linear(model, prefixes: list[str]) -> list[str]:
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and any(inside(name, p) for p in prefixes)]


def lora_targets(model, experiment: Experiment) -> tuple[str | list[str], list[str] | None]:
    """(target_modules, modules_to_save) for PEFT's LoraConfig on a vision-language model:
    all-linear as the language model's linear layers (and the tower's where it is not
    frozen); names the user gives as PEFT matches them (a name matches as a suffix), less
    a frozen tower and a projector that trains whole."""
    spec, chosen, found = experiment.peft, settings(experiment), parts(model)
    to_save = list(spec.modules_to_save or [])
    if chosen.train_projector:
        if not found.projector:
            raise RunError(f"vision.train_projector: {type(model).__name__} has no projector "
                           "beside its vision tower (it sits inside the tower): set it to false")
        to_save += [p for p in found.projector if p not in to_save]
    excluded = ([found.tower] if chosen.freeze_tower else []) + \
        (list(found.projector) if chosen.train_projector else [])
    targets = spec.target_modules
    if isinstance(targets, str) and targets.lower() == "all-linear":
        within = [found.language] + ([] if chosen.freeze_tower else [found.tower])
        names = [n for n in _linear(model, within) if n != found.head]
        return _as_pattern(model, names), to_save or None
    hit = _matched(model, targets)
    kept = [n for n in hit if not any(inside(n, part) for part in excluded)]
    if hit and not kept:
        raise RunError(f"peft.target_modules {targets!r} matches only modules of the vision "
                       f"tower or projector ({hit[0]}, ...), which vision.freeze_tower / "
                       "vision.train_projector keep from LoRA: set vision.freeze_tower: false "
                       "(LoRA on the tower) or vision.train_projector: false, or name the "
                       "language model's modules")
    return (targets if kept == hit else _as_pattern(model, kept)), to_save or None


def _matched(model, targets) -> list[str]:
    """The modules PEFT would put LoRA on for these target_modules."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    config = LoraConfig(target_modules=targets)
    return [n for n, _ in model.named_modules() if n and check_target_module_exists(config, n)]


def _as_pattern(model, names: list[str]) -> str | list[str]:
    """The module names as one regex (prefixes and layer names, as LLaMA-Factory writes
    them), short in adapter_config.json; the list itself where the regex would match
    other modules too."""
    prefixes = sorted({n.split(".layers.")[0] for n in names if ".layers." in n})
    leaves = sorted({n.rpartition(".")[2] for n in names})
    if not prefixes or not leaves:
        return sorted(names)
    pattern = rf"(?:{'|'.join(map(re.escape, prefixes))})\.layers\.\d+\.(?:.*\.)?" \
              rf"(?:{'|'.join(map(re.escape, leaves))})"
    matched = [n for n, _ in model.named_modules() if re.fullmatch(pattern, n)]
    return pattern if sorted(matched) == sorted(names) else sorted(names)


def unquantized(experiment: Experiment, config) -> list[str]:
    """QLoRA: the modules bitsandbytes leaves unquantized on a vision-language model, the
    vision tower and the projector (small, and what turns pixels into the language model's
    inputs; the projector may train whole) and the output head (transformers' own default,
    which a skip list replaces). Read from the architecture built on the meta device."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(
            config, trust_remote_code=experiment.model.trust_remote_code)
    found = parts(model)
    return [found.tower, *found.projector] + ([found.head] if found.head else [])
