"""`finetune estimate` for vision-language models (LLaVA): the parameters counted by part
against what transformers builds (the tiny quickstart VLM, and LLaVA-1.5-7B's published
config on the meta device), the tokens an image becomes against the real processor, the
model states and activations against one real training step of the tiny VLM, and the
command's table and refusals."""

from __future__ import annotations

import json

import pytest

from conftest import QUICKSTART, REPO, run_cli
from vlm_configs import kept_by_autograd
from finetune.config import load_experiment
from finetune.errors import ConfigError
from finetune.estimate import as_dict, estimate, render_text
from finetune.estimate.census import census
from finetune.estimate.core import activation_bytes, regime
from finetune.estimate.memory import model_states
from finetune.estimate.settings import Layout, settings_of
from finetune.estimate.shapes import parameters, read_shape
from finetune.estimate.vision.llava_activations import encoder_layer_bytes

TINY_VLM = QUICKSTART / "tiny-vlm"
VLM = QUICKSTART / "vlm.yaml"
LLAVA_7B = REPO / "bench" / "models" / "llava-1.5-7b"  # llava-hf/llava-1.5-7b-hf's config.json
LLAVA_7B_PUBLISHED = 7_063_427_072  # the model card's "7.06B params" (safetensors total)
TINY_VLM_PARAMS = 675_200


def _built(path, meta: bool) -> dict[str, int]:
    """named_parameters() of the model transformers builds from the config: the truth."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta" if meta else "cpu"):
        model = AutoModelForImageTextToText.from_config(config)
    return {n: p.numel() for n, p in model.named_parameters()}


def test_tiny_vlm_parameters_are_transformers_own():
    real = _built(TINY_VLM, meta=False)
    counted = {p.name: p.numel for p in parameters(read_shape(str(TINY_VLM)), "lm")}
    assert counted == real
    assert sum(real.values()) == TINY_VLM_PARAMS


def test_llava_7b_parameters_are_transformers_own_and_the_published_count():
    """The published config leaves most values to the config classes' defaults (the text
    config names 7 keys): the estimator reads those from transformers' source."""
    real = _built(LLAVA_7B, meta=True)
    shape = read_shape(str(LLAVA_7B))
    assert {p.name: p.numel for p in parameters(shape, "lm")} == real
    assert sum(real.values()) == LLAVA_7B_PUBLISHED
    assert (shape.layers, shape.hidden, shape.vision.layers, shape.vision.layers_kept) == \
        (32, 4096, 24, 23)


def test_image_tokens_are_what_the_processor_makes():
    """The tiny VLM's processor expands one image into (32/8)^2 = 16 tokens (CLS dropped
    by vision_feature_select_strategy default); LLaVA-1.5's config says 576."""
    pytest.importorskip("torch")
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(TINY_VLM)
    image = Image.open(QUICKSTART / "data" / "vlm_train" / "0000.png")
    ids = processor(images=[image], text=[processor.image_token + " hi"])["input_ids"][0]
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert read_shape(str(TINY_VLM)).image_tokens == list(ids).count(image_token) == 16
    assert read_shape(str(LLAVA_7B)).image_tokens == 576


@pytest.mark.slow  # a training step / a CLI process: seconds
def test_model_states_and_activations_against_a_training_step(tmp_path):
    """The tiny VLM as full fine-tuning holds it (fp32, every parameter trainable), one
    step of a batch TRL's vision collator makes, under CPU autocast (bf16): weights,
    gradients and AdamW states exactly (post_layernorm, which LLaVA never reads, gets no
    .grad and no state); what autograd keeps within 1% of the estimate, for the whole model
    and for the images alone, with and without activation checkpointing."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    experiment = load_experiment(VLM, ["precision=bf16", "distributed.device=cpu"])
    shape = read_shape(str(TINY_VLM))
    settings = settings_of(experiment, max_positions=shape.max_positions).with_(
        images_per_row=1, device="cpu", attention="sdpa", mask="padding")
    states = model_states(census(shape, settings), [], settings, Layout("none"))

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(TINY_VLM),
                                                    dtype=torch.float32,
                                                    attn_implementation="sdpa")
    params = list(model.parameters())
    assert sum(p.numel() * p.element_size() for p in params) == states.trainable
    assert states.weights == 0

    data = QUICKSTART / "data"
    rows = [json.loads(line) for line in (data / "vlm_train.jsonl").read_text().splitlines()[:2]]
    rows = [{**r, "images": [str(data / i) for i in r["images"]]} for r in rows]
    batch = DataCollatorForVisionLanguageModeling(AutoProcessor.from_pretrained(TINY_VLM))(rows)
    tokens = batch["input_ids"].shape[1]
    storages = {p.untyped_storage().data_ptr() for p in params}
    model.train()
    out, kept = kept_by_autograd(lambda: model(**batch), storages)
    loss = out.loss
    loss.backward()
    with_grad = [p for p in params if p.grad is not None]
    assert {n for n, p in model.named_parameters() if p.grad is None} == {
        "model.vision_tower.post_layernorm.weight", "model.vision_tower.post_layernorm.bias"}
    assert sum(p.grad.numel() * p.grad.element_size() for p in with_grad) == states.gradients
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    optimizer.step()
    assert states.optimizer == sum(v.numel() * v.element_size()
                                   for state in optimizer.state.values() for v in state.values())

    # Activations at the batch's own length; the pixel_values are the batch's (kept alive
    # by the caller, not saved by autograd), so they are added to what was measured.
    acts = activation_bytes(shape, settings.with_(seq_len=tokens, logit_tokens=tokens),
                            Layout("none"), False)
    rows_n = len(rows)
    expected = rows_n * (acts.layers + acts.other + acts.logits_saved + acts.vision)
    expected += states.autocast
    measured = kept + batch["pixel_values"].numel() * 4
    assert abs(measured - expected) <= 0.01 * measured, (measured, expected)

    # The images' part alone (a few % of the above): the tower and projector by themselves.
    features, kept = kept_by_autograd(
        lambda: model.model.get_image_features(pixel_values=batch["pixel_values"]), storages)
    # Less the 16-bit weight copies the matmuls save (counted in the autocast row).
    copies = sum(2 * t.numel for t in census(shape, settings) if t.role in ("linear", "conv")
                 and t.name.startswith(("model.vision_tower.", "model.multi_modal_projector.")))
    measured = kept - copies + batch["pixel_values"].numel() * 4
    assert abs(measured - rows_n * acts.vision) <= 0.01 * measured, (measured, acts.vision)

    # With activation checkpointing the encoder layers keep only their inputs; the one
    # layer recomputed at a time in the backward is not alive yet at the forward's end.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    features, kept = kept_by_autograd(
        lambda: model.model.get_image_features(pixel_values=batch["pixel_values"]), storages)
    outside = sum(2 * t.numel for t in census(shape, settings) if t.role in ("linear", "conv")
                  and t.name.startswith(("model.vision_tower.embeddings.",
                                         "model.multi_modal_projector.")))
    # Checkpointed layers save no weight copies either: only the patch embedding's and
    # the projector's are in what autograd keeps.
    measured = kept - outside + batch["pixel_values"].numel() * 4
    checkpointed = activation_bytes(shape, settings, Layout("none"), True).vision
    recomputed = shape.vision.positions * encoder_layer_bytes(
        shape.vision, regime(settings, Layout("none")))
    expected = rows_n * (checkpointed - recomputed)
    assert abs(measured - expected) <= 0.01 * measured, (measured, expected)


@pytest.mark.slow  # a training step / a CLI process: seconds
def test_cli_vlm_table_and_json(tmp_path):
    result = run_cli("estimate", str(VLM), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for text in ("model: llava, 675,200 parameters",
                 "language model 569,728, vision tower 80,640, projector 24,832",
                 "vision tower and projector activations (1 image per row)",
                 "1 image per row (assumed; the estimate does not read the data), each "
                 "resized to 32x32", "16 of the 64 tokens of each row"):
        assert text in result.stdout, text
    result = run_cli("estimate", str(VLM), "--json", cwd=tmp_path)
    data = json.loads(result.stdout)
    assert data["model"]["parts"] == {"language_model": 569_728, "vision_tower": 80_640,
                                      "projector": 24_832}
    assert data["model"]["image_tokens"] == 16 and data["settings"]["images_per_row"] == 1
    assert data["configured"]["bytes"]["vision"] > 0


def test_llava_7b_full_fine_tuning_on_8_gpus():
    """The parts and the per-image activations at LLaVA-1.5's size: 576 image tokens in a
    2048-token row; the vision row grows with the images per row."""
    experiment = load_experiment(VLM, [f"model.name_or_path={LLAVA_7B}",
                                       "training.max_length=2048",
                                       "training.per_device_train_batch_size=4",
                                       "training.activation_checkpointing=true"])
    one = estimate(experiment, gpus=8)
    two = estimate(experiment, gpus=8, images_per_row=2)
    assert one.params == one.trainable_params == LLAVA_7B_PUBLISHED
    assert one.parts == {"language_model": 6_738_939_904, "vision_tower": 303_507_456,
                         "projector": 20_979_712}
    vision = {key: b for key, _, b in one.configured.rows}["vision"]
    assert {key: b for key, _, b in two.configured.rows}["vision"] == 2 * vision
    assert "576 of the 2048 tokens of each row" in render_text(one)
    assert as_dict(one)["recommendation"][0].startswith(
        "cheapest setup that fits 8 x 80.0 GiB at micro batch 4: deepspeed ZeRO-1")


def test_other_vision_language_models_are_refused_by_name(tmp_path):
    config = json.loads((LLAVA_7B / "config.json").read_text())
    other = tmp_path / "llava_onevision"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llava_onevision"}))
    with pytest.raises(ConfigError, match="'llava_onevision' is a vision-language model the "
                                          "estimator does not count yet"):
        read_shape(str(other))
    siglip = tmp_path / "siglip"
    siglip.mkdir()
    (siglip / "config.json").write_text(json.dumps(
        {**config, "vision_config": {"model_type": "siglip_vision_model"}}))
    with pytest.raises(ConfigError, match="'siglip_vision_model' vision tower is not counted"):
        read_shape(str(siglip))


def test_tensor_parallel_splits_only_the_language_model():
    """LLaVA's tp_plan is its language model's (transformers models/llava): the vision
    tower and the projector are held whole by every process of the group."""
    from finetune.estimate.memory import tensor_parallel_share

    experiment = load_experiment(VLM, [f"model.name_or_path={LLAVA_7B}"])
    shape = read_shape(str(LLAVA_7B))
    tensors = census(shape, settings_of(experiment, max_positions=shape.max_positions))
    held = {t.name: t.numel for t in tensor_parallel_share(tensors, 2)}
    for t in tensors:
        split = t.role in ("linear", "bias") and t.name.startswith("model.language_model.")
        assert held[t.name] == (-(-t.numel // 2) if split else t.numel), t.name


def test_estimate_refuses_what_a_vlm_does_not_train_with():
    """validate refuses a method that does not train a local VLM; a cached hub model's
    config is first read by the estimate, which refuses it itself (the experiment is the
    text quickstart's with the model swapped after validation, as a hub model's would pass
    validate)."""
    experiment = load_experiment(QUICKSTART / "classify.yaml")  # classify takes no images
    swapped = experiment.model_copy(update={"model": experiment.model.model_copy(
        update={"name_or_path": str(TINY_VLM)})})
    with pytest.raises(ConfigError, match="vision-language model trains only with"):
        estimate(swapped)


def test_a_row_shorter_than_its_images_is_said():
    text = render_text(estimate(load_experiment(VLM), seq_len=8))
    assert "1 image per row is 16 image tokens, more than the 8 tokens of a row: training " \
           "refuses such rows" in text


@pytest.mark.slow  # a training step / a CLI process: seconds
def test_layers_past_the_feature_layer_keep_nothing_and_get_no_gradient(tmp_path):
    """LLaVA-1.5's vision_feature_layer -2 on a 3-layer tower: the last layer runs, but
    nothing of it reaches the loss: no .grad for its parameters, and its saved tensors
    are freed with its graph (the estimate keeps 2 layers)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = json.loads((TINY_VLM / "config.json").read_text())
    config["vision_feature_layer"] = -2
    config["vision_config"]["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = read_shape(str(tmp_path))
    assert shape.vision.layers_kept == 2
    experiment = load_experiment(VLM, ["precision=bf16", "distributed.device=cpu"])
    settings = settings_of(experiment, max_positions=shape.max_positions).with_(
        images_per_row=1, device="cpu", attention="sdpa", mask="padding")
    tensors = census(shape, settings)

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(tmp_path),
                                                    dtype=torch.float32,
                                                    attn_implementation="sdpa").train()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    pixels = torch.randn(2, 3, 32, 32)
    features, kept = kept_by_autograd(
        lambda: model.model.get_image_features(pixel_values=pixels).pooler_output, storages)
    kept_copies = sum(2 * t.numel for t in tensors if t.role in ("linear", "conv")
                      and t.name.startswith(("model.vision_tower.", "model.multi_modal_projector."))
                      and not t.name.startswith("model.vision_tower.encoder.layers.2."))
    measured = kept - kept_copies + pixels.numel() * 4
    expected = 2 * activation_bytes(shape, settings, Layout("none"), False).vision
    assert abs(measured - expected) <= 0.01 * measured, (measured, expected)

    torch.cat(list(features)).float().sum().backward()  # pooler_output: one per image
    no_grad = {n for n, p in model.named_parameters()
               if p.grad is None and not n.startswith("model.language_model.")}
    assert no_grad == {t.name for t in tensors if not t.gradient}
    assert any(".encoder.layers.2." in name for name in no_grad)


@pytest.mark.slow
def test_llava_15_tower_activations_at_full_size():
    """LLaVA-1.5's CLIP ViT-L/14-336 tower and projector, random weights, one image under
    CPU autocast: what autograd keeps against the estimate (637.4 MiB; about 8 s and 2 GB
    of memory on the CPU)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig
    from transformers.models.clip.modeling_clip import CLIPVisionModel
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    config = AutoConfig.from_pretrained(LLAVA_7B)
    config.vision_config._attn_implementation = "sdpa"
    tower = CLIPVisionModel(config.vision_config).train()
    projector = LlavaMultiModalProjector(config).train()
    storages = {p.untyped_storage().data_ptr()
                for module in (tower, projector) for p in module.parameters()}
    pixels = torch.randn(1, 3, 336, 336)
    features, kept = kept_by_autograd(
        lambda: projector(tower(pixel_values=pixels, output_hidden_states=True)
                          .hidden_states[-2][:, 1:]), storages)
    shape = read_shape(str(LLAVA_7B))
    experiment = load_experiment(VLM, [f"model.name_or_path={LLAVA_7B}", "precision=bf16",
                                       "distributed.device=cpu"])
    settings = settings_of(experiment, max_positions=shape.max_positions).with_(
        images_per_row=1, device="cpu", attention="sdpa")
    copies = sum(2 * t.numel for t in census(shape, settings) if t.role in ("linear", "conv")
                 and t.name.startswith(("model.vision_tower.", "model.multi_modal_projector."))
                 and not t.name.startswith("model.vision_tower.encoder.layers.23."))
    measured = kept - copies + pixels.numel() * 4
    expected = activation_bytes(shape, settings, Layout("none"), False).vision
    assert abs(measured - expected) <= 0.001 * measured, (measured, expected)
