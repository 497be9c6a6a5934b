"""`finetune estimate` for Mistral 3 (a Pixtral tower at the picture's own resolution and a
patch-merging projector) and InternVL (an InternViT tower over tiles, a pixel-shuffle
projector): their parts against transformers' (Mistral Small 3.1's and InternVL3
1B/2B's config.json, built on the meta device), the tokens a picture becomes against
their image processors and models, and what one image keeps for the backward against
autograd (small models, random weights, CPU autocast). Llama 3.2 Vision (mllama):
test_estimate_mllama.py."""

from __future__ import annotations

import re

import pytest

from conftest import QUICKSTART
from vlm_configs import CPU_AUTOCAST, kept_by_autograd
from vlm_configs import model_dir as _model
from finetune.config import load_experiment
from finetune.errors import ConfigError
from finetune.estimate import estimate, render_text
from finetune.estimate.shapes import parameters, read_shape
from finetune.estimate.vision import Training, pixtral_activations
from finetune.estimate.vision.llava_activations import encoder_layer_bytes

VLM = QUICKSTART / "vlm.yaml"
# mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json (transcribed from memory, not
# checked against the hub file) and its processor's longest edge. It names no top-level
# tie_word_embeddings: transformers 5 takes Mistral3Config's default (true) and ties the
# head to the embeddings, so it builds 23.34B parameters, not the card's 24B.
MISTRAL_SMALL_31 = {
    "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10,
    "model_type": "mistral3", "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "text_config": {"attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu",
                    "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 32768,
                    "max_position_embeddings": 131072, "model_type": "mistral",
                    "num_attention_heads": 32, "num_hidden_layers": 40,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                    "rope_theta": 1000000000.0, "sliding_window": None, "use_cache": True,
                    "vocab_size": 131072},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"attention_dropout": 0.0, "head_dim": 64, "hidden_act": "silu",
                      "hidden_size": 1024, "image_size": 1540, "initializer_range": 0.02,
                      "intermediate_size": 4096, "model_type": "pixtral",
                      "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 24,
                      "patch_size": 14, "rope_theta": 10000.0},
    "vision_feature_layer": -1}
# OpenGVLab/InternVL3-1B-hf's config.json (InternViT-300M and Qwen2.5-0.5B; transcribed from
# memory, not checked against the hub file), and InternVL3-2B-hf's (Qwen2.5-1.5B).
INTERNVL3_1B = {
    "architectures": ["InternVLForConditionalGeneration"], "downsample_ratio": 0.5,
    "image_seq_length": 256, "image_token_id": 151667, "model_type": "internvl",
    "projector_hidden_act": "gelu",
    "text_config": {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
                    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
                    "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
                    "max_position_embeddings": 32768, "max_window_layers": 70,
                    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
                    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None,
                    "rope_theta": 1000000.0, "sliding_window": 32768,
                    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
                    "use_sliding_window": False, "vocab_size": 151674},
    "torch_dtype": "bfloat16", "transformers_version": "4.52.0.dev0",
    "vision_config": {"architectures": ["InternVisionModel"], "attention_bias": True,
                      "attention_dropout": 0.0, "dropout": 0.0, "hidden_act": "gelu",
                      "hidden_dropout_prob": 0.0, "hidden_size": 1024, "image_size": [448, 448],
                      "initializer_factor": 0.1, "initializer_range": 1e-10,
                      "intermediate_size": 4096, "layer_norm_eps": 1e-06,
                      "layer_scale_init_value": 0.1, "model_type": "internvl_vision",
                      "norm_type": "layer_norm", "num_attention_heads": 16, "num_channels": 3,
                      "num_hidden_layers": 24, "patch_size": [14, 14],
                      "projection_dropout": 0.0, "torch_dtype": "bfloat16",
                      "use_absolute_position_embeddings": True, "use_mask_token": False,
                      "use_mean_pooling": True, "use_qk_norm": False},
    "vision_feature_layer": -1, "vision_feature_select_strategy": "default"}
INTERNVL3_2B = {**INTERNVL3_1B, "text_config": {
    **INTERNVL3_1B["text_config"], "hidden_size": 1536, "intermediate_size": 8960,
    "num_attention_heads": 12, "num_hidden_layers": 28}}
INTERNVL_PROCESSOR = {"size": {"height": 448, "width": 448}, "min_patches": 1, "max_patches": 12}
MISTRAL_PROCESSOR = {"size": {"longest_edge": 1540}, "patch_size": 14}
# By part, as transformers builds them (test_parameters_are_transformers_own).
MISTRAL_PARTS = {"language_model": 22_901_314_560, "vision_tower": 403_305_472,
                 "projector": 35_652_608}
INTERNVL_PARTS = {
    "internvl3-1b": (INTERNVL3_1B, {"language_model": 493_798_016, "vision_tower": 304_012_288,
                                    "projector": 4_482_816}),
    "internvl3-2b": (INTERNVL3_2B, {"language_model": 1_543_311_872,
                                    "vision_tower": 304_012_288, "projector": 8_662_016})}
# picture -> tiles InternVL's image processor cuts it into (crop_to_patches, as
# InternVLProcessor asks; 448-pixel tiles, 1 to 12 and the whole picture)
INTERNVL_IMAGES = {(640, 480): 13, (1920, 1080): 9, (100, 60): 7, (300, 900): 4,
                   (3000, 20): 13, (448, 448): 1, (1000, 200): 6}
# picture -> (the size Pixtral's image processor resizes it to, merged rows x columns): the
# model makes rows x columns features, the processor's text rows x (columns + 1) tokens
MISTRAL_IMAGES = {(640, 480): ((644, 504), (18, 23)), (1920, 1080): ((1540, 868), (31, 55)),
                  (100, 60): ((112, 84), (3, 4)), (300, 900): ((308, 924), (33, 11)),
                  (3000, 20): ((1540, 28), (1, 55)), (2000, 1999): ((1540, 1540), (55, 55))}
# A small Mistral 3: a 2-layer Pixtral tower (longest edge 448), a 2-layer language model.
MISTRAL_SMALL = {
    **MISTRAL_SMALL_31, "image_token_index": 299,
    "text_config": {**MISTRAL_SMALL_31["text_config"], "hidden_size": 48, "head_dim": 24,
                    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "vocab_size": 300},
    "vision_config": {**MISTRAL_SMALL_31["vision_config"], "hidden_size": 32, "head_dim": 16,
                      "intermediate_size": 48, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "image_size": 448}}


def test_mistral3_parts_and_tokens(tmp_path):
    path = _model(tmp_path, MISTRAL_SMALL_31, MISTRAL_PROCESSOR)
    result = estimate(load_experiment(VLM, [f"model.name_or_path={path}",
                                            "training.max_length=2048"]))
    assert result.parts == MISTRAL_PARTS
    assert result.params == result.trainable_params == sum(MISTRAL_PARTS.values())
    vision = result.shape.vision
    for size, (resized, (rows, columns)) in MISTRAL_IMAGES.items():
        picture = vision.for_image(size)
        assert (picture.resized, picture.grid) == (resized, (rows, columns)), size
        assert picture.image_tokens == rows * (columns + 1), size
        assert picture.positions == 4 * rows * columns, size
    assert "each 640x480 pixels (assumed; --image-size sets it), resized by the processor " \
           "to 644x504 (longest edge at most 1540, multiples of 28): 432 tokens an image " \
           "(18x23 merged patches and a break a row)" in render_text(result)
    frozen = estimate(load_experiment(VLM, [f"model.name_or_path={path}",
                                            "training.max_length=2048"]),
                      vision_training=Training(tower=False))
    assert result.trainable_params - frozen.trainable_params == MISTRAL_PARTS["vision_tower"]


@pytest.mark.parametrize("config, processor, copied", [
    (MISTRAL_SMALL_31, MISTRAL_PROCESSOR, "patch_merger.merging_layer.weight"),
    (INTERNVL3_1B, INTERNVL_PROCESSOR, "linear_1.weight")], ids=["mistral3", "internvl"])
def test_under_lora_and_qlora(tmp_path, config, processor, copied):
    """The layouts through the same code as the other families: all-linear is the
    language model's linears; QLoRA quantizes those only; train_projector copies the
    projector whole."""
    path = _model(tmp_path, config, processor)
    lora = estimate(load_experiment(VLM, [f"model.name_or_path={path}", "peft.type=lora",
                                          "vision.train_projector=true"]))
    qlora = estimate(load_experiment(VLM, [f"model.name_or_path={path}", "peft.type=qlora"]))
    text = render_text(lora)
    assert "the projector trains whole (modules_to_save)" in text
    from finetune.estimate.census import census

    tensors = census(lora.shape, lora.settings)
    adapters = {t.name.rsplit(".lora_", 1)[0] for t in tensors if t.role == "lora"}
    assert adapters and all(n.startswith("model.language_model.layers.") for n in adapters)
    copies = {t.name for t in tensors if t.role == "copy"}
    assert f"model.multi_modal_projector.{copied} (copy)" in copies
    quantized = {t.name for t in census(qlora.shape, qlora.settings) if t.dtype == "nf4"}
    assert quantized and all(n.startswith("model.language_model.layers.") for n in quantized)


def _internvl_vision(**change) -> dict:
    return {"vision_config": {**INTERNVL3_1B["vision_config"], **change}}


@pytest.mark.parametrize("config, change, processor, message", [
    (MISTRAL_SMALL_31, {"vision_feature_layer": [-1, -2]}, None,
     "vision_feature_layer must be one integer"),
    (MISTRAL_SMALL_31, {"vision_feature_layer": -30}, None,
     "vision_feature_layer -30 is not one of the tower's 25"),
    (MISTRAL_SMALL_31, {"vision_config": {**MISTRAL_SMALL_31["vision_config"],
                                          "model_type": "siglip"}}, None,
     "a mistral3 model with a 'siglip' vision tower is not counted"),
    ({k: v for k, v in MISTRAL_SMALL_31.items() if k != "text_config"}, {}, None,
     "a mistral3 config without a text_config object"),
    (INTERNVL3_1B, _internvl_vision(norm_type="rms_norm", use_qk_norm=True), None,
     "vision_config.norm_type 'rms_norm': the estimator counts InternViT-300M's layout"),
    (INTERNVL3_1B, {"downsample_ratio": 0.3}, None, "downsample_ratio 0.3 is not 1/n"),
    (INTERNVL3_1B, {"vision_feature_layer": -2}, None, "vision_feature_layer -2: the"),
    (INTERNVL3_1B, {}, {"size": {"height": 384, "width": 384}},
     "preprocessor_config.size {'height': 384, 'width': 384} is not the tower's image_size 448"),
    (INTERNVL3_1B, {}, {"min_patches": 6, "max_patches": 4},
     "preprocessor_config.min_patches 6 is more than max_patches 4"),
], ids=["mistral3-layers", "mistral3-layer", "mistral3-tower", "mistral3-text",
        "internvl-6b-tower",
        "internvl-ratio", "internvl-layer", "internvl-tile", "internvl-tiles"])
def test_bad_configs(tmp_path, config, change, processor, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_shape(str(_model(tmp_path, {**config, **change}, processor)))


@pytest.mark.parametrize("name", INTERNVL_PARTS)
def test_internvl_parts_and_tiles(tmp_path, name):
    config, parts = INTERNVL_PARTS[name]
    path = _model(tmp_path, config, INTERNVL_PROCESSOR)
    result = estimate(load_experiment(VLM, [f"model.name_or_path={path}",
                                            "training.max_length=4096"]))
    assert result.parts == parts
    assert result.params == result.trainable_params == sum(parts.values())
    for size, tiles in INTERNVL_IMAGES.items():
        vision = result.shape.vision.for_image(size)
        assert (vision.tiles, vision.image_tokens) == (tiles, 256 * tiles + 2), size
    assert "each 640x480 pixels (assumed; --image-size sets it): 4x3 tiles of 448x448 and " \
           "the whole picture, 256 tokens a tile, 3330 an image" in render_text(result)
    (tmp_path / "few").mkdir()
    few = _model(tmp_path / "few", config, {**INTERNVL_PROCESSOR, "max_patches": 4})
    vision = read_shape(str(few)).vision.for_image((1920, 1080))
    assert (vision.grid, vision.tiles) == ((2, 1), 3)  # 2x1 and the whole picture


@pytest.mark.slow  # imports torch; the meta device builds no weights (about 3 s)
@pytest.mark.parametrize("config", [MISTRAL_SMALL_31, INTERNVL3_1B, INTERNVL3_2B],
                         ids=["mistral-small-3.1", "internvl3-1b", "internvl3-2b"])
def test_parameters_are_transformers_own(tmp_path, config):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = _model(tmp_path, config)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))
    real = {n: p.numel() for n, p in model.named_parameters()}
    assert {p.name: p.numel for p in parameters(read_shape(str(path)), "lm")} == real


@pytest.mark.slow  # imports torch; a small model (about 2 s)
def test_mistral3_tokens_and_activations_against_autograd(tmp_path):
    """The small Mistral 3, fp32 weights, CPU autocast, sdpa: for each picture, the size
    Pixtral's image processor resizes it to (at PixtralProcessor's patch_size x
    spatial_merge_size) and the features the model makes equal the estimate's; for a
    640x480 picture what autograd keeps equals the estimate to the byte, whole, with a
    frozen tower and with activation checkpointing (there less what the saved-tensor
    hooks cannot see)."""
    torch = pytest.importorskip("torch")
    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        PixtralImageProcessorPil)

    processor_settings = {"size": {"longest_edge": 448}}
    path = _model(tmp_path, MISTRAL_SMALL, processor_settings)
    shape = read_shape(str(path))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        AutoConfig.from_pretrained(path), dtype=torch.float32,
        attn_implementation="sdpa").train()
    processor = PixtralImageProcessorPil(**processor_settings, patch_size=28)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    parts = ("model.vision_tower.", "model.multi_modal_projector.")
    for size in ((640, 480), (300, 900), (100, 60), (1000, 200)):
        vision = shape.vision.for_image(size)
        made = processor(images=[Image.new("RGB", size)], return_tensors="pt")
        pixels, sizes = made["pixel_values"], made["image_sizes"]
        assert tuple(sizes[0].tolist()) == vision.resized[::-1], size
        for frozen in (False, True) if size == (640, 480) else (False,):
            for name, p in model.named_parameters():
                p.requires_grad_(not (frozen and name.startswith(parts[0])))
            features, kept = kept_by_autograd(lambda: model.model.get_image_features(
                pixel_values=pixels, image_sizes=sizes).pooler_output, storages)
            assert features[0].shape[0] == vision.features, size
            if size != (640, 480):
                continue
            copies = sum(2 * p.numel() for name, p in model.named_parameters()
                         if p.requires_grad and p.dim() > 1 and name.startswith(parts))
            assert kept - copies + pixels.numel() * 4 == vision.image_bytes(
                CPU_AUTOCAST, False, Training(tower=not frozen)), frozen
    # with checkpointing: less what the hooks cannot see, the rotary cos/sin the layers hold
    # and the one layer recomputed in the backward (the layers' inputs and the block mask
    # they share are seen)
    for p in model.parameters():
        p.requires_grad_(True)
    model.activation_checkpointing_enable({"use_reentrant": False})
    vision = shape.vision.for_image((640, 480))
    made = processor(images=[Image.new("RGB", (640, 480))], return_tensors="pt")
    _, kept = kept_by_autograd(lambda: model.model.get_image_features(
        pixel_values=made["pixel_values"], image_sizes=made["image_sizes"]).pooler_output,
        storages)
    copies = sum(2 * p.numel() for name, p in model.named_parameters()
                 if p.dim() > 1 and name.startswith(parts) and ".layers." not in name)
    unseen = vision.positions * (pixtral_activations.layer_bytes(vision, CPU_AUTOCAST)
                                 + 2 * vision.head_dim * 4)
    assert kept - copies + made["pixel_values"].numel() * 4 == vision.image_bytes(
        CPU_AUTOCAST, True) - unseen


# A small InternVL: a 2-layer tower over 112-pixel tiles (64 patches, 16 tokens a tile), a
# 2-layer language model.
INTERNVL_SMALL = {
    **INTERNVL3_1B, "image_token_id": 299,
    "text_config": {**INTERNVL3_1B["text_config"], "hidden_size": 48, "intermediate_size": 64,
                    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                    "vocab_size": 300},
    "vision_config": {**INTERNVL3_1B["vision_config"], "hidden_size": 32,
                      "intermediate_size": 48, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "image_size": [112, 112]}}


@pytest.mark.slow  # imports torch; a small model over 112-pixel tiles (about 2 s)
def test_internvl_tiles_tokens_and_activations_against_autograd(tmp_path):
    """The small InternVL, fp32 weights, CPU autocast, sdpa: for each picture, the tiles
    GotOcr2's image processor cuts (crop_to_patches, as InternVLProcessor asks), the
    tokens InternVLProcessor.replace_image_token writes for them and the features the
    model makes equal the estimate's; for a 640x480 picture (13 tiles) what autograd keeps
    equals the estimate to the byte, whole, with a frozen tower and with activation
    checkpointing (there less the recomputed layer, not alive yet)."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil)
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    settings = {"size": {"height": 112, "width": 112}, "min_patches": 1, "max_patches": 12}
    path = _model(tmp_path, INTERNVL_SMALL, settings)
    shape = read_shape(str(path))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        AutoConfig.from_pretrained(path), dtype=torch.float32,
        attn_implementation="sdpa").train()
    processor = GotOcr2ImageProcessorPil(**settings)
    text = SimpleNamespace(start_image_token="<img>", end_image_token="</img>",
                           image_token="<IMG_CONTEXT>", image_seq_length=16)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    parts = ("model.vision_tower.", "model.multi_modal_projector.")
    for size in ((640, 480), (300, 900), (100, 60), (1000, 200)):
        vision = shape.vision.for_image(size)
        made = processor(images=[Image.new("RGB", size)], crop_to_patches=True,
                         return_tensors="pt")
        pixels = made["pixel_values"]
        assert pixels.shape[0] == vision.tiles, size
        written = InternVLProcessor.replace_image_token(text, made, 0)
        assert written.count("<IMG_CONTEXT>") + 2 == vision.image_tokens, size
        for frozen in (False, True) if size == (640, 480) else (False,):
            for name, p in model.named_parameters():
                p.requires_grad_(not (frozen and name.startswith(parts[0])))
            features, kept = kept_by_autograd(
                lambda: model.model.get_image_features(pixel_values=pixels).pooler_output,
                storages)
            assert features.shape[0] * features.shape[1] == vision.features, size
            if size != (640, 480):
                continue
            copies = sum(2 * p.numel() for name, p in model.named_parameters()
                         if p.requires_grad and p.dim() > 1 and name.startswith(parts)
                         and not name.endswith(("position_embeddings", "cls_token")))
            assert kept - copies + pixels.numel() * 4 == vision.image_bytes(
                CPU_AUTOCAST, False, Training(tower=not frozen)), frozen
    # with checkpointing: less the one layer (all tiles) recomputed in the backward
    for p in model.parameters():
        p.requires_grad_(True)
    model.activation_checkpointing_enable({"use_reentrant": False})
    vision = shape.vision.for_image((640, 480))
    pixels = processor(images=[Image.new("RGB", (640, 480))], crop_to_patches=True,
                       return_tensors="pt")["pixel_values"]
    _, kept = kept_by_autograd(
        lambda: model.model.get_image_features(pixel_values=pixels).pooler_output, storages)
    copies = sum(2 * p.numel() for name, p in model.named_parameters()
                 if p.dim() > 1 and name.startswith(parts) and ".layer." not in name
                 and not name.endswith(("position_embeddings", "cls_token")))
    layer = encoder_layer_bytes(vision, CPU_AUTOCAST) + 2 * vision.hidden * 2  # + lambdas
    assert kept - copies + pixels.numel() * 4 == vision.image_bytes(
        CPU_AUTOCAST, True) - vision.tiles * vision.positions * layer
