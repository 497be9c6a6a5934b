"""`finetune estimate` for Mistral 3 (a Pixtral tower at the picture's own resolution and a
patch-merging projector): its parts against transformers' (Mistral Small 3.1's
config.json, built on the meta device), the tokens a picture becomes against its image
processor and the model, and what one image keeps for the backward against autograd (a
small model, random weights, CPU autocast). Llama 3.2 Vision (mllama) and InternVL stay
refused by name (test_estimate_vision.py)."""

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
from finetune.estimate.vision import Training

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
MISTRAL_PROCESSOR = {"size": {"longest_edge": 1540}, "patch_size": 14}
# By part, as transformers builds them (test_parameters_are_transformers_own).
MISTRAL_PARTS = {"language_model": 22_901_314_560, "vision_tower": 403_305_472,
                 "projector": 35_652_608}
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


def test_mistral3_under_lora_and_qlora(tmp_path):
    """The layouts through the same code as the other families: all-linear is the
    language model's linears; QLoRA quantizes those only; train_projector copies the
    projector whole."""
    path = _model(tmp_path, MISTRAL_SMALL_31, MISTRAL_PROCESSOR)
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
    assert "model.multi_modal_projector.patch_merger.merging_layer.weight (copy)" in copies
    quantized = {t.name for t in census(qlora.shape, qlora.settings) if t.dtype == "nf4"}
    assert quantized and all(n.startswith("model.language_model.layers.") for n in quantized)


@pytest.mark.parametrize("change, message", [
    ({"vision_feature_layer": [-1, -2]}, "vision_feature_layer must be one integer"),
    ({"vision_feature_layer": -30}, "vision_feature_layer -30 is not one of the tower's 25"),
    ({"vision_config": {**MISTRAL_SMALL_31["vision_config"], "model_type": "siglip"}},
     "a mistral3 model with a 'siglip' vision tower is not counted"),
], ids=["layers", "layer", "tower"])
def test_mistral3_bad_configs(tmp_path, change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_shape(str(_model(tmp_path, {**MISTRAL_SMALL_31, **change})))


@pytest.mark.slow  # imports torch; the meta device builds no weights (about 2 s)
def test_parameters_are_transformers_own(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = _model(tmp_path, MISTRAL_SMALL_31)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))
    real = {n: p.numel() for n, p in model.named_parameters()}
    assert {p.name: p.numel for p in parameters(read_shape(str(path)), "lm")} == real


@pytest.mark.slow  # imports torch; a small model (about 2 s)
def test_mistral3_tokens_and_activations_against_autograd(tmp_path):
    """The small Mistral 3, fp32 weights, CPU autocast, sdpa: for each picture, the size
    Pixtral's image processor resizes it to (at PixtralProcessor's patch_size x
    spatial_merge_size) and the features the model makes equal the estimate's; for a
    640x480 picture what autograd keeps equals the estimate to the byte, whole and with a
    frozen tower."""
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
