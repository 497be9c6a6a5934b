"""`finetune estimate` for the vision-language families past LLaVA (test_estimate_vision.py):
Qwen2-VL, Qwen2.5-VL, the SigLIP-tower models Gemma 3 and PaliGemma (1 and 2), and
LLaVA-NeXT, and Idefics3/SmolVLM. Their published configs are written here; transformers'
from_config on the meta device is the truth for the parameters, its image processor for
the tokens an image becomes, and autograd (small towers, random weights, CPU autocast)
for what an image saves for the backward."""

from __future__ import annotations

import json
import re
import weakref

import pytest

from conftest import QUICKSTART, run_cli
from vlm_configs import (GEMMA3_4B, LLAVA_NEXT_7B, PALIGEMMA2_3B, PALIGEMMA_3B, QWEN2_VL_2B,
                         QWEN25_VL_3B, SMOLVLM_256M, SMOLVLM_PROCESSOR)
from finetune.config import load_experiment
from finetune.errors import ConfigError
from finetune.estimate import estimate, parse_image_size, render_text
from finetune.estimate.walk import Regime
from finetune.estimate.census import census
from finetune.estimate.settings import settings_of
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


def _model(tmp_path, config, processor=None):
    directory = tmp_path / config["model_type"]
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if processor is not None:
        (directory / "preprocessor_config.json").write_text(json.dumps(processor))
    return directory


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


def _kept_by_autograd(forward, parameters: set[int]):
    """As in test_estimate_vision.py: what autograd saved and still holds when the forward
    under CPU autocast returns, parameter storages left out."""
    import torch

    saved = []

    def pack(tensor):
        detached = tensor.detach()
        saved.append(weakref.ref(detached))
        return detached

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            result = forward()
    alive = {}
    for ref in saved:
        tensor = ref()
        if tensor is not None and tensor.untyped_storage().data_ptr() not in parameters:
            alive[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return result, sum(alive.values())


CPU_AUTOCAST = Regime(residual=4, compute=2, autocast=True, base_trainable=True, quantized=0,
                      attention="sdpa", cuda=False)


@pytest.mark.slow  # imports torch; small towers (about 3 s)
@pytest.mark.parametrize("family", SMALL)
def test_image_activations_against_autograd(tmp_path, family):
    """A small tower and merger of each family, fp32 weights, one 448x336 picture, CPU
    autocast: what autograd keeps equals the estimate to the byte, with the whole tower
    training, with a frozen tower, and with activation checkpointing (there less what the
    saved-tensor hooks cannot see: the rotary cos/sin the checkpointed blocks hold, and
    the one block recomputed in the backward, not alive yet)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel)
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel)

    config, small = SMALL[family]
    config = {**config, "vision_config": {**config["vision_config"], **small}}
    path = _model(tmp_path, config)
    vision = read_shape(str(path)).vision.for_image((448, 336))
    vision_config = AutoConfig.from_pretrained(path).vision_config
    vision_config._attn_implementation = "sdpa"
    build = {"qwen2_vl": Qwen2VisionTransformerPretrainedModel,
             "qwen2_5_vl": Qwen2_5_VisionTransformerPretrainedModel}[family]
    torch.manual_seed(0)
    tower = build._from_config(vision_config).train()
    width, height = vision.resized
    grid = torch.tensor([[1, height // vision.patch, width // vision.patch]])
    pixels = torch.randn(vision.positions, vision.patch_values)
    storages = {p.untyped_storage().data_ptr() for p in tower.parameters()}

    def measured(copied) -> int:
        """Autograd's, less the 16-bit weight copies the matmuls save (the autocast row),
        plus the batch's pixel_values (held by the caller, not saved by autograd)."""
        features, kept = _kept_by_autograd(lambda: tower(pixels, grid_thw=grid).pooler_output,
                                           storages)
        assert features.shape[0] == vision.image_tokens
        copies = sum(2 * p.numel() for n, p in tower.named_parameters()
                     if p.dim() > 1 and copied(n))
        return kept - copies + pixels.numel() * 4

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
        features, kept = _kept_by_autograd(
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
    _, kept = _kept_by_autograd(lambda: model(input_ids=ids, attention_mask=mask, labels=ids,
                                              token_type_ids=torch.zeros_like(ids)), storages)
    experiment = load_experiment(VLM, [f"model.name_or_path={path}", "precision=bf16",
                                       "distributed.device=cpu"])
    settings = settings_of(experiment, max_positions=shape.max_positions).with_(
        device="cpu", attention="sdpa", mask="padding", seq_len=seq, logit_tokens=seq)
    from finetune.estimate.core import activation_bytes
    from finetune.estimate.memory import model_states
    from finetune.estimate.settings import Layout

    acts = activation_bytes(shape, settings, Layout("none"), False)
    copies = model_states(census(shape, settings), [], shape, settings, Layout("none")).autocast
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
            features, kept = _kept_by_autograd(
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
    _, kept = _kept_by_autograd(lambda: model(input_ids=ids, attention_mask=mask, labels=ids,
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
        features, kept = _kept_by_autograd(
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
        features, kept = _kept_by_autograd(lambda: model.model.get_image_features(
            pixel_values=pixels, pixel_attention_mask=mask).pooler_output, storages)
        assert sum(f.shape[0] for f in features) == vision.image_tokens, size  # per image
        if size == (640, 480):
            copies = sum(2 * p.numel() for name, p in model.named_parameters()
                         if p.dim() > 1 and "position_embedding" not in name
                         and name.startswith(("model.vision_model.", "model.connector.")))
            assert kept - copies + pixels.numel() * 4 + mask.numel() == vision.image_bytes(
                CPU_AUTOCAST, False)


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
