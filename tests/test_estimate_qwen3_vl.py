"""`finetune estimate` for Qwen3-VL (vision/qwen3_vl.py): the published configs' parts
against what transformers builds (the meta device), every parameter by name on a small
model, the tokens against its image processor (Qwen2-VL's, 16-pixel patches), the tower's
and the deepstack mergers' activations against autograd (a small tower, random weights,
CPU autocast), what trains under the vision section, bad configs and the CLI. LoRA and
QLoRA against apply_peft: test_estimate_vision_peft.py's published-config cases."""

from __future__ import annotations

import json
import re

import pytest

from conftest import QUICKSTART, run_cli
from test_estimate_vision_families import PARTS as FAMILIES
from vlm_configs import (CPU_AUTOCAST, QWEN3_VL_2B, QWEN3_VL_8B, QWEN3_VL_PROCESSOR,
                         model_dir, qwen_tower_kept)
from finetune.config import load_experiment
from finetune.errors import ConfigError
from finetune.estimate import estimate, render_text
from finetune.estimate.census import census
from finetune.estimate.shapes import parameters, read_shape
from finetune.estimate.vision import Training
from finetune.estimate.vision import qwen2_vl_activations

VLM = QUICKSTART / "vlm.yaml"
# By part (test_estimate_vision_families.py checks them against the estimate)
PARTS = {name: FAMILIES[name] for name in ("qwen3-vl-2b", "qwen3-vl-8b")}
PUBLISHED = {k: v for k, v in QWEN3_VL_PROCESSOR.items()
             if k in ("patch_size", "temporal_patch_size", "merge_size", "size")}
# (picture size, preprocessor_config.json, the grid Qwen3-VL's image processor makes (t, h, w))
IMAGES = [((640, 480), None, (1, 30, 40)), ((1920, 1080), None, (1, 46, 82)),
          ((100, 60), None, (1, 4, 6)), ((640, 480), PUBLISHED, (1, 30, 40)),
          ((1920, 1080), PUBLISHED, (1, 68, 120)), ((100, 60), PUBLISHED, (1, 14, 22)),
          ((3000, 20), PUBLISHED, (1, 2, 188)), ((4000, 3000), PUBLISHED, (1, 188, 250)),
          ((1920, 1080), {"max_pixels": 200_000}, (1, 20, 36)),
          ((1920, 1080), {"size": {"shortest_edge": 3136, "longest_edge": 200_000}},
           (1, 20, 36))]
# A small Qwen3-VL: a 3-block tower whose blocks 0 and 2 (the last: the merger's input
# too) feed deepstack mergers, and a 2-layer language model.
SMALL_TOWER = {"depth": 3, "hidden_size": 64, "intermediate_size": 80, "num_heads": 4,
               "out_hidden_size": 96, "num_position_embeddings": 64,
               "deepstack_visual_indexes": [0, 2]}
SMALL = {**QWEN3_VL_2B, "tie_word_embeddings": False,
         "vision_config": {**QWEN3_VL_2B["vision_config"], **SMALL_TOWER},
         "text_config": {**QWEN3_VL_2B["text_config"], "hidden_size": 96,
                         "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
                         "vocab_size": 151_936, "tie_word_embeddings": False}}


def _with(config: dict, part: str = "vision_config", **values) -> dict:
    return {**config, part: {**config[part], **values}}


def _meta_model(path):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))


@pytest.mark.slow  # imports torch; the meta device builds no weights (about 3 s)
def test_parameters_are_transformers_own(tmp_path):
    """By name, count and order: the published configs, and a small one untied with its
    deepstack merger on the tower's last block."""
    pytest.importorskip("torch")
    for config in [c for c, _ in PARTS.values()] + [SMALL]:
        path = model_dir(tmp_path, config)
        real = [(n, p.numel()) for n, p in _meta_model(path).named_parameters()]
        assert [(p.name, p.numel) for p in parameters(read_shape(str(path)), "lm")] == real


@pytest.mark.parametrize("size, processor, grid", IMAGES)
def test_image_tokens_follow_the_picture_and_the_processor(tmp_path, size, processor, grid):
    """smart_resize to multiples of 32 pixels within the processor's size (the published
    preprocessor_config.json's 65,536 to 16,777,216 pixels, else Qwen2-VL's image
    processor class's 3,136 to 1,003,520), then 2x2 patches of 16 pixels a token."""
    vision = read_shape(str(model_dir(tmp_path, QWEN3_VL_2B, processor))).vision.for_image(size)
    _, h, w = grid
    assert (vision.positions, vision.image_tokens) == (h * w, h * w // 4)


@pytest.mark.slow  # imports transformers' image processor (seconds, most of it the import)
def test_image_tokens_are_what_the_processor_makes():
    """Qwen3-VL's processor is Qwen2-VL's image processor with 16-pixel patches (what its
    preprocessor_config.json sets; the class's own size where it sets none)."""
    pytest.importorskip("torch")
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    for size, processor, grid in IMAGES:
        settings = {"patch_size": 16, "merge_size": 2, **(processor or {})}
        made = Qwen2VLImageProcessorPil(**settings)(images=[Image.new("RGB", size)],
                                                    return_tensors="np")
        assert tuple(made["image_grid_thw"][0]) == grid, size


@pytest.mark.slow  # imports torch; a small tower (about 2 s)
def test_image_activations_against_autograd(tmp_path):
    """The small tower, fp32 weights, one 448x336 picture, CPU autocast: what autograd
    keeps equals the estimate to the byte with the whole tower training, with the tower
    frozen but its mergers (the position embeddings too), and with activation
    checkpointing (there less what the saved-tensor hooks cannot see: the rotary cos/sin
    the checkpointed blocks hold and the one block recomputed in the backward)."""
    pytest.importorskip("torch")
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    path = model_dir(tmp_path, SMALL)
    vision = read_shape(str(path)).vision.for_image((448, 336))
    tower, kept = qwen_tower_kept(Qwen3VLVisionModel, path, vision)
    mergers = ("merger.", "deepstack_merger_list.")

    def measured(copied) -> int:
        (features, deepstack), saved = kept(copied, lambda out: (out.pooler_output,
                                                                 out.deepstack_features))
        assert features.shape[0] == vision.image_tokens and len(deepstack) == 2
        return saved

    assert measured(lambda name: True) == vision.image_bytes(CPU_AUTOCAST, False)
    for name, p in tower.named_parameters():
        p.requires_grad_(name.startswith(mergers))
    assert measured(lambda name: name.startswith(mergers)) == vision.image_bytes(
        CPU_AUTOCAST, False, Training(tower=False))
    for p in tower.parameters():
        p.requires_grad_(True)
    tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    recomputed = max(qwen2_vl_activations.block_bytes(vision, CPU_AUTOCAST, n)
                     for n in range(vision.layers))
    cos_sin = 2 * vision.head_dim * 4
    assert measured(lambda name: not name.startswith("blocks.")) == vision.image_bytes(
        CPU_AUTOCAST, True) - vision.positions * (recomputed + cos_sin)


@pytest.mark.slow  # imports torch; a tiny model's one step (about 1 s)
def test_deepstack_mergers_past_the_language_model_get_no_gradient(tmp_path):
    """A deepstack feature per language model layer: with one layer the second deepstack
    merger's feature is made and never read, so its parameters get no gradient, as
    unreached() says; everything else gets one."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = _with(_with(SMALL, depth=2, deepstack_visual_indexes=[0, 1]), "text_config",
                   num_hidden_layers=1, vocab_size=1000)
    config.update(image_token_id=900, video_token_id=901, vision_start_token_id=902,
                  vision_end_token_id=903)
    path = model_dir(tmp_path, config)
    vision = read_shape(str(path)).vision.for_image((64, 64))
    assert vision.unreached() == ("model.visual.deepstack_merger_list.1.",)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))
    tokens = vision.image_tokens
    ids = torch.tensor([[902] + [900] * tokens + [903, 5, 6]])
    model(input_ids=ids, labels=ids, pixel_values=torch.randn(vision.positions,
                                                              vision.patch_values),
          image_grid_thw=torch.tensor([[1, 4, 4]]),
          mm_token_type_ids=(ids == 900).int()).loss.backward()
    unreached = {n for n, p in model.named_parameters() if p.grad is None}
    assert unreached == {n for n, _ in model.named_parameters()
                         if n.startswith(vision.unreached())}


def test_the_mergers_train_and_freeze_with_the_tower(tmp_path):
    """As Qwen2-VL's merger: they sit inside the tower (model.visual), so a frozen tower
    freezes them, they count as the projector, and LoRA's train_projector is refused as
    training refuses it; their Linears are the tower's for LoRA and stay unquantized."""
    path = model_dir(tmp_path, QWEN3_VL_2B)
    parts = PARTS["qwen3-vl-2b"][1]
    frozen = estimate(load_experiment(VLM, [f"model.name_or_path={path}",
                                            "vision.freeze_tower=true"]))
    assert frozen.trainable_params == parts["language_model"]
    assert frozen.settings.vision_training == Training(tower=False, projector=False)
    with pytest.raises(ConfigError, match="no projector beside its vision tower"):
        estimate(load_experiment(VLM, [f"model.name_or_path={path}", "peft.type=lora",
                                       "vision.train_projector=true"]))
    lora = estimate(load_experiment(VLM, [f"model.name_or_path={path}", "peft.type=qlora",
                                          "peft.r=2", "vision.freeze_tower=false"]))
    adapters = {t.name for t in census(lora.shape, lora.settings) if t.role == "lora"}
    for module in ("model.visual.blocks.0.mlp.linear_fc1", "model.visual.merger.linear_fc2",
                   "model.visual.deepstack_merger_list.2.linear_fc1"):
        assert f"{module}.lora_A" in adapters
    quantized = {t.name for t in census(lora.shape, lora.settings) if t.dtype == "nf4"}
    assert quantized and all(n.startswith("model.language_model.") for n in quantized)


def test_an_image_in_the_report(tmp_path):
    experiment = load_experiment(VLM, [f"model.name_or_path={model_dir(tmp_path, QWEN3_VL_8B)}",
                                       "training.max_length=2048"])
    text = render_text(estimate(experiment, image_size=(1920, 1080)))
    assert "each 1920x1080 pixels (assumed; --image-size sets it), resized by the processor " \
           "to 1312x736 (multiples of 32, 3,136 to 1,003,520 pixels): 943 tokens" in text
    assert "vision tower: qwen3_vl_vision, 27 blocks over 3772 patches an image (attention " \
           "over the whole image), all kept for the backward; blocks 8, 16, 24 also feed " \
           "the language model's first 3 layers (deepstack)" in text
    with pytest.raises(ConfigError, match="--image-size: 4000x10 has an aspect ratio over 200"):
        estimate(experiment, image_size=(4000, 10))


@pytest.mark.slow  # a CLI process
def test_cli_shows_the_tower_and_the_tokens(tmp_path):
    model = model_dir(tmp_path, QWEN3_VL_2B, QWEN3_VL_PROCESSOR)
    result = run_cli("estimate", str(VLM), f"model.name_or_path={model}",
                     "training.max_length=1024", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for text in ("model: qwen3_vl, 2.128B parameters",
                 "vision tower: qwen3_vl_vision, 24 blocks over 1200 patches an image",
                 "300 tokens an image (1200 patches, merged 2x2)",
                 "65,536 to 16,777,216 pixels",
                 "vision tower and projector activations (1 image per row)"):
        assert text in result.stdout, text
    data = json.loads(run_cli("estimate", str(VLM), f"model.name_or_path={model}", "--json",
                              cwd=tmp_path).stdout)
    assert data["model"]["image_tokens"] == 300
    assert data["model"]["parts"] == PARTS["qwen3-vl-2b"][1]


@pytest.mark.parametrize("config, processor, message", [
    (_with(QWEN3_VL_2B, patch_size=16.0), None, "vision_config.patch_size must be one integer"),
    (_with(QWEN3_VL_2B, temporal_patch_size=[2, 2]), None,
     "vision_config.temporal_patch_size must be one integer"),
    (_with(QWEN3_VL_2B, deepstack_visual_indexes=[5, 24]), None,
     "vision_config.deepstack_visual_indexes must be distinct block indexes in 0..23"),
    (_with(QWEN3_VL_2B, num_position_embeddings=0), None,
     "vision_config.num_position_embeddings must be an integer"),
    (QWEN3_VL_2B, {"size": {"shortest_edge": 10_000, "longest_edge": 5_000}},
     "the processor's min_pixels 10,000 is more than its max_pixels 5,000"),
    ({**QWEN3_VL_2B, "text_config": "big"}, None, "text_config must be an object"),
    # qwen3_vl_moe is counted (test_estimate_moe.py); its text read with its class's
    # defaults (60 experts) where the config names none
    ({**QWEN3_VL_2B, "model_type": "qwen3_vl_moe",
      "text_config": {**QWEN3_VL_2B["text_config"], "num_experts_per_tok": 64}}, None,
     "num_experts_per_tok (64) must be at most num_experts (60)"),
], ids=["patch", "temporal-patch", "deepstack", "positions", "pixels", "text", "moe"])
def test_bad_configs_are_one_error_naming_the_key(tmp_path, config, processor, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as raised:
        read_shape(str(model_dir(tmp_path, config, processor)))
    assert len(raised.value.problems) == 1
