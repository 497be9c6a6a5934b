"""LoRA and QLoRA on a vision-language model (the bundled tiny LLaVA), and the `vision:`
section: what trains (the language model's LoRA; the tower untouched; the projector
untouched unless vision.train_projector), a resumed adapter run ending where the
uninterrupted one did, `finetune eval` and `finetune generate` on the adapter, and
`finetune merge` writing a model that loads on its own with the logits of base + adapter;
QLoRA with the language model quantized and the projector trained whole, by sft and by dpo
(its reference the starting policy exactly); and, on the meta
device for ten model types, every parameter found in one part (model/vision_parts.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import QUICKSTART, TINY_MODEL, run_cli
from test_estimate_vision_more_families import INTERNVL3_1B, MISTRAL_SMALL_31
from vlm_configs import (GEMMA3_4B, LLAVA_NEXT_7B, PALIGEMMA_3B, QWEN2_VL_2B, QWEN25_VL_3B,
                         SMOLVLM_256M, tiny_mllama)
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
    assert "only sft, dpo, kto, grpo, rloo and distill train one yet" in problems(
        VLM, ["method=orpo", "data.train=x.jsonl"])


def test_images_are_fitted_to_the_pixel_bounds_aspect_kept():
    from PIL import Image

    from finetune.data.image_size import fitted

    big = Image.new("RGB", (400, 100))
    assert fitted(big, 10_000, None).size == (200, 50)
    assert fitted(big, 40_000, None) is big
    assert fitted(Image.new("RGB", (8, 2)), None, 64).size == (16, 4)
    assert fitted(Image.new("RGB", (30, 10)), 100, None).size == (17, 5)  # rounded down


def test_a_rows_pictures_are_opened_and_fitted_only_within_bounds(tmp_path):
    """What evaluation's exact match and the training collator hand the processor."""
    from PIL import Image

    from finetune.data.image_size import fit_all

    Image.new("RGB", (64, 32), (200, 10, 10)).save(tmp_path / "wide.png")
    path = str(tmp_path / "wide.png")
    assert fit_all([path], None, None) == [path]  # no bounds: the path, opened by the processor
    [picture] = fit_all([path], 512, None)
    assert picture.size == (32, 16) and picture.mode == "RGB"
    assert picture.getpixel((5, 5)) == (200, 10, 10)


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


PARTS = {  # model type: (its config, (tower, language model, projector, bare parameters))
    "llava": (None, ("model.vision_tower", "model.language_model",
                     ("model.multi_modal_projector",), ())),
    "llava_next": (LLAVA_NEXT_7B, ("model.vision_tower", "model.language_model",
                                   ("model.multi_modal_projector",), ("model.image_newline",))),
    "qwen2_vl": (QWEN2_VL_2B, ("model.visual", "model.language_model", (), ())),
    "qwen2_5_vl": (QWEN25_VL_3B, ("model.visual", "model.language_model", (), ())),
    "gemma3": (GEMMA3_4B, ("model.vision_tower", "model.language_model",
                           ("model.multi_modal_projector",), ())),
    "paligemma": (PALIGEMMA_3B, ("model.vision_tower", "model.language_model",
                                 ("model.multi_modal_projector",), ())),
    "idefics3": (SMOLVLM_256M, ("model.vision_model", "model.text_model", ("model.connector",),
                                ())),
    "mistral3": (MISTRAL_SMALL_31, ("model.vision_tower", "model.language_model",
                                    ("model.multi_modal_projector",), ())),
    "internvl": (INTERNVL3_1B, ("model.vision_tower", "model.language_model",
                                ("model.multi_modal_projector",), ())),
    "mllama": (None, ("model.vision_model", "model.language_model",
                      ("model.multi_modal_projector",), ())),
}


@pytest.mark.slow  # builds each model (torch), on the meta device
@pytest.mark.parametrize("model_type", list(PARTS))
def test_every_parameter_is_in_one_part_and_trains_as_its_part_does(model_type, tmp_path):
    """vision_parts finds the parts through transformers' accessors; every parameter is the
    tower's, the language model's, the head's or the projector's (LLaVA-NeXT's
    image_newline, a bare parameter beside them, with the projector): full training with
    vision.train_projector false freezes the projector's, freeze_tower the tower's."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from finetune.model import vision_parts

    published, expected = PARTS[model_type]
    if published is None:  # the bundled tiny LLaVA, the tiny mllama
        config = AutoConfig.from_pretrained(TINY_VLM if model_type == "llava" else
                                            tiny_mllama(tmp_path))
    else:
        config = CONFIG_MAPPING[model_type](**{k: v for k, v in published.items()
                                              if k != "model_type"})
    assert config.model_type == model_type

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)

    def trained(*overrides) -> set[str]:
        model.requires_grad_(True)
        vision_parts.freeze(model, load_experiment(VLM, list(overrides)))
        return {n for n, p in model.named_parameters() if p.requires_grad}

    found = vision_parts.parts(model)
    assert (found.tower, found.language, found.projector, found.projector_parameters) == \
        expected and found.head == "lm_head"
    names = {n for n, _ in model.named_parameters()}
    part = lambda *prefixes: {n for n in names if any(vision_parts.inside(n, p)
                                                      for p in prefixes)}
    tower, projector = part(found.tower), part(*found.projector, *found.projector_parameters)
    assert names == tower | part(found.language, found.head) | projector
    assert trained() == names
    assert trained("vision.train_projector=false") == names - projector
    assert trained("vision.freeze_tower=true") == names - tower
    if model_type == "llava_next":  # with the projector, not with everything else
        assert "model.image_newline" in projector


def test_a_changed_vision_setting_is_another_fingerprint():
    """Resuming with another vision.freeze_tower would train other parameters: refused
    as any change of what trains (an experiment without the section keeps its old one)."""
    from finetune.rundir.fingerprint import fingerprint

    plain = fingerprint(load_experiment(VLM, ["peft.type=lora"]))
    assert not any(k.startswith("vision") for k in plain)
    changed = fingerprint(load_experiment(VLM, ["peft.type=lora", "vision.freeze_tower=false"]))
    assert {k for k in changed if changed[k] != plain.get(k)} == {"vision.freeze_tower"}


def lora_experiment(write, tmp_path) -> object:
    return write("vlm-lora.yaml", f"""name: vlm-lora
method: sft
model: {{name_or_path: {TINY_VLM}, init: random}}
peft: {{type: lora, r: 4}}
data:
  train: {{path: {DATA / 'vlm_train.jsonl'}, max_samples: 24}}
  eval: {{path: {DATA / 'vlm_eval.jsonl'}, max_samples: 8}}
evaluation: {{before_training: false, exact_match: true, max_new_tokens: 4, max_samples: 4}}
output: {{plot: false}}
training:
  max_steps: 4
  save_steps: 2
  per_device_train_batch_size: 4
  learning_rate: 1e-2
  optim: adamw_torch
  max_length: 64
  activation_checkpointing: false
  logging_steps: 1
  seed: 0
""")


def losses(run) -> list:
    return [(r["step"], r["loss"]) for r in
            map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
def test_lora_on_the_tiny_vlm_trains_the_language_model_resumes_and_merges(write, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from finetune.model.vision import chat_prompts

    config = lora_experiment(write, tmp_path)
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "vlm-lora"
    adapter = load_file(run / "final" / "adapter_model.safetensors")
    # LoRA on the language model's linear layers only: 2 layers x 7 linear layers x (A, B)
    assert len(adapter) == 28 and all(".language_model." in k and ".lora_" in k for k in adapter)
    summary = json.loads((run / "summary.json").read_text())

    # Resumed from checkpoint-2 (the Trainer's own adapter loading), it ends where the
    # uninterrupted run did: the same adapter, bit for bit, and the same losses after step 2
    shutil.rmtree(run / "checkpoints" / "checkpoint-4")
    shutil.move(run / "final", tmp_path / "first-final")
    first_losses = losses(run)
    (run / "summary.json").unlink()
    again = run_cli("train", str(config), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "checkpoint-2" in again.stdout
    resumed = load_file(run / "final" / "adapter_model.safetensors")
    assert all(torch.equal(resumed[k], adapter[k]) for k in adapter)
    assert losses(run)[-2:] == [entry for entry in first_losses if entry[0] > 2]

    # `finetune eval` puts the adapter on its base and scores what training reported after
    evaluated = run_cli("eval", str(run), cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    scored = json.loads((run / "eval" / "vlm_eval-final.json").read_text())["metrics"]
    for key in ("eval_loss", "eval_exact_match"):
        assert scored[key] == pytest.approx(summary["after"][key], rel=1e-5), key

    # `finetune generate` answers image rows with the adapter as evaluation did
    (tmp_path / "vlm_eval").symlink_to(DATA / "vlm_eval")
    (tmp_path / "prompts.jsonl").write_text(
        "".join((DATA / "vlm_eval.jsonl").read_text().splitlines(keepends=True)[:4]))
    generated = run_cli("generate", str(run), "--file", "prompts.jsonl", "--batch-size", "4",
                        "--max-new-tokens", "4", cwd=tmp_path)
    assert generated.returncode == 0, generated.stderr[-3000:]
    answers = [json.loads(line) for line in generated.stdout.splitlines()]
    assert len(answers) == 4
    assert sum(a["completion"].strip() == a["reference"] for a in answers) / 4 == \
        summary["after"]["eval_exact_match"]

    # `finetune merge`: a whole model that loads on its own with AutoModelForImageTextToText
    # and AutoProcessor, and gives base + adapter's logits
    merged = run_cli("merge", str(run), "--out", str(tmp_path / "merged"), cwd=tmp_path)
    assert merged.returncode == 0, merged.stderr[-3000:]
    rows = [json.loads(line) for line in (DATA / "vlm_eval.jsonl").read_text().splitlines()[:4]]
    conversations = [r["messages"][:1] for r in rows]
    pictures = [[str(DATA / p) for p in r["images"]] for r in rows]
    batch = chat_prompts(AutoProcessor.from_pretrained(run / "final"), conversations, pictures)
    base = AutoModelForImageTextToText.from_pretrained(run / "init-model").eval()
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    with torch.no_grad():
        before = base(**batch).logits
        expected = PeftModel.from_pretrained(base, run / "final").eval()(**batch).logits
    shutil.rmtree(run)  # nothing of the run is needed to load the merged model
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").eval()
    processor = AutoProcessor.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        logits = model(**chat_prompts(processor, conversations, pictures)).logits
    assert (logits - expected).abs().max() < 1e-5 < (expected - before).abs().max()
    # What trained: the language model's linear layers (through LoRA); the vision tower and
    # the projector (vision.train_projector false under LoRA) byte for byte as they started
    weights = model.state_dict()
    assert weights.keys() == initial.keys()
    changed = {k for k in initial if not torch.equal(weights[k], initial[k])}
    assert changed == {f"model.language_model.layers.{i}.{name}.weight" for i in range(2)
                       for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                    "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                    "mlp.down_proj")}


@pytest.mark.slow
def test_qlora_on_the_tiny_vlm_quantizes_the_language_model_and_trains_the_projector_whole(
        write, tmp_path):
    """QLoRA: the language model's linear layers in 4 bits, the vision tower, projector and
    head left whole; vision.train_projector trains the projector whole and saves it with
    the adapter; images fitted to vision.max_pixels (32x32 pictures to 16x16) on the way.
    dpo on pairs with images alike (the model built as for sft: run/build.py), its
    reference the starting policy (TRL's frozen copy of the starting adapter and
    projector): at step 0 both implicit rewards are 0 exactly."""
    import math

    import bitsandbytes as bnb
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from finetune.model.hardware import resolve_hardware
    from finetune.run.build import starting_model

    overrides = ["peft.type=qlora", "vision.train_projector=true", "vision.max_pixels=256",
                 "training.max_steps=2", "training.save_steps=2", "evaluation.exact_match=false"]
    config = lora_experiment(write, tmp_path)
    result = run_cli("train", str(config), *overrides, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = load_file(tmp_path / "runs" / "vlm-lora" / "final" / "adapter_model.safetensors")
    lora = [k for k in saved if ".lora_" in k]
    whole = sorted(k for k in saved if ".lora_" not in k)
    assert len(lora) == 28 and all(".language_model." in k for k in lora)
    assert whole == [f"base_model.model.model.multi_modal_projector.{layer}.{kind}"
                     for layer in ("linear_1", "linear_2") for kind in ("bias", "weight")]
    initial = load_file(tmp_path / "runs" / "vlm-lora" / "init-model" / "model.safetensors")
    trained = "base_model.model.model.multi_modal_projector.linear_1.weight"
    assert not torch.equal(saved[trained], initial["multi_modal_projector.linear_1.weight"])
    # merged (on the unquantized base), the projector is the one trained whole
    merged = run_cli("merge", str(tmp_path / "runs" / "vlm-lora"), cwd=tmp_path)
    assert merged.returncode == 0, merged.stderr[-3000:]
    weights = load_file(tmp_path / "runs" / "vlm-lora" / "merged" / "model.safetensors")
    assert torch.equal(weights["multi_modal_projector.linear_1.weight"], saved[trained])

    # the model as training builds it for every method (run/build.py)
    experiment = load_experiment(config, overrides)
    inspect = tmp_path / "inspect"
    inspect.mkdir()
    _, model = starting_model(experiment, resolve_hardware(experiment),
                              AutoProcessor.from_pretrained(TINY_VLM), inspect, 0, inspect, False)
    quantized = {n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(quantized) == 14 and all(".language_model." in n for n in quantized)
    trainable = {n.split(".modules_to_save.")[0] for n, p in model.named_parameters()
                 if p.requires_grad and ".lora_" not in n}
    assert trainable == {"base_model.model.model.multi_modal_projector"}

    # dpo: 2 steps on pairs with images, scored on held-out pairs before and after (a CPU
    # with AVX512-BF16 ran the 4-bit layers without a backward after that first evaluation:
    # model/peft.py keep_4bit_layers_differentiable)
    dpo = run_cli("train", str(config), *overrides, "method=dpo", "name=vlm-dpo",
                  f"data.train.path={DATA / 'vlm_pref_train.jsonl'}",
                  f"data.eval.path={DATA / 'vlm_pref_eval.jsonl'}",
                  "evaluation.before_training=true", cwd=tmp_path)
    assert dpo.returncode == 0, dpo.stderr[-3000:]
    assert "peft qlora" in dpo.stdout
    run = tmp_path / "runs" / "vlm-dpo"
    assert len(losses(run)) == 2 and all(math.isfinite(loss) for _, loss in losses(run))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["before"]["eval_rewards/chosen"] == 0.0
    assert summary["before"]["eval_rewards/rejected"] == 0.0
    assert summary["after"]["eval_rewards/chosen"] != 0.0
    # what trained is what the adapter holds: LoRA on the language model (B drawn as 0,
    # moved) and the projector whole (moved); nothing of the tower
    saved = load_file(run / "final" / "adapter_model.safetensors")
    lora = [k for k in saved if ".lora_" in k]
    assert len(lora) == 28 and all(".language_model." in k for k in lora)
    assert all(saved[k].any() for k in lora if ".lora_B." in k)
    assert sorted(k for k in saved if ".lora_" not in k) == whole
    initial = load_file(run / "init-model" / "model.safetensors")
    assert not torch.equal(saved[trained], initial["multi_modal_projector.linear_1.weight"])
    # the reference adapter (`ref`) stays in the checkpoint, for a resume; final/ holds
    # the trained adapter only, the checkpoint's
    last = run / "checkpoints" / "checkpoint-2"
    assert (last / "ref" / "adapter_model.safetensors").is_file()
    assert not (run / "final" / "ref").exists()
    checkpointed = load_file(last / "adapter_model.safetensors")
    assert checkpointed.keys() == saved.keys()
    assert all(torch.equal(saved[k], checkpointed[k]) for k in saved)
    # final/ loads on its own (its base embedded), the adapter and trained projector on it
    loaded = AutoModelForImageTextToText.from_pretrained(run / "final").state_dict()
    assert torch.equal(loaded["model.multi_modal_projector.modules_to_save.default.linear_1."
                              "weight"], saved[trained])
    assert torch.equal(loaded["model.language_model.layers.1.mlp.down_proj.lora_B.default."
                              "weight"], saved["base_model.model.model.language_model.layers.1."
                                               "mlp.down_proj.lora_B.weight"])



@pytest.mark.slow  # the processor (transformers)
def test_prompts_see_the_pictures_as_training_fits_them(tmp_path):
    """generate, chat and exact match encode prompts through chat_prompts with the run's
    fitter: a picture over vision.max_pixels reaches the processor as the fitted picture."""
    from PIL import Image
    from transformers import AutoProcessor

    from finetune.data.image_size import fitted, fitter
    from finetune.model.vision import chat_prompts

    processor = AutoProcessor.from_pretrained(TINY_VLM)
    big = Image.effect_noise((64, 64), 60).convert("RGB")
    big.save(tmp_path / "big.png")
    fitted(big, 256, None).save(tmp_path / "small.png")
    ask = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]]
    (tmp_path / "rows.jsonl").write_text("")
    exp = lambda extra: load_experiment(write_experiment(tmp_path, extra))
    fit = fitter(exp("vision: {max_pixels: 256}\n"))
    pixels = lambda name, f=list: chat_prompts(processor, ask, [[str(tmp_path / name)]],
                                               f)["pixel_values"]
    assert fitter(exp("")) is list
    assert torch_equal(pixels("big.png", fit), pixels("small.png"))
    assert not torch_equal(pixels("big.png"), pixels("small.png"))


def write_experiment(tmp_path, extra: str):
    path = tmp_path / "exp.yaml"
    path.write_text(f"method: sft\nmodel: {{name_or_path: {TINY_VLM}, init: random}}\n"
                    f"data: {{train: {tmp_path / 'rows.jsonl'}}}\n{extra}")
    return path


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())
