"""`finetune estimate` for a vision-language model under the experiment's `vision:` section
and under LoRA/QLoRA, against the model the training code builds (finetune.model.load and
apply_peft, which put LoRA where vision_parts.lora_targets says and leave the tower,
projector and head unquantized under QLoRA): every tensor by name (count, bytes, dtype,
whether it trains), then one training step's gradients, AdamW states and what autograd
keeps; published configs on the meta device; the refusals training makes, made here too."""

from __future__ import annotations

import json
import re
import shutil
import types

import pytest

from conftest import QUICKSTART, REPO
from test_estimate import _held_bytes
from vlm_configs import (LLAVA_NEXT_7B, QWEN2_VL_2B, QWEN3_5_0_8B, QWEN3_VL_2B, kept_by_autograd,
                         model_dir)
from finetune.config import load_experiment
from finetune.errors import ConfigError
from finetune.estimate import as_dict, estimate, render_text
from finetune.estimate.census import census
from finetune.estimate.core import activation_bytes
from finetune.estimate.memory import model_states
from finetune.estimate.settings import Layout
from finetune.estimate.vision import Training

TINY_VLM = QUICKSTART / "tiny-vlm"
VLM = QUICKSTART / "vlm.yaml"
LLAVA_7B = REPO / "bench" / "models" / "llava-1.5-7b"
TRL_CAST = ("qlora",)  # TRL's trainers cast a quantized model's trainable weights to bf16

CASES = {  # id: overrides of the quickstart VLM experiment
    "full-frozen-tower": ["vision.freeze_tower=true"],
    "full-frozen-projector": ["vision.train_projector=false"],
    "lora": ["peft.type=lora", "peft.r=4"],
    "lora-tower-projector-bias": ["peft.type=lora", "peft.r=4", "vision.freeze_tower=false",
                                  "vision.train_projector=true", "peft.bias=all"],
    "lora-named": ["peft.type=lora", "peft.r=4", "peft.target_modules=[q_proj,fc1]"],
    "qlora": ["peft.type=qlora", "peft.r=4"],
    "qlora-8bit-projector": ["peft.type=qlora", "peft.r=4", "peft.bits=8",
                             "vision.train_projector=true"],
}


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    """The quickstart VLM with weights, to load as training loads a pretrained model."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = tmp_path_factory.mktemp("tiny-vlm-weights")
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(TINY_VLM)) \
        .save_pretrained(path)
    for f in TINY_VLM.iterdir():
        if not (path / f.name).exists():
            shutil.copy(f, path / f.name)
    return path


def _estimate_name(name: str) -> str:
    """A PEFT model's parameter name as the estimate names it."""
    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    name = re.sub(r"\.lora_([AB])\.default\.weight$", r".lora_\1", name)
    if ".modules_to_save.default." in name:
        return name.replace(".modules_to_save.default.", ".") + " (copy)"
    return name.replace(".original_module.", ".")


def _held(param) -> tuple[int, int, str]:
    """(logical count, bytes with quantization constants, dtype) of one parameter."""
    import math

    state = getattr(param, "quant_state", None)
    if state is not None:
        return math.prod(state.shape), _held_bytes(types.SimpleNamespace(
            parameters=lambda: [param])), "nf4"
    dtype = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.int8": "int8"}[
        str(param.dtype)]
    return param.numel(), _held_bytes(types.SimpleNamespace(parameters=lambda: [param])), dtype


@pytest.mark.slow  # a tiny model loaded and stepped per case: about 1-2 s each
@pytest.mark.parametrize("case", list(CASES))
def test_tensors_and_a_training_step_against_the_training_code(case, tiny_vlm, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling
    from finetune.model.hardware import Hardware
    from finetune.model.load import load_model
    from finetune.model.peft import apply_peft

    experiment = load_experiment(VLM, ["precision=bf16", "distributed.device=cpu",
                                       f"model.name_or_path={tiny_vlm}", "model.init=pretrained",
                                       *CASES[case]])
    torch.manual_seed(0)
    model = load_model(experiment, Hardware("cpu", "bf16"), types.SimpleNamespace(pad_token_id=0),
                       tmp_path, None)
    model = apply_peft(model, experiment, gradient_checkpointing=False)
    if experiment.peft.type in TRL_CAST:
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)

    result = estimate(experiment)
    shape, settings = result.shape, result.settings
    tensors = census(shape, settings)
    real = {_estimate_name(n): (*_held(p), p.requires_grad) for n, p in model.named_parameters()}
    counted = {t.name: (t.numel, t.nbytes, t.dtype, t.trainable) for t in tensors}
    assert counted == real
    states = model_states(tensors, [], settings, Layout("none"))
    assert _held_bytes(model) == states.weights + states.trainable

    # One step of a batch TRL's vision collator makes: gradients, AdamW states, activations.
    data = QUICKSTART / "data"
    rows = [json.loads(line) for line in (data / "vlm_train.jsonl").read_text().splitlines()[:2]]
    rows = [{**r, "images": [str(data / i) for i in r["images"]]} for r in rows]
    batch = DataCollatorForVisionLanguageModeling(AutoProcessor.from_pretrained(TINY_VLM))(rows)
    tokens = batch["input_ids"].shape[1]
    params = [p for p in model.parameters()]
    model.train()
    out, kept = kept_by_autograd(lambda: model(**batch),
                                 {p.untyped_storage().data_ptr() for p in params})
    out.loss.backward()
    grads = {_estimate_name(n) for n, p in model.named_parameters() if p.grad is not None}
    assert grads == {t.name for t in tensors if t.trainable and t.gradient}
    trainable = [p for p in params if p.requires_grad]
    assert sum(p.grad.numel() * p.grad.element_size() for p in trainable
               if p.grad is not None) == states.gradients
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    optimizer.step()
    assert states.optimizer == sum(v.numel() * v.element_size()
                                   for state in optimizer.state.values() for v in state.values())

    acts = activation_bytes(shape, settings.with_(seq_len=tokens, logit_tokens=tokens,
                                                  attention="sdpa", mask="padding"),
                            Layout("none"), False)
    expected = len(rows) * (acts.layers + acts.other + acts.logits_saved + acts.vision)
    expected += states.autocast
    measured = kept + batch["pixel_values"].numel() * 4  # the batch's, kept by the caller
    assert abs(measured - expected) <= 0.01 * measured, (measured, expected)


@pytest.mark.slow  # the tiny VLM's tower, one forward
def test_a_frozen_tower_keeps_nothing_under_lora_with_checkpointing(tiny_vlm, tmp_path):
    """TRL calls enable_input_require_grads under LoRA with activation checkpointing: in
    transformers 5 it hooks the tower's patch embedding too. Training runs a frozen tower
    without autograd (model/frozen_tower.py), so it keeps nothing for the backward either
    way, as the estimate counts: only the batch's pixels."""
    torch = pytest.importorskip("torch")
    from finetune.model.hardware import Hardware
    from finetune.model.load import load_model
    from finetune.model.peft import apply_peft

    experiment = load_experiment(VLM, ["precision=bf16", "distributed.device=cpu",
                                       f"model.name_or_path={tiny_vlm}", "model.init=pretrained",
                                       "peft.type=lora", "peft.r=4"])
    model = load_model(experiment, Hardware("cpu", "bf16"), types.SimpleNamespace(pad_token_id=0),
                       tmp_path, None)
    model = apply_peft(model, experiment, gradient_checkpointing=True)
    result = estimate(experiment)
    shape, settings = result.shape, result.settings
    assert settings.vision_training == Training(tower=False, projector=False)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    features = lambda: model.base_model.model.model.get_image_features(pixel_values=pixels)

    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for hooked in (False, True):
        if hooked:
            model.enable_input_require_grads()  # as TRL's trainers do under PEFT
        out, kept = kept_by_autograd(features, storages)
        assert kept == 0  # the image features (projected) require no grad either
        assert not any(f.requires_grad for f in out.pooler_output) and out.pooler_output
    for checkpointing in (False, True):
        assert activation_bytes(shape, settings, Layout("none"), checkpointing).vision == \
            pixels[0].numel() * 4


META_CASES = {  # id: (model directory maker, overrides)
    "qwen2-vl-2b-lora-on-the-tower": (lambda tmp: model_dir(tmp, QWEN2_VL_2B),
                                      ["peft.type=lora", "vision.freeze_tower=false"]),
    "llava-1.5-7b-lora-projector": (lambda tmp: LLAVA_7B,
                                    ["peft.type=lora", "vision.train_projector=true"]),
    # full fine-tuning (fp32): the merger inside the tower freezes with it
    "qwen2-vl-2b-full-frozen-tower": (lambda tmp: model_dir(tmp, QWEN2_VL_2B),
                                      ["vision.freeze_tower=true"]),
    # LLaVA-NeXT's image_newline, a bare parameter beside the tower, freezes with the projector
    "llava-next-7b-full-frozen-projector": (lambda tmp: model_dir(tmp, LLAVA_NEXT_7B),
                                            ["vision.train_projector=false"]),
    # Qwen3-VL's deepstack mergers, inside the tower, take LoRA with it
    "qwen3-vl-2b-lora-on-the-tower": (lambda tmp: model_dir(tmp, QWEN3_VL_2B),
                                      ["peft.type=lora", "vision.freeze_tower=false"]),
    # Qwen3.5: Gated DeltaNet's in_proj_qkv/z/a/b and out_proj beside attention's q/k/v/o
    "qwen3.5-0.8b-lora": (lambda tmp: model_dir(tmp, QWEN3_5_0_8B), ["peft.type=lora"]),
    "qwen3.5-0.8b-lora-named": (lambda tmp: model_dir(tmp, QWEN3_5_0_8B),
                                ["peft.type=lora",
                                 "peft.target_modules=[in_proj_qkv,q_proj,out_proj]"]),
}


@pytest.mark.slow  # imports torch; the meta device builds no weights (about 2 s each)
@pytest.mark.parametrize("case", list(META_CASES))
def test_published_configs_under_lora_and_qlora_on_the_meta_device(case, tmp_path):
    """LoRA as apply_peft puts it on the published architecture (bf16 base, fp32 adapters,
    a bf16 trained copy of the projector), and the parts it freezes under full fine-tuning,
    tensor by tensor; QLoRA's 4-bit weights exactly
    the linears outside the modules training keeps unquantized (vision_parts.unquantized)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForImageTextToText
    from finetune.model.peft import apply_peft
    from finetune.model.vision_parts import inside, unquantized

    make, overrides = META_CASES[case]
    path = make(tmp_path)
    lora = ["peft.r=2"] if "peft.type=lora" in overrides else []
    experiment = load_experiment(VLM, ["precision=bf16", f"model.name_or_path={path}",
                                       *lora, *overrides])
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(
            config, dtype=torch.bfloat16 if experiment.peft.type == "lora" else torch.float32)
        model = apply_peft(model, experiment, gradient_checkpointing=False)
    dtypes = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    real = {_estimate_name(n): (p.numel(), p.numel() * p.element_size(), dtypes[p.dtype],
                                p.requires_grad) for n, p in model.named_parameters()}
    result = estimate(experiment)
    counted = {t.name: (t.numel, t.nbytes, t.dtype, t.trainable)
               for t in census(result.shape, result.settings)}
    assert counted == real
    assert result.trainable_params == sum(p.numel() for p in model.parameters()
                                          if p.requires_grad)

    qlora = load_experiment(VLM, ["precision=bf16", f"model.name_or_path={path}",
                                  "peft.type=qlora", "peft.r=2"])
    skipped = unquantized(qlora, config)
    with torch.device("meta"):
        base = AutoModelForImageTextToText.from_config(config)
    quantized = {f"{n}.weight" for n, m in base.named_modules()
                 if isinstance(m, torch.nn.Linear) and not any(inside(n, s) for s in skipped)}
    result = estimate(qlora)
    tensors = census(result.shape, result.settings)
    assert {t.name for t in tensors if t.dtype == "nf4"} == quantized
    assert all(t.dtype == "fp32" for t in tensors  # prepare_model_for_kbit_training
               if t.role not in ("lora",) and t.dtype != "nf4")


def test_the_vision_section_decides_what_trains():
    """Its defaults by peft.type, as training decides them (config/vision_section.choice);
    a vision_training the caller passes wins."""
    cases = {(): Training(True, True), ("vision.freeze_tower=true",): Training(False, True),
             ("peft.type=lora",): Training(False, False),
             ("peft.type=qlora", "vision.train_projector=true"): Training(False, True),
             ("peft.type=lora", "vision.freeze_tower=false"): Training(True, False)}
    for overrides, training in cases.items():
        result = estimate(load_experiment(VLM, list(overrides)))
        assert result.settings.vision_training == training, overrides
    frozen = estimate(load_experiment(VLM, ["vision.freeze_tower=true"]))
    assert frozen.trainable_params == frozen.parts["language_model"] + frozen.parts["projector"]
    lora = estimate(load_experiment(VLM, ["peft.type=lora"]))
    text = render_text(lora)
    assert "lora: adapters on the language model's linear layers" in text
    assert "the projector frozen" in text
    assert as_dict(lora)["settings"]["vision_trains"] == {"tower": False, "projector": False}
    checkpointed = render_text(estimate(load_experiment(
        VLM, ["peft.type=qlora", "training.activation_checkpointing=true"])))
    assert "4-bit, the vision tower, projector and head unquantized" in checkpointed
    assert re.search(r"; the projector frozen$", checkpointed, re.M)  # nothing more said
    passed = estimate(load_experiment(VLM, ["vision.freeze_tower=true"]),
                      vision_training=Training(True, True))
    assert passed.trainable_params == passed.params


def test_qwen2_vl_has_no_projector_to_train_whole(tmp_path):
    """Its merger sits inside the tower: it freezes with it under full fine-tuning, and
    train_projector under LoRA is refused, as training refuses it (vision_parts)."""
    path = model_dir(tmp_path, QWEN2_VL_2B)
    frozen = estimate(load_experiment(VLM, [f"model.name_or_path={path}",
                                            "vision.freeze_tower=true"]))
    assert frozen.trainable_params == frozen.parts["language_model"]
    with pytest.raises(ConfigError, match="no projector beside its vision tower"):
        estimate(load_experiment(VLM, [f"model.name_or_path={path}", "peft.type=lora",
                                       "vision.train_projector=true"]))


def test_lora_targets_only_in_a_frozen_tower_are_refused():
    """As vision_parts.lora_targets refuses them at training."""
    with pytest.raises(ConfigError, match="matches only modules of the vision tower"):
        estimate(load_experiment(VLM, ["peft.type=lora", "peft.target_modules=[fc1]"]))
    tower = estimate(load_experiment(VLM, ["peft.type=lora", "peft.target_modules=[fc1]",
                                           "vision.freeze_tower=false"]))
    # fc1 of the tower's two layers, 64 -> 128 features, r 16
    assert tower.settings.peft.r == 16
    assert tower.trainable_params == 2 * 16 * (64 + 128)


def test_max_and_min_pixels_resize_the_picture_first(tmp_path):
    """vision.max_pixels / min_pixels resize the picture before the processor, as training
    does (data/image_size.fitted): Qwen2-VL's tokens follow the resized picture."""
    path = model_dir(tmp_path, QWEN2_VL_2B)
    exp = lambda *o: load_experiment(VLM, [f"model.name_or_path={path}", *o])
    tokens = lambda result: result.shape.vision.image_tokens
    big = estimate(exp(), image_size=(1920, 1080))
    capped = estimate(exp("vision.max_pixels=307200"), image_size=(1920, 1080))
    # 1920x1080 scaled to 739x415 (<= 307,200 pixels), then Qwen's resize to 28-multiples
    assert tokens(capped) == tokens(estimate(exp(), image_size=(739, 415))) < tokens(big)
    small = estimate(exp("vision.min_pixels=307200"), image_size=(100, 60))
    assert tokens(small) == tokens(estimate(exp(), image_size=(716, 430)))
    assert tokens(estimate(exp("vision.max_pixels=10000000"))) == \
        tokens(estimate(exp())) == 391  # the 640x480 default within the bounds
