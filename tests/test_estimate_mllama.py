"""`finetune estimate` for Llama 3.2 Vision (mllama: a tiled two-stage vision tower, a
one-Linear projector, and cross-attention layers inside the language model): its parts
against transformers' (Llama-3.2-11B-Vision's config.json, built on the meta device), the
tiles a picture becomes against MllamaImageProcessor, and what an image and a row keep for
the backward against autograd (a small model, random weights, CPU autocast)."""

from __future__ import annotations

import json
import re

import pytest

from conftest import QUICKSTART, run_cli
from vlm_configs import CPU_AUTOCAST, kept_by_autograd
from vlm_configs import model_dir as _model
from finetune.config import load_experiment
from finetune.errors import ConfigError
from finetune.estimate import activations as act
from finetune.estimate import cross_attention, estimate, render_text
from finetune.estimate.census import census
from finetune.estimate.core import layer_targets, regime
from finetune.estimate.shapes import parameters, read_shape
from finetune.estimate.vision import Training

VLM = QUICKSTART / "vlm.yaml"
# meta-llama/Llama-3.2-11B-Vision's config.json (transcribed from memory, not checked
# against the hub file) and its processor's settings (560-pixel tiles, at most 4).
LLAMA_32_11B_VISION = {
    "architectures": ["MllamaForConditionalGeneration"], "image_token_index": 128256,
    "model_type": "mllama",
    "text_config": {"cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38], "dropout": 0,
                    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
                    "initializer_range": 0.02, "intermediate_size": 14336,
                    "max_position_embeddings": 131072, "model_type": "mllama_text_model",
                    "num_attention_heads": 32, "num_hidden_layers": 40,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0,
                                     "low_freq_factor": 1.0,
                                     "original_max_position_embeddings": 8192,
                                     "rope_type": "llama3"},
                    "rope_theta": 500000.0, "tie_word_embeddings": False,
                    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256},
    "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0",
    "vision_config": {"attention_heads": 16, "hidden_act": "gelu", "hidden_size": 1280,
                      "image_size": 560, "intermediate_layers_indices": [3, 7, 15, 23, 30],
                      "intermediate_size": 5120, "max_num_tiles": 4,
                      "model_type": "mllama_vision_model", "norm_eps": 1e-05,
                      "num_channels": 3, "num_global_layers": 8, "num_hidden_layers": 32,
                      "patch_size": 14,
                      "supported_aspect_ratios": [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1],
                                                  [2, 2], [3, 1], [4, 1]],
                      "torch_dtype": "bfloat16", "vision_output_dim": 7680}}
PROCESSOR = {"size": {"height": 560, "width": 560}, "max_image_tiles": 4}
# By part, as transformers builds them (test_parameters_are_transformers_own): 10.67B
PARTS = {"language_model": 9_775_192_080, "vision_tower": 863_567_379,
         "projector": 31_461_376}
# picture -> (rows, columns) of 560-pixel tiles MllamaImageProcessor cuts it into
# (test_tiles_and_activations_against_autograd asks the processor)
TILES = {(640, 480): (1, 2), (1920, 1080): (2, 2), (100, 60): (1, 1), (300, 900): (2, 1),
         (3000, 20): (1, 4), (561, 560): (1, 2)}
CROSS = ("q_proj", "k_proj", "v_proj", "o_proj")


def test_parts_tiles_and_tokens(tmp_path):
    path = _model(tmp_path, LLAMA_32_11B_VISION, PROCESSOR)
    result = estimate(load_experiment(VLM, [f"model.name_or_path={path}",
                                            "training.max_length=2048"]))
    assert result.parts == PARTS
    assert result.params == result.trainable_params == sum(PARTS.values())
    vision = result.shape.vision
    for size, grid in TILES.items():
        picture = vision.for_image(size)
        assert (picture.grid, picture.image_tokens) == (grid, 1), size
    assert (vision.sequence, vision.vision_keys) == (4 * 1608, 4 * 1601)
    text = render_text(result)
    assert "each 640x480 pixels (assumed; --image-size sets it): 2x1 tiles of 560x560 " \
           "(padded to 4), 1 token an image" in text
    assert "32 local and 8 global layers over 6432 positions an image" in text
    frozen = estimate(load_experiment(VLM, [f"model.name_or_path={path}",
                                            "training.max_length=2048"]),
                      vision_training=Training(tower=False))
    assert result.trainable_params - frozen.trainable_params == PARTS["vision_tower"]
    # each image adds its tower's and its cross-attention's activations, whatever its size
    two = estimate(load_experiment(VLM, [f"model.name_or_path={path}",
                                         "training.max_length=2048"]), images_per_row=2)
    rows = [{key: b for key, _, b in e.configured.rows} for e in (result, two)]
    assert rows[1]["vision"] == 2 * rows[0]["vision"]
    settings = result.settings
    cross = cross_attention.image_bytes(
        result.shape, regime(settings, settings.layout), layer_targets(result.shape, settings),
        2048, settings.checkpointing, True)
    assert cross > 0 and rows[1]["activations"] - rows[0]["activations"] == \
        settings.micro_batch * cross
    assert "cross-attention layers: counted for every row, as in a batch with a picture" \
        in text
    # rows without pictures: transformers skips the cross-attention layers for the batch
    none = estimate(load_experiment(VLM, [f"model.name_or_path={path}",
                                          "training.max_length=2048"]), images_per_row=0)
    rows.append({key: b for key, _, b in none.configured.rows})
    targets = layer_targets(result.shape, settings)
    skipped = sum(act.layer_bytes(result.shape, regime(settings, settings.layout), targets[n],
                                  2048, index=n) for n in result.shape.cross_layers)
    assert not settings.checkpointing and rows[2]["vision"] == 0
    assert rows[0]["activations"] - rows[2]["activations"] == \
        settings.micro_batch * (cross + 2048 * skipped)
    assert "cross-attention layers: not counted, no row has a picture" in render_text(none)
    # the command, on a directory holding the config, as docs/estimate.md shows
    # (cold: `estimate` imports no torch, so a fresh process is faster than a warm fork)
    run = run_cli("estimate", str(VLM), f"model.name_or_path={path}", "--image-size",
                  "1920x1080", "--json", cwd=tmp_path, cold=True)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["model"]["parts"] == PARTS and report["model"]["image_tokens"] == 1
    assert any("2x2 tiles of 560x560" in line for line in report["assumptions"])


def test_lora_targets_the_cross_attention_layers(tmp_path):
    """all-linear is the language model's linears, the cross-attention layers' as PEFT
    matches them; QLoRA quantizes those; train_projector copies the projector (a Linear)."""
    path = _model(tmp_path, LLAMA_32_11B_VISION, PROCESSOR)
    lora = estimate(load_experiment(VLM, [f"model.name_or_path={path}", "peft.type=lora",
                                          "vision.train_projector=true"]))
    tensors = census(lora.shape, lora.settings)
    adapters = {t.name.rsplit(".lora_", 1)[0] for t in tensors if t.role == "lora"}
    cross = {f"model.language_model.layers.{n}.cross_attn.{p}" for n in
             LLAMA_32_11B_VISION["text_config"]["cross_attention_layers"] for p in CROSS}
    assert len(adapters) == 40 * 7 and cross <= adapters
    assert all(n.startswith("model.language_model.layers.") for n in adapters)
    assert "model.multi_modal_projector.weight (copy)" in {t.name for t in tensors}
    qlora = estimate(load_experiment(VLM, [f"model.name_or_path={path}", "peft.type=qlora"]))
    quantized = {t.name for t in census(qlora.shape, qlora.settings) if t.dtype == "nf4"}
    assert {f"{n}.weight" for n in cross} <= quantized
    assert all(n.startswith("model.language_model.layers.") for n in quantized)
    named = estimate(load_experiment(VLM, [f"model.name_or_path={path}", "peft.type=lora",
                                           "peft.target_modules=[k_proj]"]))
    names = {t.name.rsplit(".lora_", 1)[0] for t in census(named.shape, named.settings)
             if t.role == "lora"}
    assert len(names) == 40 and "model.language_model.layers.3.cross_attn.k_proj" in names


def _text(**change) -> dict:
    return {"text_config": {**LLAMA_32_11B_VISION["text_config"], **change}}


def _vision(**change) -> dict:
    return {"vision_config": {**LLAMA_32_11B_VISION["vision_config"], **change}}


@pytest.mark.parametrize("change, processor, message", [
    (_vision(vision_output_dim=5120), PROCESSOR,
     "vision_config.vision_output_dim 5120 is not hidden_size x"),
    (_text(cross_attention_layers=[3, 40]), PROCESSOR,
     "text_config.cross_attention_layers must be a list of layer indices in 0..39"),
    (_vision(intermediate_layers_indices=[3, 32]), PROCESSOR,
     "vision_config.intermediate_layers_indices must be a list of layer indices in 0..31"),
    ({}, {"size": {"height": 448, "width": 448}},
     "preprocessor_config.size {'height': 448, 'width': 448} is not the tower's image_size"),
    ({}, {**PROCESSOR, "max_image_tiles": 6},
     "preprocessor_config.max_image_tiles 6 is not vision_config.max_num_tiles 4"),
    (_text(model_type="llama"), PROCESSOR,
     "a mllama model with a 'llama' part is not counted"),
], ids=["output-dim", "cross-layers", "feature-layers", "tile", "tiles", "text-type"])
def test_bad_configs(tmp_path, change, processor, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_shape(str(_model(tmp_path, {**LLAMA_32_11B_VISION, **change}, processor)))


@pytest.mark.slow  # imports torch; the meta device builds no weights (about 3 s)
def test_parameters_are_transformers_own(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = _model(tmp_path, LLAMA_32_11B_VISION)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))
    real = {n: p.numel() for n, p in model.named_parameters()}
    assert {p.name: p.numel for p in parameters(read_shape(str(path)), "lm")} == real


# A small Llama 3.2 Vision: 56-pixel tiles (17 positions, padded to 24), 4 local and 2
# global tower layers, a 3-layer language model whose layer 1 is a cross-attention layer.
SMALL = {
    **LLAMA_32_11B_VISION, "image_token_index": 300,
    "text_config": {**LLAMA_32_11B_VISION["text_config"], "hidden_size": 48,
                    "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "vocab_size": 300, "pad_token_id": 0,
                    "bos_token_id": 1, "eos_token_id": 2, "cross_attention_layers": [1]},
    "vision_config": {**LLAMA_32_11B_VISION["vision_config"], "hidden_size": 32,
                      "intermediate_size": 48, "attention_heads": 2, "num_hidden_layers": 4,
                      "num_global_layers": 2, "image_size": 56,
                      "intermediate_layers_indices": [1, 3], "vision_output_dim": 96}}
SMALL_PROCESSOR = {"size": {"height": 56, "width": 56}, "max_image_tiles": 4}


@pytest.mark.slow  # imports torch; a small model and 560-pixel tiles (about 2 s)
def test_tiles_and_activations_against_autograd(tmp_path):
    """MllamaImageProcessor (560-pixel tiles, at most 4) cuts each picture into the
    estimate's grid. The small model, fp32 weights, CPU autocast, sdpa: what the tower and
    projector keep for one picture equals the estimate to the byte, with a frozen tower
    and with activation checkpointing (which leaves the tower's layers whole); a row of
    16 tokens with one and two pictures through the whole model keeps what the estimate
    counts for its decoder layers (the cross-attention layer's per token and per image),
    less what it does not count (the rotary cos/sin and the gates' tanh, once a forward);
    with checkpointing the decoder layers' inputs (the hooks do not see the recomputed
    layer, nor the vision states and masks the checkpointed layers hold as keywords); and
    so does it under LoRA on the language model's linears with a frozen tower and
    projector (bf16 base, fp32 adapters), where with checkpointing the frozen tower, run
    without autograd as finetune runs it, keeps nothing."""
    torch = pytest.importorskip("torch")
    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.mllama.image_processing_pil_mllama import (
        MllamaImageProcessorPil, get_all_supported_aspect_ratios)
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense, get_cross_attention_token_mask)

    big = read_shape(str(_model(tmp_path, LLAMA_32_11B_VISION, PROCESSOR))).vision
    processor = MllamaImageProcessorPil(**PROCESSOR)
    ratios = get_all_supported_aspect_ratios(4)
    for size, grid in TILES.items():
        made = processor(images=[[Image.new("RGB", size)]])
        assert made["num_tiles"] == [[big.for_image(size).tiles]], size
        assert ratios[made["aspect_ratio_ids"][0][0] - 1] == big.for_image(size).grid == grid

    (tmp_path / "small").mkdir()
    path = _model(tmp_path / "small", SMALL, SMALL_PROCESSOR)
    shape = read_shape(str(path))
    vision = shape.vision
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        AutoConfig.from_pretrained(path), dtype=torch.float32,
        attn_implementation="sdpa").train()
    processor = MllamaImageProcessorPil(**SMALL_PROCESSOR)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    parts = ("model.vision_model.", "model.multi_modal_projector.")

    def copies(names):  # the 16-bit weight copies autocast makes for matmuls
        return sum(2 * p.numel() for name, p in model.named_parameters()
                   if name.startswith(names) and p.requires_grad and name.endswith((
                       "_proj.weight", "fc1.weight", "fc2.weight", "patch_embedding.weight",
                       "projector.weight")))

    made = processor(images=[[Image.new("RGB", (640, 480))]], return_tensors="pt")
    pixels = made["pixel_values"].numel() * 4
    tower, projector = model.model.vision_model, model.model.multi_modal_projector
    image = dict(pixel_values=made["pixel_values"], aspect_ratio_ids=made["aspect_ratio_ids"],
                 aspect_ratio_mask=made["aspect_ratio_mask"])
    for frozen, checkpointing in ((False, False), (True, False), (False, True)):
        for name, p in model.named_parameters():
            p.requires_grad_(not (frozen and name.startswith(parts[0])))
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        features, kept = kept_by_autograd(
            lambda: projector(tower(**image).last_hidden_state), storages)
        assert features.shape[-2] * features.shape[2] == vision.vision_keys
        held = copies(parts) if not frozen else 0  # a frozen tower's projector: no copy
        assert kept - held + pixels == vision.image_bytes(
            CPU_AUTOCAST, checkpointing, Training(tower=not frozen)), (frozen, checkpointing)
        model.activation_checkpointing_disable()

    seq, layers = 16, [frozenset()] * shape.layers
    scalars = (5 + 2 * vision.global_layers) * 4  # the tower's gates' tanh, once a forward
    for images in (0, 1, 2):  # 0: a batch without pictures skips the cross-attention layers
        made = processor(images=[[Image.new("RGB", (640, 480))] * images], return_tensors="pt") \
            if images else {}
        ids = torch.randint(3, 300, (1, seq), generator=torch.Generator().manual_seed(0))
        ids[0, [1, 5][:images]] = 300
        pictures = {} if not images else dict(
            cross_attention_mask=torch.tensor(convert_sparse_cross_attention_mask_to_dense(
                [get_cross_attention_token_mask(ids[0].tolist(), 300)], made["num_tiles"], 4,
                seq)), pixel_values=made["pixel_values"],
            aspect_ratio_ids=made["aspect_ratio_ids"], aspect_ratio_mask=made["aspect_ratio_mask"])
        skipped = frozenset(() if images else shape.cross_layers)
        for checkpointing in (False, True):
            if checkpointing:
                model.activation_checkpointing_enable({"use_reentrant": False})
            _, kept = kept_by_autograd(lambda: model.model(input_ids=ids, **pictures)
                                       .last_hidden_state, storages)
            model.activation_checkpointing_disable()
            text = act.activations(shape, CPU_AUTOCAST, layers, seq, 0, 1, checkpointing,
                                   head_trainable=False, lm_head=False, skipped=skipped)
            cross = cross_attention.image_bytes(shape, CPU_AUTOCAST, layers, seq,
                                                checkpointing, True)
            counted = text.layers + text.other + images * (
                cross + vision.image_bytes(CPU_AUTOCAST, checkpointing))
            if images:
                measured = kept - copies(parts if checkpointing else ("model.",)) + \
                    made["pixel_values"].numel() * 4 + (images - 1) * scalars
            else:  # no copies of the tower's, the projector's, the skipped layers' weights
                measured = kept - (0 if checkpointing else copies(("model.language_model.",))
                                   - copies(tuple(f"model.language_model.layers.{n}."
                                                  for n in shape.cross_layers)))
            run = [n for n in range(shape.layers) if n not in skipped]
            if checkpointing:
                unseen = seq * max(act.layer_bytes(shape, CPU_AUTOCAST, frozenset(), seq,
                                                   index=n) for n in run)
                assert measured == counted - unseen - images * cross, (images, checkpointing)
            else:
                unseen = 2 * seq * shape.head_dim * 4 + 2 * 4 * len(set(shape.cross_layers) &
                                                                     set(run))
                assert measured == counted + unseen, (images, checkpointing)

    # LoRA on every linear of the language model (as all-linear puts it), the base in bf16,
    # the tower and projector frozen: the vision states need no gradient
    from dataclasses import replace

    from peft import LoraConfig, get_peft_model

    # (a fresh model: activation_checkpointing_enable left input-grad hooks on the other)
    model = AutoModelForImageTextToText.from_config(
        AutoConfig.from_pretrained(path), dtype=torch.bfloat16, attn_implementation="sdpa")
    lora = get_peft_model(model, LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=r"model\.language_model\.layers\.\d+\.\w+\.\w+_proj")).train()
    storages = {p.untyped_storage().data_ptr() for p in lora.parameters()}
    reg = replace(CPU_AUTOCAST, residual=2, base_trainable=False, adapter=4, rank=4)
    targets = [frozenset(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj"))] * shape.layers
    # autocast's copies of the adapters, less lora_A's where its input needs no gradient
    # (the first layer's q/k/v, the cross-attention's k/v over the frozen vision states)
    unsaved = ("layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj",
               "layers.0.self_attn.v_proj", "layers.1.cross_attn.k_proj",
               "layers.1.cross_attn.v_proj")
    held = sum(2 * p.numel() for name, p in lora.named_parameters() if "lora_" in name
               and not ("lora_A" in name and any(f".{m}." in name for m in unsaved)))
    for images in (1, 2):
        made = processor(images=[[Image.new("RGB", (640, 480))] * images], return_tensors="pt")
        ids = torch.randint(3, 300, (1, seq), generator=torch.Generator().manual_seed(0))
        ids[0, [1, 5][:images]] = 300
        mask = torch.tensor(convert_sparse_cross_attention_mask_to_dense(
            [get_cross_attention_token_mask(ids[0].tolist(), 300)], made["num_tiles"], 4, seq))
        _, kept = kept_by_autograd(lambda: lora.base_model.model.model(
            input_ids=ids, cross_attention_mask=mask,
            pixel_values=made["pixel_values"].to(torch.bfloat16),
            aspect_ratio_ids=made["aspect_ratio_ids"],
            aspect_ratio_mask=made["aspect_ratio_mask"]).last_hidden_state, storages)
        text = act.activations(shape, reg, targets, seq, 0, 1, False, head_trainable=False,
                               lm_head=False)
        cross = cross_attention.image_bytes(shape, reg, targets, seq, False, False)
        assert images * vision.image_bytes(reg, False, Training(False, False)) == \
            made["pixel_values"].numel() * 4  # the frozen tower and projector: pixels only
        unseen = 2 * seq * shape.head_dim * 2 + 2 * 2 * len(shape.cross_layers)  # bf16 now
        assert kept - held == text.layers + text.other + images * cross + unseen, images

    # with checkpointing, enable_input_require_grads hooks the frozen tower's patch
    # embedding; finetune runs a frozen tower without autograd (model/frozen_tower.py), so
    # it keeps nothing, as the estimate counts (its layers are not checkpointed: without
    # that it would keep them all)
    from finetune.model.frozen_tower import keep_frozen_tower_out_of_autograd

    lora.base_model.model.activation_checkpointing_enable({"use_reentrant": False})
    keep_frozen_tower_out_of_autograd(lora)
    made = processor(images=[[Image.new("RGB", (640, 480))]], return_tensors="pt")
    inner = lora.base_model.model.model
    features, kept = kept_by_autograd(lambda: inner.multi_modal_projector(inner.vision_model(
        pixel_values=made["pixel_values"], aspect_ratio_ids=made["aspect_ratio_ids"],
        aspect_ratio_mask=made["aspect_ratio_mask"]).last_hidden_state), storages)
    assert not features.requires_grad and kept == 0
    assert vision.image_bytes(reg, True, Training(False, False)) == \
        made["pixel_values"].numel() * 4
