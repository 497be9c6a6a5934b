"""`finetune estimate` for the vision-language families past LLaVA (test_estimate_vision.py):
every family's parts against transformers' (the published configs in vlm_configs.py, built
on the meta device; Qwen3-VL and Qwen3.5 in detail: test_estimate_qwen3_vl.py,
test_estimate_qwen3_5.py), Qwen2-VL's and Qwen2.5-VL's tokens against its image processor and
their towers' activations against autograd (small towers, random weights, CPU autocast),
a frozen tower, the picture's size and the CLI's flags, and bad configs. Gemma 3,
PaliGemma, LLaVA-NeXT and Idefics3 in detail: test_estimate_siglip_and_tiled_vlms.py."""

from __future__ import annotations

import json
import re

import pytest

from conftest import QUICKSTART, run_cli
from vlm_configs import (CPU_AUTOCAST, GEMMA3_4B, LLAVA_NEXT_7B, PALIGEMMA2_3B, PALIGEMMA_3B,
                         QWEN2_VL_2B, QWEN3_5_0_8B, QWEN3_5_DEFAULTS, QWEN3_VL_2B, QWEN3_VL_8B,
                         QWEN25_VL_3B, SMOLVLM_256M, qwen_tower_kept)
from vlm_configs import model_dir as _model
from finetune.config import load_experiment
from finetune.errors import ConfigError
from finetune.estimate import estimate, parse_image_size, render_text
from finetune.estimate.census import census
from finetune.estimate.shapes import parameters, read_shape
from finetune.estimate.vision import Training
from finetune.estimate.vision import qwen2_vl_activations

VLM = QUICKSTART / "vlm.yaml"
# By part, as transformers builds them (the slow test below computes them with
# AutoModelForImageTextToText.from_config on the meta device); the totals are the model
# cards' (2.21B, 3.75B, 4.3B, 2.92B, 3.03B, 7.57B).
PARTS = {
    "qwen2-vl-2b": (QWEN2_VL_2B, {"language_model": 1_543_714_304, "vision_tower": 631_183_360,
                                  "projector": 34_087_936}),
    "qwen2.5-vl-3b": (QWEN25_VL_3B, {"language_model": 3_085_938_688,
                                     "vision_tower": 631_975_680, "projector": 36_708_608}),
    # the projector: the merger and Qwen3-VL's 3 deepstack mergers (2.13B, 8.77B)
    "qwen3-vl-2b": (QWEN3_VL_2B, {"language_model": 1_720_574_976,
                                  "vision_tower": 306_242_560, "projector": 100_714_496}),
    "qwen3-vl-8b": (QWEN3_VL_8B, {"language_model": 8_190_735_360,
                                  "vision_tower": 415_891_440, "projector": 160_496_896}),
    # Qwen3.5-0.8B (its embeddings tied) and Qwen3_5Config's defaults (9.41B)
    "qwen3.5-0.8b": (QWEN3_5_0_8B, {"language_model": 752_393_024, "vision_tower": 88_004_352,
                                    "projector": 12_588_544}),
    "qwen3.5-defaults": (QWEN3_5_DEFAULTS, {"language_model": 8_953_803_264,
                                            "vision_tower": 415_891_440,
                                            "projector": 37_759_232}),
    "gemma-3-4b": (GEMMA3_4B, {"language_model": 3_880_263_168, "vision_tower": 416_866_032,
                               "projector": 2_950_272}),
    "paligemma-3b": (PALIGEMMA_3B, {"language_model": 2_508_662_784,
                                    "vision_tower": 412_442_352, "projector": 2_361_344}),
    "paligemma2-3b": (PALIGEMMA2_3B, {"language_model": 2_617_143_552,
                                      "vision_tower": 412_442_352, "projector": 2_656_512}),
    # the projector with image_newline
    "llava-v1.6-mistral-7b": (LLAVA_NEXT_7B, {"language_model": 7_242_256_384,
                                              "vision_tower": 303_507_456,
                                              "projector": 20_983_808}),
    "smolvlm-256m": (SMOLVLM_256M, {"language_model": 162_974_016, "vision_tower": 86_433_024,
                                    "projector": 7_077_888}),
    # the same under SmolVLM's own model types (transformers models/smolvlm)
    "smolvlm-256m-as-smolvlm": (
        {**SMOLVLM_256M, "model_type": "smolvlm",
         "architectures": ["SmolVLMForConditionalGeneration"],
         "vision_config": {**SMOLVLM_256M["vision_config"], "model_type": "smolvlm_vision"}},
        {"language_model": 162_974_016, "vision_tower": 86_433_024, "projector": 7_077_888}),
}
# Small towers of each family for autograd (2 and 3 blocks; Qwen2.5-VL's block 1 attends
# over the whole image, the others within windows).
SMALL = {"qwen2_vl": (QWEN2_VL_2B, {"depth": 2, "embed_dim": 64, "num_heads": 4,
                                    "hidden_size": 96}),
         "qwen2_5_vl": (QWEN25_VL_3B, {"depth": 3, "hidden_size": 64, "intermediate_size": 80,
                                       "num_heads": 4, "out_hidden_size": 96,
                                       "fullatt_block_indexes": [1]})}
# (picture size, processor settings) -> the grid Qwen2-VL's image processor makes (t, h, w)
IMAGES = [((640, 480), {}, (1, 34, 46)), ((1920, 1080), {}, (1, 52, 94)),
          ((100, 60), {}, (1, 4, 8)), ((1920, 1080), {"max_pixels": 200_000}, (1, 22, 42)),
          ((1920, 1080), {"size": {"shortest_edge": 3136, "longest_edge": 200_000}},
           (1, 22, 42)), ((3000, 20), {}, (1, 2, 214))]


@pytest.mark.parametrize("name", PARTS)
def test_parts_and_total(tmp_path, name):
    config, parts = PARTS[name]
    result = estimate(load_experiment(VLM, [f"model.name_or_path={_model(tmp_path, config)}"]))
    assert result.parts == parts
    assert result.params == result.trainable_params == sum(parts.values())


@pytest.mark.slow  # imports torch; the meta device builds no weights (about 6 s)
def test_parameters_are_transformers_own(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForImageTextToText

    for config, _ in PARTS.values():
        path = _model(tmp_path, config)
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))
        real = {n: p.numel() for n, p in model.named_parameters()}
        assert {p.name: p.numel for p in parameters(read_shape(str(path)), "lm")} == real


@pytest.mark.parametrize("size, processor, grid", IMAGES)
def test_image_tokens_follow_the_picture_and_the_processor(tmp_path, size, processor, grid):
    """smart_resize: multiples of 28 pixels within min/max pixels (preprocessor_config.json's
    min_pixels/max_pixels or size, else the image processor class's default)."""
    shape = read_shape(str(_model(tmp_path, QWEN2_VL_2B, processor or None)))
    vision = shape.vision.for_image(size)
    _, h, w = grid
    assert (vision.positions, vision.image_tokens) == (h * w, h * w // 4)


@pytest.mark.slow  # imports transformers' image processor (seconds, most of it the import)
def test_image_tokens_are_what_the_processor_makes(tmp_path):
    pytest.importorskip("torch")
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    for size, processor, grid in IMAGES:
        made = Qwen2VLImageProcessorPil(**processor)(images=[Image.new("RGB", size)],
                                                     return_tensors="np")
        assert tuple(made["image_grid_thw"][0]) == grid, size


@pytest.mark.slow  # imports torch; small towers (about 3 s)
@pytest.mark.parametrize("family", SMALL)
def test_image_activations_against_autograd(tmp_path, family):
    """A small tower and merger of each family, fp32 weights, one 448x336 picture, CPU
    autocast: what autograd keeps equals the estimate to the byte, with the whole tower
    training, with a frozen tower, and with activation checkpointing (there less what the
    saved-tensor hooks cannot see: the rotary cos/sin the checkpointed blocks hold, and
    the one block recomputed in the backward, not alive yet)."""
    pytest.importorskip("torch")
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel)
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel)

    config, small = SMALL[family]
    config = {**config, "vision_config": {**config["vision_config"], **small}}
    path = _model(tmp_path, config)
    vision = read_shape(str(path)).vision.for_image((448, 336))
    build = {"qwen2_vl": Qwen2VisionTransformerPretrainedModel,
             "qwen2_5_vl": Qwen2_5_VisionTransformerPretrainedModel}[family]
    tower, kept = qwen_tower_kept(build, path, vision)

    def measured(copied) -> int:
        features, saved = kept(copied)
        assert features.shape[0] == vision.image_tokens
        return saved

    assert measured(lambda name: True) == vision.image_bytes(CPU_AUTOCAST, False)
    for p in tower.parameters():
        p.requires_grad_(not p is tower.patch_embed.proj.weight and
                         not any(p is q for q in tower.blocks.parameters()))
    assert measured(lambda name: name.startswith("merger.")) == vision.image_bytes(
        CPU_AUTOCAST, False, Training(tower=False))
    for p in tower.parameters():
        p.requires_grad_(True)
    tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    recomputed = max(qwen2_vl_activations.block_bytes(vision, CPU_AUTOCAST, n)
                     for n in range(vision.layers))
    cos_sin = 2 * vision.head_dim * 4
    assert measured(lambda name: not name.startswith("blocks.")) == vision.image_bytes(
        CPU_AUTOCAST, True) - vision.positions * (recomputed + cos_sin)


def test_frozen_tower_and_projector(tmp_path):
    """A frozen part keeps its fp32 weights without gradients or optimizer states and
    saves nothing for the backward: only the batch's pixels are left of the images'
    activations when both are frozen."""
    experiment = load_experiment(VLM, [f"model.name_or_path={_model(tmp_path, QWEN2_VL_2B)}"])
    whole = estimate(experiment)
    frozen = estimate(experiment, vision_training=Training(tower=False))
    neither = estimate(experiment, vision_training=Training(tower=False, projector=False))
    parts = PARTS["qwen2-vl-2b"][1]
    assert whole.trainable_params - frozen.trainable_params == parts["vision_tower"]
    assert neither.trainable_params == parts["language_model"]
    assert frozen.params == neither.params == whole.params

    def rows(result):
        return {key: b for key, _, b in result.configured.rows}

    v = neither.shape.vision
    assert rows(neither)["vision"] == \
        neither.settings.micro_batch * v.positions * v.patch_values * 4  # the pixels alone
    assert rows(whole)["vision"] > rows(frozen)["vision"] > rows(neither)["vision"]
    assert rows(whole)["gradients"] - rows(frozen)["gradients"] == 4 * parts["vision_tower"]
    assert "frozen: vision tower (no gradients" in render_text(frozen)
    tensors = census(frozen.shape, frozen.settings)
    assert not any(t.trainable or t.matmul for t in tensors
                   if t.name.startswith("model.visual.") and ".merger." not in t.name)


def test_picture_size_and_images_per_row(tmp_path):
    experiment = load_experiment(VLM, [f"model.name_or_path={_model(tmp_path, QWEN25_VL_3B)}",
                                       "training.max_length=2048"])
    default = estimate(experiment)
    wide = estimate(experiment, image_size=(1920, 1080), images_per_row=2)
    assert default.shape.image_tokens == 391 and wide.shape.image_tokens == 1222
    text = render_text(wide)
    assert "each 1920x1080 pixels (assumed; --image-size sets it), resized by the processor " \
           "to 1316x728" in text
    assert "2 images per row is 2444 image tokens, more than the 2048 tokens" in text
    with pytest.raises(ConfigError, match="--image-size: 4000x10 has an aspect ratio over 200"):
        estimate(experiment, image_size=(4000, 10))


@pytest.mark.slow  # a CLI process
def test_cli_image_size_and_images_per_row(tmp_path):
    model = _model(tmp_path, QWEN2_VL_2B)
    result = run_cli("estimate", str(VLM), f"model.name_or_path={model}", "--image-size",
                     "1920x1080", "--images-per-row", "2", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["model"]["image_tokens"] == 1222 and data["settings"]["images_per_row"] == 2
    assert data["settings"]["image_size"] == [1920, 1080]


def test_parse_image_size():
    assert parse_image_size("1920x1080") == (1920, 1080)
    assert parse_image_size(" 448 ") == (448, 448)
    for bad in ("wide", "0x10", "10x", "99999x10"):
        with pytest.raises(ValueError):
            parse_image_size(bad)

def _with(config: dict, **vision) -> dict:
    return {**config, "vision_config": {**config["vision_config"], **vision}}


@pytest.mark.parametrize("config, processor, message", [
    (QWEN2_VL_2B, {"min_pixels": 10_000, "max_pixels": 5_000},
     "the processor's min_pixels 10,000 is more than its max_pixels 5,000"),
    (QWEN2_VL_2B, {"max_pixels": "many"}, "preprocessor_config.size.longest_edge must be"),
    (_with(QWEN2_VL_2B, patch_size=[14, 14]), None, "vision_config.patch_size must be one"),
    ({**GEMMA3_4B, "mm_tokens_per_image": 200}, None, "mm_tokens_per_image 200 is not a square"),
    (_with(GEMMA3_4B, vision_use_head=True), None, "vision_use_head is true"),
    ({**PALIGEMMA_3B, "projection_dim": 1000}, None, "projection_dim 1000 is not text_config"),
    ({k: v for k, v in PALIGEMMA_3B.items() if k != "text_config"}, None,
     "a paligemma config without a text_config object"),
    ({**LLAVA_NEXT_7B, "image_grid_pinpoints": [[300, 600]]}, None,
     "image_grid_pinpoints must be multiples of the tower's image_size 336"),
    ({**SMOLVLM_256M, "scale_factor": 5}, None, "scale_factor 5 does not divide the tower's 32"),
    (_with(SMOLVLM_256M, model_type="clip_vision_model"), None,
     "'clip_vision_model' vision tower is not counted"),
], ids=["qwen-pixels", "qwen-pixels-type", "qwen-patch", "gemma3-tokens", "gemma3-head",
        "paligemma-projection", "paligemma-text", "llava-next-pinpoints", "idefics3-scale",
        "idefics3-tower"])
def test_bad_configs_are_one_error_naming_the_key(tmp_path, config, processor, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_shape(str(_model(tmp_path, config, processor)))
