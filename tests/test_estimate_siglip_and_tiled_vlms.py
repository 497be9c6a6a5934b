"""`finetune estimate` for the vision-language models with a SigLIP-layout tower (Gemma 3,
PaliGemma 1 and 2, Idefics3/SmolVLM) and those that cut a picture into tiles (LLaVA-NeXT,
Idefics3/SmolVLM): small models of each (random weights, CPU autocast), their image
processors and autograd against the estimate's tokens, tiles and activations; the
language models' decoder layers (Gemma, Gemma 2, Gemma 3) against autograd."""

from __future__ import annotations

import json

import pytest

from conftest import QUICKSTART
from vlm_configs import (CPU_AUTOCAST, GEMMA3_4B, LLAVA_NEXT_7B, PALIGEMMA2_3B, PALIGEMMA_3B,
                         SMOLVLM_256M, SMOLVLM_PROCESSOR, kept_by_autograd)
from vlm_configs import model_dir as _model
from finetune.config import load_experiment
from finetune.estimate import estimate, render_text
from finetune.estimate.census import census
from finetune.estimate.settings import settings_of
from finetune.estimate.shapes import read_shape
from finetune.estimate.vision import Training

VLM = QUICKSTART / "vlm.yaml"


# A small Gemma 3: a 2-layer SigLIP tower over 112x112 pictures (64 patches pooled to 16
# tokens) and a 3-layer language model.
GEMMA3_SMALL = {
    **GEMMA3_4B, "mm_tokens_per_image": 16, "image_token_index": 299, "boi_token_index": 297,
    "eoi_token_index": 298,
    "text_config": {**GEMMA3_4B["text_config"], "hidden_size": 48, "intermediate_size": 64,
                    "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
                    "head_dim": 24, "vocab_size": 300, "sliding_window": 8},
    "vision_config": {**GEMMA3_4B["vision_config"], "hidden_size": 64, "intermediate_size": 96,
                      "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 112}}


@pytest.mark.slow  # imports torch; a small model (about 2 s)
def test_gemma3_against_autograd(tmp_path):
    """The small Gemma 3, fp32 weights, CPU autocast. The image's tower and projector:
    what autograd keeps equals the estimate to the byte, whole and with a frozen tower,
    but for what a trained tower holds once per batch, not per image (its position ids and
    the soft-token norm's 1 + weight: 768 bytes). The language model's decoder layers (Gemma's four
    RMSNorms a layer, q/k norms, GELU-tanh MLP) on a padded batch of 2 x 16 tokens: within
    2% (1.2% under: the rotary tables of the sliding and the full layers, not counted)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = _model(tmp_path, GEMMA3_SMALL)
    shape = read_shape(str(path))
    vision = shape.vision
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        AutoConfig.from_pretrained(path), dtype=torch.float32,
        attn_implementation="sdpa").train()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    pixels = torch.randn(1, 3, 112, 112)

    def measured(frozen_tower: bool) -> int:
        for name, p in model.named_parameters():
            p.requires_grad_(not (frozen_tower and name.startswith("model.vision_tower.")))
        features, kept = kept_by_autograd(
            lambda: model.model.get_image_features(pixel_values=pixels).pooler_output, storages)
        assert features.shape[1] == vision.image_tokens == 16
        copies = sum(2 * p.numel() for name, p in model.named_parameters()
                     if p.requires_grad and (p.dim() > 1 and "position_embedding" not in name)
                     and name.startswith(("model.vision_tower.", "model.multi_modal_projector.")))
        # held once per batch by a trained tower: int64 position ids, fp32 1 + weight
        per_batch = 0 if frozen_tower else 64 * 8 + 64 * 4
        return kept - copies + pixels.numel() * 4 - per_batch

    assert measured(False) == vision.image_bytes(CPU_AUTOCAST, False)
    assert measured(True) == vision.image_bytes(CPU_AUTOCAST, False, Training(tower=False))

    for p in model.parameters():
        p.requires_grad_(True)
    batch, seq = 2, 16
    ids = torch.randint(1, 297, (batch, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :3] = 0
    _, kept = kept_by_autograd(lambda: model(input_ids=ids, attention_mask=mask, labels=ids,
                                              token_type_ids=torch.zeros_like(ids)), storages)
    experiment = load_experiment(VLM, [f"model.name_or_path={path}", "precision=bf16",
                                       "distributed.device=cpu"])
    settings = settings_of(experiment, max_positions=shape.max_positions).with_(
        device="cpu", attention="sdpa", mask="padding", seq_len=seq, logit_tokens=seq)
    from finetune.estimate.core import activation_bytes
    from finetune.estimate.memory import model_states
    from finetune.estimate.settings import Layout

    acts = activation_bytes(shape, settings, Layout("none"), False)
    copies = model_states(census(shape, settings), [], settings, Layout("none")).autocast
    language_copies = sum(2 * t.numel for t in census(shape, settings) if t.matmul and
                          not t.name.startswith(("model.vision_tower.",
                                                 "model.multi_modal_projector.")))
    assert language_copies <= copies
    expected = batch * (acts.layers + acts.other + acts.logits_saved) + language_copies
    assert abs(kept - expected) <= 0.02 * kept, (kept, expected)


def _small_paligemma(config: dict) -> dict:
    """A 2-layer SigLIP tower over 112x112 pictures (64 tokens), a 3-layer language model."""
    text = {**config["text_config"], "hidden_size": 48, "intermediate_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 24, "vocab_size": 300}
    if "sliding_window" in text:
        text["sliding_window"] = 8
    return {**config, "image_token_index": 299, "projection_dim": 48, "text_config": text,
            "vision_config": {**config["vision_config"], "hidden_size": 64,
                              "intermediate_size": 96, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "image_size": 112,
                              "projection_dim": 48}}


@pytest.mark.slow  # imports torch; two small models (about 3 s)
@pytest.mark.parametrize("config", [PALIGEMMA_3B, PALIGEMMA2_3B], ids=["gemma", "gemma2"])
def test_paligemma_against_autograd(tmp_path, config):
    """A small PaliGemma (Gemma) and PaliGemma 2 (Gemma 2: sandwich norms, capped attention
    scores and logits; transformers runs it eagerly), fp32 weights, CPU autocast: with sdpa
    the image's tower and projector keep what the estimate says to the byte, whole (less
    the tower's int64 position ids, held once per batch) and with a frozen tower; the
    language model's decoder layers on a padded 2 x 16-token batch within 2% (1.1% under
    for both: the rotary tables)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForImageTextToText

    from finetune.estimate.core import activation_bytes
    from finetune.estimate.settings import Layout

    path = _model(tmp_path, _small_paligemma(config))
    shape = read_shape(str(path))
    vision = shape.vision
    attention = "eager" if shape.attn_softcap else "sdpa"
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        AutoConfig.from_pretrained(path), dtype=torch.float32,
        attn_implementation=attention).train()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    if attention == "sdpa":
        pixels = torch.randn(1, 3, 112, 112)
        for frozen in (False, True):
            for name, p in model.named_parameters():
                p.requires_grad_(not (frozen and name.startswith("model.vision_tower.")))
            features, kept = kept_by_autograd(
                lambda: model.model.get_image_features(pixel_values=pixels).pooler_output,
                storages)
            assert features.shape[1] == vision.image_tokens == 64
            # the 16-bit weight copies the matmuls save (the projector's: where its input
            # needs a gradient, under a trained tower)
            copies = sum(2 * p.numel() for name, p in model.named_parameters()
                         if p.requires_grad and p.dim() > 1 and "position_embedding" not in name
                         and (name.startswith("model.vision_tower.") or (
                             name.startswith("model.multi_modal_projector.") and not frozen)))
            per_batch = 0 if frozen else 64 * 8
            assert kept - copies + pixels.numel() * 4 - per_batch == vision.image_bytes(
                CPU_AUTOCAST, False, Training(tower=not frozen))
        for p in model.parameters():
            p.requires_grad_(True)

    batch, seq = 2, 16
    ids = torch.randint(1, 290, (batch, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :3] = 0
    _, kept = kept_by_autograd(lambda: model(input_ids=ids, attention_mask=mask, labels=ids,
                                              token_type_ids=torch.ones_like(ids)), storages)
    experiment = load_experiment(VLM, [f"model.name_or_path={path}", "precision=bf16",
                                       "distributed.device=cpu"])
    settings = settings_of(experiment, max_positions=shape.max_positions).with_(
        device="cpu", attention=attention, mask="padding", seq_len=seq, logit_tokens=seq)
    acts = activation_bytes(shape, settings, Layout("none"), False)
    copies = sum(2 * t.numel for t in census(shape, settings) if t.matmul and
                 not t.name.startswith(("model.vision_tower.", "model.multi_modal_projector.")))
    expected = batch * (acts.layers + acts.other + acts.logits_saved) + copies
    assert abs(kept - expected) <= 0.02 * kept, (kept, expected)


# picture -> (tiles through the tower, tokens): what LLaVA-NeXT's image processor and model
# make of it (test_llava_next_tiles_tokens_and_activations)
LLAVA_NEXT_IMAGES = {(640, 480): (5, 2340), (1920, 1080): (5, 1948), (300, 900): (4, 2376),
                     (336, 336): (3, 1176), (1000, 200): (4, 1598)}


def test_llava_next_tokens_follow_the_picture(tmp_path):
    shape = read_shape(str(_model(tmp_path, LLAVA_NEXT_7B)))
    for size, (tiles, tokens) in LLAVA_NEXT_IMAGES.items():
        vision = shape.vision.for_image(size)
        assert (vision.tiles, vision.image_tokens) == (tiles, tokens), size
    assert shape.vision.image_tokens == 2340  # 640x480, assumed
    text = render_text(estimate(load_experiment(
        VLM, [f"model.name_or_path={_model(tmp_path, LLAVA_NEXT_7B)}",
              "training.max_length=4096"])))
    assert "each 640x480 pixels (assumed; --image-size sets it): 2x2 tiles of 336x336 " \
           "and the whole picture, 2340 tokens an image" in text


@pytest.mark.slow  # imports torch; a small model over 336-pixel tiles (about 4 s)
def test_llava_next_tiles_tokens_and_activations(tmp_path):
    """A small LLaVA-NeXT (a 3-layer CLIP tower over 336-pixel tiles, vision_feature_layer
    -2), the pictures cut by its image processor: the tiles the tower runs on and the
    tokens the model makes (after unpadding and newlines) equal the estimate's for five
    sizes; what autograd keeps for a 640x480 picture (5 tiles) equals the estimate less
    the tower's int64 position ids (held once per batch)."""
    torch = pytest.importorskip("torch")
    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil)

    config = {**LLAVA_NEXT_7B, "image_token_index": 299, "vocab_size": 300,
              "text_config": {**LLAVA_NEXT_7B["text_config"], "hidden_size": 48,
                              "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "num_key_value_heads": 1,
                              "vocab_size": 300},
              "vision_config": {**LLAVA_NEXT_7B["vision_config"], "hidden_size": 32,
                                "intermediate_size": 48, "num_hidden_layers": 3,
                                "num_attention_heads": 2}}
    path = _model(tmp_path, config)
    shape = read_shape(str(path))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        AutoConfig.from_pretrained(path), dtype=torch.float32,
        attn_implementation="sdpa").train()
    processor = LlavaNextImageProcessorPil(crop_size={"height": 336, "width": 336},
                                           size={"shortest_edge": 336})  # llava-hf's
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for size in LLAVA_NEXT_IMAGES:
        vision = shape.vision.for_image(size)
        made = processor(images=[Image.new("RGB", size)], return_tensors="pt")
        pixels, sizes = made["pixel_values"], made["image_sizes"]
        assert pixels.shape[1] == vision.tiles, size
        features, kept = kept_by_autograd(
            lambda: model.model.get_image_features(pixel_values=pixels,
                                                   image_sizes=sizes).pooler_output, storages)
        assert features[0].shape[0] == vision.image_tokens, size
        if size == (640, 480):
            copies = sum(2 * p.numel() for name, p in model.named_parameters()
                         if p.dim() > 1 and "position_embedding" not in name
                         and name.startswith(("model.vision_tower.",
                                              "model.multi_modal_projector."))
                         and ".layers.2." not in name)  # past the feature layer: freed
            position_ids = 577 * 8
            assert kept - copies + pixels.numel() * 4 - position_ids == vision.image_bytes(
                CPU_AUTOCAST, False)


# picture -> tiles through the tower for a small Idefics3 (128-pixel tiles, longest edge
# 512, 16-pixel patches, scale_factor 2: 16 tokens a tile), as its image processor cuts it
IDEFICS3_IMAGES = {(640, 480): 13, (1920, 1080): 13, (300, 900): 9, (100, 100): 17,
                   (1000, 200): 5}
IDEFICS3_SMALL = {
    **SMOLVLM_256M, "image_token_id": 299, "scale_factor": 2,
    "text_config": {**SMOLVLM_256M["text_config"], "hidden_size": 48, "intermediate_size": 64,
                    "num_hidden_layers": 2, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "vocab_size": 300},
    "vision_config": {**SMOLVLM_256M["vision_config"], "hidden_size": 32,
                      "intermediate_size": 48, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "image_size": 128}}
IDEFICS3_SMALL_PROCESSOR = {"size": {"longest_edge": 512}, "max_image_size": {"longest_edge": 128},
                            "do_image_splitting": True}


def test_idefics3_tiles_follow_the_picture_and_the_processor(tmp_path):
    """The processor's settings come from preprocessor_config.json (else its class's)."""
    path = tmp_path / "small"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(IDEFICS3_SMALL))
    (path / "preprocessor_config.json").write_text(json.dumps(IDEFICS3_SMALL_PROCESSOR))
    shape = read_shape(str(path))
    for size, tiles in IDEFICS3_IMAGES.items():
        vision = shape.vision.for_image(size)
        assert (vision.tiles, vision.image_tokens) == (tiles, 16 * tiles), size
    smol = tmp_path / "smolvlm"
    smol.mkdir()
    (smol / "config.json").write_text(json.dumps(SMOLVLM_256M))
    (smol / "preprocessor_config.json").write_text(json.dumps(SMOLVLM_PROCESSOR))
    vision = read_shape(str(smol)).vision
    assert (vision.grid, vision.tiles, vision.image_tokens) == ((3, 4), 13, 832)  # 640x480
    # as transformers 5 saves a processor (a run's final/): processor_config.json's nested
    # image_processor, which transformers reads before preprocessor_config.json
    (path / "processor_config.json").write_text(json.dumps(
        {"image_processor": {**IDEFICS3_SMALL_PROCESSOR, "do_image_splitting": False},
         "processor_class": "Idefics3Processor"}))
    assert read_shape(str(path)).vision.for_image((640, 480)).tiles == 1


@pytest.mark.slow  # imports torch; a small model over 128-pixel tiles (about 2 s)
def test_idefics3_tiles_tokens_and_activations(tmp_path):
    """The small Idefics3, pictures cut by its image processor: the tiles and the tokens the
    model makes equal the estimate's for five sizes, and what autograd keeps for a 640x480
    picture (13 tiles) equals the estimate to the byte (the pixels and their bool mask are
    the caller's)."""
    torch = pytest.importorskip("torch")
    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil)

    path = tmp_path / "small"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(IDEFICS3_SMALL))
    (path / "preprocessor_config.json").write_text(json.dumps(IDEFICS3_SMALL_PROCESSOR))
    shape = read_shape(str(path))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        AutoConfig.from_pretrained(path), dtype=torch.float32,
        attn_implementation="sdpa").train()
    processor = Idefics3ImageProcessorPil(**IDEFICS3_SMALL_PROCESSOR)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    vision = None
    for size in IDEFICS3_IMAGES:
        vision = shape.vision.for_image(size)
        made = processor(images=[[Image.new("RGB", size)]], return_tensors="pt")
        pixels, mask = made["pixel_values"], made["pixel_attention_mask"]
        assert pixels.shape[1] == vision.tiles, size
        features, kept = kept_by_autograd(lambda: model.model.get_image_features(
            pixel_values=pixels, pixel_attention_mask=mask).pooler_output, storages)
        assert sum(f.shape[0] for f in features) == vision.image_tokens, size  # per image
        if size == (640, 480):
            copies = sum(2 * p.numel() for name, p in model.named_parameters()
                         if p.dim() > 1 and "position_embedding" not in name
                         and name.startswith(("model.vision_model.", "model.connector.")))
            assert kept - copies + pixels.numel() * 4 + mask.numel() == vision.image_bytes(
                CPU_AUTOCAST, False)
