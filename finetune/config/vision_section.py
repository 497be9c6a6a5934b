"""The experiment's `vision:` section: what trains of a vision-language model (its vision
tower, its projector) and the size of the images it sees. Its own module: schema.py stays
small. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from finetune.config.section import Section

# Images of at most 2**31 pixels: far beyond any processor's, far below overflow.
MAX_PIXELS = 2**31


class VisionSection(Section):
    freeze_tower: bool | None = Field(
        None, description="Vision-language models: the vision tower gets no gradient and no "
        "LoRA. Default: true under peft lora/qlora, false for full training. false under "
        "LoRA: peft.target_modules all-linear puts LoRA on the tower's linear layers too.")
    train_projector: bool | None = Field(
        None, description="Vision-language models: the projector (the modules between the "
        "vision tower and the language model, LLaVA's multi_modal_projector) trains. Default: "
        "true for full training, false under peft lora/qlora; true under LoRA trains it whole "
        "and saves it with the adapter (PEFT's modules_to_save), not LoRA'd.")
    max_pixels: int | None = Field(
        None, gt=0, le=MAX_PIXELS, description="Vision-language models: an image of more "
        "pixels (width x height) is downscaled, aspect ratio kept, to at most this many before "
        "the processor sees it: in training, evaluation and the run's `finetune generate` and "
        "`chat`.")
    min_pixels: int | None = Field(
        None, gt=0, le=MAX_PIXELS, description="Vision-language models: an image of fewer "
        "pixels is upscaled, aspect ratio kept, to at least this many before the processor "
        "sees it, as max_pixels.")


@dataclass(frozen=True)
class VisionChoice:
    """The vision settings with their defaults decided."""
    freeze_tower: bool
    train_projector: bool
    max_pixels: int | None
    min_pixels: int | None


def choice(vision: VisionSection | None, peft_type: str) -> VisionChoice:
    spec = vision or VisionSection()
    lora = peft_type != "none"
    return VisionChoice(
        freeze_tower=lora if spec.freeze_tower is None else spec.freeze_tower,
        train_projector=(not lora) if spec.train_projector is None else spec.train_projector,
        max_pixels=spec.max_pixels, min_pixels=spec.min_pixels)
