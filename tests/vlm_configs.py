"""For the estimator's vision-language tests (test_estimate_vision_families.py,
test_estimate_siglip_and_tiled_vlms.py): config.json files of vision-language models as
published on the hub (the repository is named above each; transcribed, and what
transformers builds from each has the model card's parameter count), a model directory
to read them from, and what autograd keeps for the backward."""

from __future__ import annotations

import json
import weakref

from finetune.estimate.walk import Regime

_TOKENS = {"bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
           "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
           "video_token_id": 151656}
# Qwen/Qwen2-VL-2B-Instruct's config.json (the text settings at the top level).
QWEN2_VL_2B = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0, **_TOKENS,
    "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.02,
    "intermediate_size": 8960, "max_position_embeddings": 32768, "max_window_layers": 28,
    "model_type": "qwen2_vl", "num_attention_heads": 12, "num_hidden_layers": 28,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2", "use_cache": True, "use_sliding_window": False,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16,
                      "in_chans": 3, "hidden_size": 1536, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936}
# Qwen/Qwen2.5-VL-3B-Instruct's config.json.
QWEN25_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0,
    **_TOKENS, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 128000, "max_window_layers": 70,
    "model_type": "qwen2_5_vl", "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2", "use_cache": True, "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                      "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                      "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                      "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                      "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936}
# Qwen/Qwen3-VL-2B-Instruct's and Qwen/Qwen3-VL-8B-Instruct's config.json, transcribed
# from copies of them in public repositories (the sizes; the keys as a complete copy of
# Qwen3-VL-4B-Instruct's lists them): the vision config names its model type "qwen3_vl",
# which Qwen3VLConfig renames qwen3_vl_vision.
_QWEN3_VL_TEXT = {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
                  "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128,
                  "hidden_act": "silu", "initializer_range": 0.02,
                  "max_position_embeddings": 262144, "model_type": "qwen3_vl_text",
                  "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
                  "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                   "rope_type": "default"},
                  "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936}
_QWEN3_VL_VISION = {"hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
                    "initializer_range": 0.02, "model_type": "qwen3_vl", "num_heads": 16,
                    "num_position_embeddings": 2304, "patch_size": 16, "spatial_merge_size": 2,
                    "temporal_patch_size": 2}
_QWEN3_VL = {"architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655,
             "model_type": "qwen3_vl", "transformers_version": "4.57.0.dev0",
             "video_token_id": 151656, "vision_end_token_id": 151653,
             "vision_start_token_id": 151652}
QWEN3_VL_2B = {
    **_QWEN3_VL, "tie_word_embeddings": True,
    "text_config": {**_QWEN3_VL_TEXT, "hidden_size": 2048, "intermediate_size": 6144,
                    "num_attention_heads": 16, "num_hidden_layers": 28,
                    "tie_word_embeddings": True},
    "vision_config": {**_QWEN3_VL_VISION, "deepstack_visual_indexes": [5, 11, 17], "depth": 24,
                      "hidden_size": 1024, "intermediate_size": 4096, "out_hidden_size": 2048}}
QWEN3_VL_8B = {
    **_QWEN3_VL, "tie_word_embeddings": False,
    "text_config": {**_QWEN3_VL_TEXT, "hidden_size": 4096, "intermediate_size": 12288,
                    "num_attention_heads": 32, "num_hidden_layers": 36,
                    "tie_word_embeddings": False},
    "vision_config": {**_QWEN3_VL_VISION, "deepstack_visual_indexes": [8, 16, 24], "depth": 27,
                      "hidden_size": 1152, "intermediate_size": 4304, "out_hidden_size": 4096}}
# What Qwen3-VL's preprocessor_config.json sets (its size: 256x256 to 4096x4096 pixels)
QWEN3_VL_PROCESSOR = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                      "size": {"longest_edge": 16777216, "shortest_edge": 65536},
                      "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                      "processor_class": "Qwen3VLProcessor",
                      "image_processor_type": "Qwen2VLImageProcessorFast"}
# Qwen/Qwen3.5-0.8B's config.json, its sizes transcribed from a copy in a public repository
# (brolm's qwen35 config test, "a compact mirror": the other keys are Qwen3_5Config's
# defaults); every 4th layer full attention, 16 key and 16 value heads in the Gated
# DeltaNet layers. QWEN3_5_DEFAULTS: Qwen3_5Config's own defaults (a "Qwen3.5-9B style"
# language model, 16 key and 32 value heads; Qwen3-VL-8B's tower, 27 blocks).
QWEN3_5_0_8B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
    "vision_end_token_id": 248054, "tie_word_embeddings": True,
    "text_config": {"vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
                    "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
                    "head_dim": 256, "attention_bias": False, "attn_output_gate": True,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 16,
                    "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                    "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
                    "full_attention_interval": 4, "max_position_embeddings": 262144,
                    "tie_word_embeddings": True, "mtp_num_hidden_layers": 1,
                    "mtp_use_dedicated_embeddings": False,
                    "layer_types": ["linear_attention"] * 3 + ["full_attention"]
                    + ["linear_attention"] * 3 + ["full_attention"]
                    + ["linear_attention"] * 3 + ["full_attention"]
                    + ["linear_attention"] * 3 + ["full_attention"]
                    + ["linear_attention"] * 3 + ["full_attention"]
                    + ["linear_attention"] * 3 + ["full_attention"],
                    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                                        "rope_theta": 10000000, "partial_rotary_factor": 0.25}},
    "vision_config": {"depth": 12, "hidden_size": 768, "num_heads": 12,
                      "intermediate_size": 3072, "in_channels": 3, "patch_size": 16,
                      "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 1024,
                      "num_position_embeddings": 2304, "deepstack_visual_indexes": []}}
QWEN3_5_DEFAULTS = {"architectures": ["Qwen3_5ForConditionalGeneration"],
                    "model_type": "qwen3_5"}
# google/gemma-3-4b-it's config.json.
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                    "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
# google/paligemma-3b-pt-224's and google/paligemma2-3b-pt-224's config.json.
_SIGLIP_SO400M = {"hidden_size": 1152, "intermediate_size": 4304,
                  "model_type": "siglip_vision_model", "num_attention_heads": 16,
                  "num_hidden_layers": 27, "num_image_tokens": 256, "patch_size": 14,
                  "vision_use_head": False}
PALIGEMMA_3B = {
    "architectures": ["PaliGemmaForConditionalGeneration"], "bos_token_id": 2,
    "eos_token_id": 1, "hidden_size": 2048, "ignore_index": -100,
    "image_token_index": 257152, "model_type": "paligemma", "pad_token_id": 0,
    "projection_dim": 2048,
    "text_config": {"hidden_size": 2048, "intermediate_size": 16384, "model_type": "gemma",
                    "num_attention_heads": 8, "num_hidden_layers": 18, "num_image_tokens": 256,
                    "num_key_value_heads": 1, "torch_dtype": "float32", "vocab_size": 257216},
    "torch_dtype": "float32", "transformers_version": "4.41.0.dev0",
    "vision_config": {**_SIGLIP_SO400M, "projection_dim": 2048,
                      "projector_hidden_act": "gelu_fast"}}
PALIGEMMA2_3B = {
    "architectures": ["PaliGemmaForConditionalGeneration"], "bos_token_id": 2,
    "eos_token_id": 1, "hidden_size": 2048, "image_token_index": 257152,
    "model_type": "paligemma", "num_hidden_layers": 26, "pad_token_id": 0,
    "projection_dim": 2304,
    "text_config": {"final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
                    "hidden_size": 2304, "intermediate_size": 9216, "model_type": "gemma2",
                    "num_attention_heads": 8, "num_hidden_layers": 26, "num_image_tokens": 256,
                    "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "torch_dtype": "bfloat16", "vocab_size": 257216},
    "torch_dtype": "bfloat16", "transformers_version": "4.47.0.dev0",
    "vision_config": {**_SIGLIP_SO400M, "num_positions": 256, "projection_dim": 2304,
                      "torch_dtype": "bfloat16"}}
# llava-hf/llava-v1.6-mistral-7b-hf's config.json.
LLAVA_NEXT_7B = {
    "architectures": ["LlavaNextForConditionalGeneration"], "ignore_index": -100,
    "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    "image_token_index": 32000, "model_type": "llava_next", "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "mistralai/Mistral-7B-Instruct-v0.2",
                    "architectures": ["MistralForCausalLM"], "intermediate_size": 14336,
                    "max_position_embeddings": 32768, "model_type": "mistral",
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
                    "sliding_window": None, "torch_dtype": "bfloat16", "vocab_size": 32064},
    "torch_dtype": "float16", "transformers_version": "4.39.0.dev0",
    "use_image_newline_parameter": True,
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
                      "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
    "vocab_size": 32064}
# Shaped as HuggingFaceTB/SmolVLM-256M-Instruct's config.json (an Idefics3 model; transcribed
# from memory, not checked against the hub file: 256,484,928 parameters, its name's 256M),
# with that model's processor settings (tiles of 512 pixels, longest edge 2048).
SMOLVLM_256M = {
    "architectures": ["Idefics3ForConditionalGeneration"], "image_token_id": 49190,
    "model_type": "idefics3", "scale_factor": 4,
    "text_config": {"architectures": ["VLlama3ForCausalLM"], "hidden_size": 576,
                    "intermediate_size": 1536, "max_position_embeddings": 8192,
                    "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
                    "num_key_value_heads": 3, "rms_norm_eps": 1e-05, "rope_theta": 100000,
                    "tie_word_embeddings": False, "vocab_size": 49280},
    "tie_word_embeddings": False,
    "vision_config": {"hidden_size": 768, "image_size": 512, "intermediate_size": 3072,
                      "model_type": "idefics3", "num_attention_heads": 12,
                      "num_hidden_layers": 12, "patch_size": 16}}
SMOLVLM_PROCESSOR = {"size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512}}


def model_dir(tmp_path, config, processor=None):
    """A model directory with `config` (and the image processor's settings)."""
    directory = tmp_path / config["model_type"]
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if processor is not None:
        (directory / "preprocessor_config.json").write_text(json.dumps(processor))
    return directory


def kept_by_autograd(forward, parameters: set[int]):
    """(forward()'s result under CPU autocast, bytes of what autograd saved for the backward
    that is still alive when it returns, parameter storages left out). Saved tensors are
    packed detached: a tensor packed with its grad_fn would tie a node that saves its own
    output (sdpa, sigmoid) into a reference cycle and keep graphs alive that training
    frees (a vision layer past the feature layer)."""
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


def qwen_tower_kept(tower_class, path, vision):
    """(tower, kept(copied, outputs)) for the Qwen tower of the model at `path` (Qwen2-VL's,
    Qwen2.5-VL's, Qwen3-VL's, Qwen3.5's), built from its config with random weights, on
    one picture of the estimate's `vision` size: kept() is what its forward keeps for the backward as the
    estimate counts it: autograd's, less the 16-bit weight copies of the parameters
    `copied(name)` says train (pos_embed is read without one), plus the batch's
    pixel_values (held by the caller); outputs(result) gives what the test checks of the
    tower's output."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path).vision_config
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = tower_class._from_config(config).train()
    width, height = vision.resized
    grid = torch.tensor([[1, height // vision.patch, width // vision.patch]])
    pixels = torch.randn(vision.positions, vision.patch_values)
    storages = {p.untyped_storage().data_ptr() for p in tower.parameters()}

    def kept(copied, outputs=lambda out: out.pooler_output):
        result, saved = kept_by_autograd(lambda: outputs(tower(pixels, grid_thw=grid)),
                                         storages)
        copies = sum(2 * p.numel() for n, p in tower.named_parameters()
                     if p.dim() > 1 and n != "pos_embed.weight" and copied(n))
        return result, saved - copies + pixels.numel() * 4

    return tower, kept


# fp32 weights under CPU autocast (bf16), sdpa: the regime the autograd checks run
CPU_AUTOCAST = Regime(residual=4, compute=2, autocast=True, base_trainable=True, quantized=0,
                      attention="sdpa", cuda=False)


# A tiny Llama 3.2 Vision (model_type mllama): its vision tower cuts each picture into
# tiles of TILE x TILE pixels (at most 2: 28x28 pictures are one tile, 56x28 two), and the
# language model reads the picture through cross-attention layers (here 1 of 2), so a
# picture is one <|image|> token in the text. Built the way configs/quickstart/
# make_vlm_assets.py builds the tiny LLaVA: the quickstart tokenizer with the image token
# and a chat template marking the answers with {% generation %}.
MLLAMA_IMAGE_TOKEN, TILE = "<|image|>", 28


def tiny_mllama(directory):
    """A model directory (config.json and the processor's files) of a tiny mllama, for
    `model.init: random`."""
    import sys

    from conftest import QUICKSTART

    sys.path.insert(0, str(QUICKSTART))
    import make_assets
    import make_vlm_assets
    from transformers import MllamaConfig, MllamaProcessor
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    sys.path.remove(str(QUICKSTART))
    tokenizer = make_assets.build_tokenizer()
    tokenizer.add_tokens([MLLAMA_IMAGE_TOKEN], special_tokens=True)
    template = make_vlm_assets.CHAT_TEMPLATE.replace(make_vlm_assets.IMAGE_TOKEN,
                                                     MLLAMA_IMAGE_TOKEN)
    tokenizer.chat_template = template
    images = MllamaImageProcessorPil(size={"height": TILE, "width": TILE}, max_image_tiles=2)
    MllamaProcessor(image_processor=images, tokenizer=tokenizer,
                    chat_template=template).save_pretrained(directory)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                  intermediate_size=64, vision_output_dim=32 * 3,  # 2 intermediate layers + last
                  intermediate_layers_indices=[0, 1], image_size=TILE, patch_size=14,
                  max_num_tiles=2, supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    # hidden 64: bitsandbytes' CPU kernel needs QLoRA's linear layers at least a block wide
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, cross_attention_layers=[1], num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    MllamaConfig(architectures=["MllamaForConditionalGeneration"], vision_config=vision,
                 text_config=text, image_token_index=tokenizer.convert_tokens_to_ids(
                     MLLAMA_IMAGE_TOKEN)).save_pretrained(directory)
    return directory


# A tiny Qwen2-VL: 8x8 patches merged 2x2, so a 32x32 picture is 4 <|image_pad|> tokens in
# the text, between <|vision_start|> and <|vision_end|> as its chat template puts them.
# Built as tiny_mllama is, on the quickstart tokenizer with those tokens added; its
# processor's files are written as a hub checkpoint ships them (Qwen/Qwen2-VL-2B-Instruct:
# preprocessor_config.json naming the image processor and the processor class,
# chat_template.json, the tokenizer's files; and video_preprocessor_config.json): the
# processor itself cannot be built without torchvision (its video processor needs it),
# the directory can, and AutoProcessor loads it where torchvision is.
QWEN2_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def tiny_qwen2_vl(directory, family: str = "qwen2_vl"):
    """A model directory (config.json and the processor's files) of a tiny Qwen2-VL, or
    with family "qwen2_5_vl" of a tiny Qwen2.5-VL (the same processor, but for its class;
    a 2-block tower whose first block attends within windows of 2 x 2 merged patches and
    whose second over the whole picture), or with "qwen3_vl" of a tiny Qwen3-VL (its own
    processor and video processor; a 2-block tower with learned position embeddings whose
    first block's merged patches are also added into the language model's first layer,
    deepstack; a Qwen3 language model with interleaved 3D rotary positions), or with
    "qwen3_5" of a tiny Qwen3.5 (Qwen3-VL's processor and tower without deepstack; a
    language model of one Gated DeltaNet layer and one gated attention layer), for
    `model.init: random`."""
    import sys

    from conftest import QUICKSTART

    sys.path.insert(0, str(QUICKSTART))
    import make_assets
    import make_vlm_assets
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3_5Config, Qwen3VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
        Qwen2VLImageProcessorPil

    sys.path.remove(str(QUICKSTART))
    tokenizer = make_assets.build_tokenizer()
    tokenizer.add_tokens(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                          "<|video_pad|>"], special_tokens=True)
    template = make_vlm_assets.CHAT_TEMPLATE.replace(make_vlm_assets.IMAGE_TOKEN,
                                                     QWEN2_VL_IMAGE)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    sizes = dict(patch_size=8, merge_size=2, temporal_patch_size=2,
                 size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64})
    processor, video = {"qwen2_vl": ("Qwen2VLProcessor", "Qwen2VLVideoProcessor"),
                        "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
                        "qwen3_vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
                        "qwen3_5": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor")}[family]
    images = {**Qwen2VLImageProcessorPil(**sizes).to_dict(), "processor_class": processor,
              "image_processor_type": "Qwen2VLImageProcessor"}
    videos = {**{k: v for k, v in images.items() if k != "image_processor_type"},
              "video_processor_type": video}
    for name, settings in (("preprocessor_config.json", images),
                           ("video_preprocessor_config.json", videos),
                           ("chat_template.json", {"chat_template": template})):
        (directory / name).write_text(json.dumps(settings, indent=2) + "\n")
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in
           (("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>"),
            ("image", "<|image_pad|>"), ("video", "<|video_pad|>"))}
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=8,
                  spatial_merge_size=2, temporal_patch_size=2)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3]})  # head dim 16: 8 frequencies
    architecture = {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                    "qwen3_vl": "Qwen3VLForConditionalGeneration",
                    "qwen3_5": "Qwen3_5ForConditionalGeneration"}[family]
    qwen3_tower = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                       patch_size=8, spatial_merge_size=2, temporal_patch_size=2,
                       out_hidden_size=64, num_position_embeddings=16)
    interleaved = {**text["rope_parameters"], "mrope_interleaved": True}
    if family == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                      patch_size=8, spatial_merge_size=2, temporal_patch_size=2,
                      window_size=16, fullatt_block_indexes=[1], out_hidden_size=64)
    elif family == "qwen3_vl":
        vision = {**qwen3_tower, "deepstack_visual_indexes": [0]}
        text = {**text, "head_dim": 16, "rope_parameters": interleaved}
    elif family == "qwen3_5":
        # layer 0 Gated DeltaNet (linear attention), layer 1 gated full attention that
        # rotates a quarter of each 32-dim head: 4 frequencies
        vision = qwen3_tower
        text = {**text, "head_dim": 32, "layer_types": ["linear_attention", "full_attention"],
                "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "rope_parameters": {**interleaved, "partial_rotary_factor": 0.25,
                                    "mrope_section": [2, 1, 1]}}
    config = {"qwen2_vl": Qwen2VLConfig, "qwen2_5_vl": Qwen2_5_VLConfig,
              "qwen3_vl": Qwen3VLConfig, "qwen3_5": Qwen3_5Config}[family]
    config(architectures=[architecture], vision_config=vision, text_config=text,
           **ids).save_pretrained(directory)
    return directory


# A tiny SmolVLM: a 1-layer SigLIP-layout tower on 32x32 pictures (4 x 4 patches of 8,
# pixel-shuffled 2x2 into 4 tokens), its processor not splitting pictures into tiles, so a
# picture is <fake_token_around_image><global-img>, 4 <image> and <fake_token_around_image>.
# The processor's files are written as tiny_qwen2_vl's are: SmolVLM's processor takes
# videos, so it is built only where torchvision (and num2words) is.
SMOLVLM_TOKENS = ("<fake_token_around_image>", "<global-img>", "<image>", "<end_of_utterance>")


def tiny_smolvlm(directory):
    """A model directory (config.json and the processor's files) of a tiny SmolVLM, for
    `model.init: random`."""
    import sys

    from conftest import QUICKSTART

    sys.path.insert(0, str(QUICKSTART))
    import make_assets
    import make_vlm_assets
    from transformers import SmolVLMConfig
    from transformers.models.smolvlm.image_processing_pil_smolvlm import \
        SmolVLMImageProcessorPil

    sys.path.remove(str(QUICKSTART))
    tokenizer = make_assets.build_tokenizer()
    tokenizer.add_tokens(list(SMOLVLM_TOKENS), special_tokens=True)
    template = make_vlm_assets.CHAT_TEMPLATE.replace(make_vlm_assets.IMAGE_TOKEN, "<image>")
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    sizes = dict(do_image_splitting=False, size={"longest_edge": 32},
                 max_image_size={"longest_edge": 32})
    images = {**SmolVLMImageProcessorPil(**sizes).to_dict(), "processor_class": "SmolVLMProcessor",
              "image_processor_type": "SmolVLMImageProcessor"}
    videos = {**{k: v for k, v in images.items() if k != "image_processor_type"},
              "video_processor_type": "SmolVLMVideoProcessor"}
    for name, settings in (("preprocessor_config.json", images),
                           ("video_preprocessor_config.json", videos),
                           ("processor_config.json", {"image_seq_len": 4,
                                                      "processor_class": "SmolVLMProcessor"}),
                           ("chat_template.json", {"chat_template": template})):
        (directory / name).write_text(json.dumps(settings, indent=2) + "\n")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    SmolVLMConfig(architectures=["SmolVLMForConditionalGeneration"], vision_config=vision,
                  text_config=text, scale_factor=2,
                  image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                  pad_token_id=tokenizer.pad_token_id).save_pretrained(directory)
    return directory


# A tiny Gemma 3: a 1-layer SigLIP tower on 32x32 pictures (4 x 4 patches of 8, pooled to
# 2 x 2), so a picture is <start_of_image>, 4 <image_soft_token> and <end_of_image> in the
# text (the processor puts them in place of the <start_of_image> its chat template
# writes). Built as tiny_mllama is, on the quickstart tokenizer with those tokens added.
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                 "image_token": "<image_soft_token>"}


def tiny_gemma3(directory):
    """A model directory (config.json and the processor's files) of a tiny Gemma 3, for
    `model.init: random`."""
    import sys

    from conftest import QUICKSTART

    sys.path.insert(0, str(QUICKSTART))
    import make_assets
    import make_vlm_assets
    from transformers import Gemma3Config, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    sys.path.remove(str(QUICKSTART))
    tokenizer = make_assets.build_tokenizer()
    tokenizer.add_tokens(list(GEMMA3_TOKENS.values()), special_tokens=True)
    tokenizer.save_pretrained(directory)  # read again with the tokens named
    tokenizer = type(tokenizer).from_pretrained(directory, extra_special_tokens=GEMMA3_TOKENS)
    template = make_vlm_assets.CHAT_TEMPLATE.replace(make_vlm_assets.IMAGE_TOKEN,
                                                     GEMMA3_TOKENS["boi_token"])
    tokenizer.chat_template = template
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=4,
                    chat_template=template).save_pretrained(directory)
    ids = {f"{name}_token_index": tokenizer.convert_tokens_to_ids(GEMMA3_TOKENS[f"{name}_token"])
           for name in ("boi", "eoi", "image")}
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8,
                  vision_use_head=False)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=256, sliding_window=64,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    Gemma3Config(architectures=["Gemma3ForConditionalGeneration"], vision_config=vision,
                 text_config=text, mm_tokens_per_image=4, **ids).save_pretrained(directory)
    return directory


def tiny_paligemma(directory):
    """A model directory of a tiny PaliGemma (a SigLIP tower, a Gemma language model),
    without a chat template, as PaliGemma ships, for `model.init: random`."""
    import sys

    from conftest import QUICKSTART

    sys.path.insert(0, str(QUICKSTART))
    import make_assets
    from transformers import PaliGemmaConfig, PaliGemmaProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    sys.path.remove(str(QUICKSTART))
    tokenizer = make_assets.build_tokenizer()
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(directory)
    tokenizer = type(tokenizer).from_pretrained(directory,
                                                extra_special_tokens={"image_token": "<image>"})
    images = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    images.image_seq_length = 16  # (32 / 8) ** 2 patches
    PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(directory)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8,
                  vision_use_head=False, projection_dim=64)
    text = dict(model_type="gemma", vocab_size=len(tokenizer), hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    PaliGemmaConfig(architectures=["PaliGemmaForConditionalGeneration"], vision_config=vision,
                    text_config=text, projection_dim=64, hidden_size=64,
                    image_token_index=tokenizer.convert_tokens_to_ids("<image>")
                    ).save_pretrained(directory)
    for leftover in ("chat_template.jinja", "chat_template.json"):
        (directory / leftover).unlink(missing_ok=True)
    return directory


# Qwen/Qwen3-30B-A3B's config.json (the sizes as its model card and config list them:
# 128 experts, 8 a token; transformers builds 30,532,122,624 parameters, the card's 30.5B)
# and Qwen/Qwen3-VL-30B-A3B-Instruct's (that language model under Qwen3-VL-8B's tower
# with out_hidden_size 2048: 31,070,754,032, the card's 31.1B). Transcribed from memory of
# the published files (no network here): the totals are the check.
_QWEN3_MOE_TEXT = {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
                   "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
                   "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
                   "intermediate_size": 6144, "mlp_only_layers": [],
                   "moe_intermediate_size": 768, "norm_topk_prob": True,
                   "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
                   "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
                   "vocab_size": 151936}
QWEN3_30B_A3B = {**_QWEN3_MOE_TEXT, "architectures": ["Qwen3MoeForCausalLM"],
                 "model_type": "qwen3_moe", "max_position_embeddings": 40960,
                 "rope_theta": 1000000.0, "tie_word_embeddings": False,
                 "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False}
QWEN3_VL_30B_A3B = {
    **_QWEN3_VL, "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    "model_type": "qwen3_vl_moe", "tie_word_embeddings": False,
    "text_config": {**_QWEN3_MOE_TEXT, "model_type": "qwen3_vl_moe_text", "dtype": "bfloat16",
                    "max_position_embeddings": 262144, "rope_theta": 5000000,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                     "rope_type": "default"}},
    "vision_config": {**_QWEN3_VL_VISION, "model_type": "qwen3_vl_moe",
                      "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_size": 1152,
                      "intermediate_size": 4304, "out_hidden_size": 2048}}
