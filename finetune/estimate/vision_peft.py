"""What the experiment's `vision:` section and (Q)LoRA do to a vision-language model, as
finetune.model.vision_parts and finetune.model.peft build it (torch-free):

- full fine-tuning freezes the vision tower and/or the projector (freeze_tower,
  train_projector);
- under LoRA, all-linear is the language model's linear layers (the tower's too where
  freeze_tower is false), names the user gives are matched as PEFT matches them less a
  frozen tower and a projector that trains whole, and train_projector adds the
  projector to modules_to_save (a trained copy);
- under QLoRA only the language model's linear layers are quantized: the tower, the
  projector and the head are bitsandbytes' llm_int8_skip_modules.

The projector is what sits beside the tower (vision_parts.parts): Qwen2-VL's merger lives
inside its tower, so it freezes and trains with the tower, and LLaVA-NeXT's image_newline
is a parameter of the model itself: it trains and freezes with the projector under full
fine-tuning, and stays as loaded under LoRA (PEFT's modules_to_save takes modules only).
"""

from __future__ import annotations

from types import SimpleNamespace

from finetune.config.schema import Experiment
from finetune.config.vision_section import choice
from finetune.data.image_size import fitted
from finetune.errors import ConfigError
from finetune.estimate.shapes import Linear, Shape, matched
from finetune.estimate.vision.common import DEFAULT_IMAGE, Training


def _prefixes(value) -> tuple[str, ...]:
    return value if isinstance(value, tuple) else (value,)


def projector_modules(shape: Shape) -> list[str]:
    """The projector's module names beside the tower (none where it sits inside it)."""
    v = shape.vision
    return [p.rstrip(".") for p in _prefixes(v.projector_prefix)
            if p.endswith(".") and not p.startswith(v.tower_prefix)]


def tower_module(shape: Shape) -> str:
    return shape.vision.tower_prefix.rstrip(".")


def inside(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def training_of(experiment: Experiment, shape: Shape) -> Training:
    """Which vision parts train, as the experiment's vision section decides (its defaults
    by peft.type): under LoRA that is which parts get adapters or a trained copy."""
    chosen = choice(experiment.vision, experiment.peft.type)
    tower = not chosen.freeze_tower
    if not projector_modules(shape):  # the projector is part of the tower
        if experiment.peft.type != "none" and chosen.train_projector:
            raise ConfigError([f"vision.train_projector: a {shape.model_type} model has no "
                               "projector beside its vision tower (it sits inside the "
                               "tower): set it to false"])
        return Training(tower=tower, projector=tower)
    return Training(tower=tower, projector=chosen.train_projector)


def vision_linears(shape: Shape) -> list[Linear]:
    """The nn.Linear modules of the tower and the projector (kind 'tower' or 'projector')."""
    params = shape.vision.parameters()
    biased = {p.module for p in params if p.role == "bias"}
    tower = tower_module(shape)
    return [Linear(p.module, p.numel // p.out, p.out, p.module in biased,
                   "tower" if inside(p.module, tower) else "projector")
            for p in params if p.role == "linear" and p.name == f"{p.module}.weight"]


def lora_targets(shape: Shape, training: Training, target, candidates: list[Linear],
                 saved: list[str]) -> list[Linear]:
    """vision_parts.lora_targets over the language model's linears (candidates) and the
    tower's and projector's."""
    everything = candidates + vision_linears(shape)
    if isinstance(target, str) and target.lower() == "all-linear":
        return [lin for lin in everything
                if lin.kind == "layer" or (lin.kind == "tower" and training.tower)]
    excluded = ([] if training.tower else [tower_module(shape)]) + (
        saved if training.projector else [])
    hit = matched(everything, target)
    kept = [lin for lin in hit if not any(inside(lin.name, part) for part in excluded)]
    if hit and not kept:
        raise ConfigError([f"peft.target_modules {target!r} matches only modules of the "
                           f"vision tower or projector ({hit[0].name}, ...), which "
                           "vision.freeze_tower / vision.train_projector keep from LoRA: set "
                           "vision.freeze_tower: false (LoRA on the tower) or "
                           "vision.train_projector: false, or name the language model's "
                           "modules"])
    return kept


def quantized(name: str, shape: Shape) -> bool:
    """QLoRA: is this Linear weight's module quantized (the language model's only)?"""
    if not shape.vision:
        return True
    return not any(inside(name, m) for m in [tower_module(shape), *projector_modules(shape)])


def module_names(shape: Shape) -> list[str]:
    """The projector modules (for modules_to_save) and the modules inside them."""
    out = []
    for module in projector_modules(shape):
        out.append(module)
        out += sorted({p.module for p in shape.vision.parameters()
                       if p.module.startswith(module + ".")})
    return out


def frozen_by_name(name: str, shape: Shape, training: Training) -> bool:
    """Full fine-tuning: is this parameter frozen (as vision_parts.freeze freezes it)?
    Training.projector is the projector beside the tower, else the one inside it
    (Qwen2-VL's merger, which training_of freezes with the tower)."""
    v = shape.vision
    # beside the tower: its modules and bare parameters (LLaVA-NeXT's image_newline)
    beside = [f"{m}." for m in projector_modules(shape)] + [
        p for p in _prefixes(v.projector_prefix) if not p.endswith(".")]
    projector = beside or [p for p in _prefixes(v.projector_prefix)
                           if p.startswith(v.tower_prefix)]
    if name.startswith(tuple(projector)):
        return not training.projector
    return not training.tower and inside(name, tower_module(shape))


def tower_weights(training: Training, peft: bool) -> str:
    """The tower's weights on the backward's path (walk.Regime.tower): lora where LoRA
    puts an adapter on its every linear (a tower that is not frozen under (Q)LoRA), else
    trained. A frozen tower is on no path: it runs without autograd
    (finetune.model.frozen_tower), with activation checkpointing too."""
    return "lora" if peft and training.tower else "trained"


def picture_size(experiment: Experiment, size: tuple[int, int] | None) -> tuple[int, int] | None:
    """The pictures' size as the processor sees them: vision.max_pixels / min_pixels
    resize them first, as training does (data/image_size.fitted)."""
    chosen = choice(experiment.vision, experiment.peft.type)
    if chosen.max_pixels is None and chosen.min_pixels is None:
        return size
    width, height = size or DEFAULT_IMAGE

    def resize(new):
        return SimpleNamespace(width=new[0], height=new[1])

    picture = fitted(SimpleNamespace(width=width, height=height, resize=resize),
                     chosen.max_pixels, chosen.min_pixels)
    return picture.width, picture.height
