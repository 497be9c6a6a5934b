"""LoRA and QLoRA on a vision-language model (the bundled tiny LLaVA), and the `vision:`
section: what trains (the language model's LoRA; the tower untouched; the projector
untouched unless vision.train_projector), a resumed adapter run ending where the
uninterrupted one did, `finetune eval` on the adapter, and `finetune merge` writing a
model that loads on its own with the logits of base + adapter."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import QUICKSTART, TINY_MODEL, run_cli
from finetune.config import load_experiment
from finetune.errors import ConfigError

TINY_VLM = QUICKSTART / "tiny-vlm"
VLM = QUICKSTART / "vlm.yaml"
DATA = QUICKSTART / "data"


def problems(path, overrides) -> str:
    with pytest.raises(ConfigError) as caught:
        load_experiment(path, overrides)
    return str(caught.value)


def test_the_vision_section_is_checked_at_validate(write):
    text = write("text.yaml", f"name: t\nmethod: sft\nmodel: {{name_or_path: {TINY_MODEL}}}\n"
                              "data: {train: x.jsonl}\nvision: {max_pixels: 1024}\n")
    assert "vision: model.name_or_path" in problems(text, []) and \
        "is not a vision-language model (model_type llama)" in problems(text, [])
    said = problems(VLM, ["vision.max_pixels=100", "vision.min_pixels=200"])
    assert "vision.min_pixels: 200 is more than vision.max_pixels 100" in said
    assert "vision.max_pixels" in problems(VLM, ["vision.max_pixels=0"])
    assert "vision.freeze_towr" in problems(VLM, ["vision.freeze_towr=true"])
    # LoRA and QLoRA on a VLM validate now; the other refusals stay
    for peft in ("lora", "qlora"):
        load_experiment(VLM, [f"peft.type={peft}", "vision.train_projector=true"])
    assert "only sft trains one yet" in problems(VLM, ["method=dpo", "data.train=x.jsonl"])


def test_images_are_fitted_to_the_pixel_bounds_aspect_kept():
    from PIL import Image

    from finetune.data.image_size import fitted

    big = Image.new("RGB", (400, 100))
    assert fitted(big, 10_000, None).size == (200, 50)
    assert fitted(big, 40_000, None) is big
    assert fitted(Image.new("RGB", (8, 2)), None, 64).size == (16, 4)
    assert fitted(Image.new("RGB", (30, 10)), 100, None).size == (17, 5)  # rounded down


@pytest.mark.slow  # builds the model (torch), on the meta device
def test_all_linear_is_the_language_models_linear_layers():
    import re

    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from finetune.errors import RunError
    from finetune.model import vision_parts

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(TINY_VLM))
    found = vision_parts.parts(model)
    assert (found.tower, found.language, found.projector, found.head) == (
        "model.vision_tower", "model.language_model", ("model.multi_modal_projector",),
        "lm_head")
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}

    def targets(*overrides):
        exp = load_experiment(VLM, ["peft.type=lora", *overrides])
        given, to_save = vision_parts.lora_targets(model, exp)
        if isinstance(given, list):  # PEFT's matching: a name matches as a suffix
            return {n for n in linear if any(n == g or n.endswith("." + g) for g in given)}, \
                to_save
        return {n for n in linear if re.fullmatch(given, n)}, to_save

    language, to_save = targets()
    assert language == {n for n in linear if n.startswith("model.language_model.")}
    assert len(language) == 14 and to_save is None
    with_tower, to_save = targets("vision.freeze_tower=false", "vision.train_projector=true")
    assert with_tower - language == {n for n in linear if n.startswith("model.vision_tower.")}
    assert to_save == ["model.multi_modal_projector"]
    # names the user gives match as PEFT matches them, less a frozen tower: q_proj is the
    # language model's and CLIP's
    q_proj = {n for n in linear if n.endswith(".q_proj")}
    assert targets("peft.target_modules=[q_proj]")[0] == q_proj & language
    assert targets("peft.target_modules=[q_proj]", "vision.freeze_tower=false")[0] == q_proj
    with pytest.raises(RunError, match="matches only modules of the vision tower or projector"):
        targets("peft.target_modules=[fc1]")  # CLIP's MLP
    with pytest.raises(RunError, match="only modules of the vision tower or projector"):
        targets("peft.target_modules=[linear_1]", "vision.train_projector=true")
