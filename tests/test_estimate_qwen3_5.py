"""`finetune estimate` for Qwen3.5 (vision/qwen3_5.py: Qwen3-VL's tower without deepstack;
estimate/linear_attention.py: the hybrid language model of Gated DeltaNet and gated
attention layers): the published and the default configs' parts against what transformers
builds (the meta device), every parameter by name, what one Gated DeltaNet layer, one
gated attention layer and the tower save against autograd (a small model, random weights,
CPU autocast), the text-only qwen3_5_text, the report, the CLI and bad configs. LoRA and
QLoRA against apply_peft: test_estimate_vision_peft.py's published-config cases."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from conftest import QUICKSTART, run_cli
from test_estimate_vision_families import PARTS as FAMILIES
from vlm_configs import CPU_AUTOCAST, QWEN3_5_0_8B, kept_by_autograd, model_dir, qwen_tower_kept
from finetune.config import load_experiment
from finetune.errors import ConfigError
from finetune.estimate import estimate, render_text
from finetune.estimate.activations import layer_bytes
from finetune.estimate.census import census
from finetune.estimate.memory import model_states
from finetune.estimate.settings import Layout, settings_of
from finetune.estimate.shapes import parameters, read_shape

VLM = QUICKSTART / "vlm.yaml"
SFT = QUICKSTART / "sft.yaml"
# By part (test_estimate_vision_families.py checks them against the estimate)
PARTS = {name: FAMILIES[name] for name in ("qwen3.5-0.8b", "qwen3.5-defaults")}
# A small hybrid language model: a Gated DeltaNet layer (2 key heads, 4 value heads:
# queries and keys repeated) and a gated attention layer; 2 blocks of Qwen3.5's tower.
SMALL_TEXT = {"model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "vocab_size": 300, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 32,
              "linear_value_head_dim": 32, "layer_types": ["linear_attention", "full_attention"],
              "tie_word_embeddings": False}
SMALL = {**QWEN3_5_0_8B, "tie_word_embeddings": False,
         "text_config": {k: v for k, v in SMALL_TEXT.items() if k != "model_type"},
         "vision_config": {**QWEN3_5_0_8B["vision_config"], "depth": 2, "hidden_size": 64,
                           "intermediate_size": 80, "num_heads": 4, "out_hidden_size": 64,
                           "num_position_embeddings": 64}}


def _with(config: dict, part: str = "text_config", **values) -> dict:
    return {**config, part: {**config[part], **values}}


def _meta_model(path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForCausalLM if config.model_type == "qwen3_5_text" else \
        AutoModelForImageTextToText
    with torch.device("meta"):
        return auto.from_config(config)


@pytest.mark.slow  # imports torch; the meta device builds no weights (about 4 s)
def test_parameters_are_transformers_own(tmp_path):
    """By name, count and order: the published and the default configs, the small one
    untied, and the text-only qwen3_5_text (Qwen3_5ForCausalLM)."""
    pytest.importorskip("torch")
    for config in [c for c, _ in PARTS.values()] + [SMALL, SMALL_TEXT]:
        path = model_dir(tmp_path, config)
        real = [(n, p.numel()) for n, p in _meta_model(path).named_parameters()]
        assert [(p.name, p.numel) for p in parameters(read_shape(str(path)), "lm")] == real


@pytest.mark.slow  # imports torch (the meta device)
def test_zero3_gathers_the_largest_layer(tmp_path):
    """ZeRO-3 and FSDP gather a layer at a time (and prefetch the next): sized as the
    largest of transformers' own layers, here the Gated DeltaNet one, not as a dense
    model's attention layer (43,008 parameters)."""
    pytest.importorskip("torch")
    path = model_dir(tmp_path, SMALL)
    layers: dict[str, int] = {}
    for name, p in _meta_model(path).named_parameters():
        found = re.match(r"(.*\.(?:layers|blocks)\.\d+)\.", name)
        if found:
            layers[found.group(1)] = layers.get(found.group(1), 0) + p.numel()
    largest = max(layers, key=layers.get)
    assert largest == "model.language_model.layers.0"  # Gated DeltaNet
    dense = 64 * (128 + 2 * 64) + 128 * 64 + 3 * 64 * 96
    assert layers[largest] > layers["model.language_model.layers.1"] > dense
    experiment = load_experiment(VLM, [f"model.name_or_path={path}", "peft.type=none",
                                       "distributed.strategy=deepspeed",
                                       "distributed.deepspeed.zero_stage=3"])
    settings = settings_of(experiment, gpus=2)
    states = model_states(census(read_shape(str(path)), settings), [], settings,
                          Layout("deepspeed", 3))
    assert states.buffers == 2 * 2 * layers[largest]  # 16 bits, two layers


@pytest.mark.slow  # imports torch; two small layers, a few forwards (about 3 s)
@pytest.mark.parametrize("seq", [128, 100, 64])
def test_layer_activations_against_autograd(tmp_path, seq):
    """Each layer of the small language model, fp32 weights, CPU autocast, one row of seq
    tokens (100: padded to 2 chunks of 64; 64: one chunk), trained and with every weight
    frozen (the input needing its gradient, as under LoRA): what autograd keeps, less the
    16-bit weight copies, against layer_bytes and the RMSNorms' 1 + weight (in fp32, per
    layer, not per token): within 0.01% (left out: exp(A_log), per layer). The gated
    attention layer once two more things are added: the rotary cos/sin (made once per
    forward) and the copy the CPU makes of sdpa's output, laid out (batch, heads, seq, dim)
    where CUDA's kernels write (batch, seq, heads, dim) and the transpose is free."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    path = model_dir(tmp_path, SMALL_TEXT)
    shape = read_shape(str(path))
    assert shape.linear_layers == (0,)
    config = AutoConfig.from_pretrained(path)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    inner = model.model
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randn(1, seq, shape.hidden, requires_grad=True)
    cos, sin = inner.rotary_emb(x, torch.arange(seq)[None].expand(3, 1, -1))
    for trained in (True, False):
        reg = CPU_AUTOCAST if trained else replace(CPU_AUTOCAST, base_trainable=False)
        for p in model.parameters():
            p.requires_grad_(trained)
        for n, layer in enumerate(inner.layers):
            _, kept = kept_by_autograd(lambda: layer(x, position_embeddings=(cos, sin)),
                                       storages)
            kept -= sum(2 * p.numel() for p in layer.parameters() if p.dim() > 1)
            expected = seq * layer_bytes(shape, reg, frozenset(), seq, index=n) + sum(
                4 * m.weight.numel() for m in layer.modules()  # 1 + weight, in fp32
                if type(m).__name__ == "Qwen3_5RMSNorm")
            if n not in shape.linear_layers:
                expected += seq * shape.q_dim * 2 + cos.numel() * 4 + sin.numel() * 4
            assert abs(kept - expected) <= 0.0001 * kept, (n, trained, kept, expected)


@pytest.mark.slow  # imports torch; a 2-block tower (about 1 s)
def test_image_activations_against_autograd(tmp_path):
    """The small VLM's tower (Qwen3_5VisionModel), fp32 weights, one 448x336 picture, CPU
    autocast: what autograd keeps, less the 16-bit weight copies, plus the pixels, equals
    Qwen3-VL's walk without deepstack to the byte, trained and with the tower frozen."""
    pytest.importorskip("torch")
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
    from finetune.estimate.vision import Training

    path = model_dir(tmp_path, SMALL)
    vision = read_shape(str(path)).vision.for_image((448, 336))
    tower, kept = qwen_tower_kept(Qwen3_5VisionModel, path, vision)

    def measured(copied) -> int:
        features, saved = kept(copied)
        assert features.shape[0] == vision.image_tokens
        return saved

    assert measured(lambda name: True) == vision.image_bytes(CPU_AUTOCAST, False)
    for name, p in tower.named_parameters():
        p.requires_grad_(name.startswith("merger."))
    assert measured(lambda name: name.startswith("merger.")) == vision.image_bytes(
        CPU_AUTOCAST, False, Training(tower=False))


def test_the_report_says_what_it_assumed(tmp_path):
    path = model_dir(tmp_path, QWEN3_5_0_8B)
    text = render_text(estimate(load_experiment(VLM, [f"model.name_or_path={path}",
                                                      "training.max_length=1024"])))
    assert "Gated DeltaNet layers (18 of 24): transformers' PyTorch linear attention " \
           "(torch_chunk_gated_delta_rule over chunks of 64 tokens, F.conv1d), what finetune " \
           "runs; flash-linear-attention and causal-conv1d, where installed, would save " \
           "other tensors" in text
    assert "vision tower: qwen3_5_vision, 12 blocks over 1200 patches an image (attention " \
           "over the whole image), all kept for the backward;" in text


def test_the_text_model_alone(tmp_path):
    """qwen3_5_text (Qwen3_5ForCausalLM) through the same code: the language model of
    Qwen3.5-0.8B, its names under model., its head tied as its text config says."""
    text = {**QWEN3_5_0_8B["text_config"], "model_type": "qwen3_5_text"}
    result = estimate(load_experiment(SFT, [f"model.name_or_path={model_dir(tmp_path, text)}"]))
    assert result.params == PARTS["qwen3.5-0.8b"][1]["language_model"]
    assert result.shape.prefix == "model." and result.shape.tied
    assert len(result.shape.linear_layers) == 18


@pytest.mark.slow  # a CLI process
def test_cli(tmp_path):
    model = model_dir(tmp_path, QWEN3_5_0_8B)
    result = run_cli("estimate", str(VLM), f"model.name_or_path={model}", "peft.type=lora",
                     "training.max_length=1024", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for text in ("model: qwen3_5, 0.853B parameters", "300 tokens an image",
                 "Gated DeltaNet layers (18 of 24)"):
        assert text in result.stdout, text
    data = json.loads(run_cli("estimate", str(VLM), f"model.name_or_path={model}", "--json",
                              cwd=tmp_path).stdout)
    assert data["model"]["parts"] == PARTS["qwen3.5-0.8b"][1]


@pytest.mark.parametrize("config, message", [
    (_with(QWEN3_5_0_8B, layer_types=["linear_attention"] * 23),
     "layer_types must list 24 (num_hidden_layers) of linear_attention "
     "or full_attention"),
    (_with(QWEN3_5_0_8B, layer_types=["linear_attention"] * 23 + ["sliding_attention"]),
     "layer_types must list 24"),
    (_with(QWEN3_5_0_8B, linear_num_value_heads=24),
     "linear_num_value_heads (24) must be a multiple of linear_num_key_heads (16)"),
    (_with(QWEN3_5_0_8B, linear_key_head_dim=0), "linear_key_head_dim must be an integer"),
    ({**QWEN3_5_0_8B, "text_config": "big"}, "text_config must be an object"),
    # qwen3_5_moe is counted (test_estimate_moe.py): a dense config read with
    # Qwen3_5MoeTextConfig's defaults (256 experts)
    (_with({**QWEN3_5_0_8B, "model_type": "qwen3_5_moe"}, num_experts_per_tok=300),
     "num_experts_per_tok (300) must be at most num_experts (256)"),
], ids=["layers", "kind", "heads", "head-dim", "text", "moe"])
def test_bad_configs_are_one_error_naming_the_key(tmp_path, config, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as raised:
        read_shape(str(model_dir(tmp_path, config)))
    assert len(raised.value.problems) == 1
