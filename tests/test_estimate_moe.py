"""`finetune estimate` for the Qwen3 mixture-of-experts models (estimate/moe.py): qwen3_moe,
qwen3_vl_moe (Qwen3-VL's tower over that language model) and Qwen3.5-MoE (qwen3_5_moe,
qwen3_5_moe_text: the hybrid language model with routed and shared experts). Every parameter by name
against transformers' own model on the meta device, the published totals, LoRA and QLoRA
against apply_peft, what one sparse layer saves against autograd (transformers' default
grouped_mm experts, CPU autocast), ZeRO-3's gathered layer, the report and bad configs."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from conftest import QUICKSTART
from vlm_configs import CPU_AUTOCAST, QWEN3_30B_A3B, QWEN3_VL_30B_A3B, kept_by_autograd, model_dir
from finetune.config import load_experiment
from finetune.errors import ConfigError
from finetune.estimate import estimate, render_text
from finetune.estimate.activations import layer_bytes
from finetune.estimate.census import census
from finetune.estimate.memory import model_states
from finetune.estimate.settings import Layout, settings_of
from finetune.estimate.shapes import parameters, read_shape

SFT = QUICKSTART / "sft.yaml"
VLM = QUICKSTART / "vlm.yaml"
# 3 layers, the middle one dense (mlp_only_layers); 6 experts, 2 a token
SMALL = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96,
         "moe_intermediate_size": 48, "num_experts": 6, "num_experts_per_tok": 2,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "vocab_size": 300, "mlp_only_layers": [1], "norm_topk_prob": True}
SMALL_VL = {"model_type": "qwen3_vl_moe",
            "text_config": {k: v for k, v in SMALL.items() if k != "model_type"},
            "vision_config": {"depth": 2, "hidden_size": 64, "intermediate_size": 80,
                              "num_heads": 4, "out_hidden_size": 64,
                              "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}}
# Qwen3VLMoeConfig's own defaults (not Qwen3-VL-30B-A3B's sizes: 24 layers of 60 experts)
VL_DEFAULTS = {"model_type": "qwen3_vl_moe", "text_config": {}, "vision_config": {}}
# Qwen3.5-MoE: a Gated DeltaNet layer and a gated attention layer, each with 6 routed
# experts (2 a token) and a shared expert; Qwen3_5MoeConfig's own defaults (its docstring's
# Qwen3.5-35B-A3B: 40 layers of 256 experts, 8 a token, Qwen3-VL's 27-block tower)
SMALL_35_TEXT = {"model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                 "vocab_size": 300, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                 "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                 "layer_types": ["linear_attention", "full_attention"],
                 "moe_intermediate_size": 48, "shared_expert_intermediate_size": 40,
                 "num_experts": 6, "num_experts_per_tok": 2}
SMALL_35 = {"model_type": "qwen3_5_moe",
            "text_config": {k: v for k, v in SMALL_35_TEXT.items() if k != "model_type"},
            "vision_config": {**SMALL_VL["vision_config"], "deepstack_visual_indexes": []}}
QWEN3_5_MOE_DEFAULTS = {"model_type": "qwen3_5_moe"}


def _meta_model(path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForCausalLM if config.model_type in ("qwen3_moe", "qwen3_5_moe_text") \
        else AutoModelForImageTextToText
    with torch.device("meta"):
        return auto.from_config(config)


@pytest.mark.slow  # imports torch; the meta device builds no weights (about 8 s)
def test_parameters_are_transformers_own(tmp_path):
    """By name, count and order, and the published totals: Qwen3-30B-A3B 30.5B,
    Qwen3-VL-30B-A3B 31.1B (its tower and mergers as Qwen3-VL's); Qwen3.5-MoE's
    (the router before the experts, then the shared expert and its gate)."""
    pytest.importorskip("torch")
    totals = {}
    for name, config in [("small", SMALL), ("small-vl", SMALL_VL), ("30b", QWEN3_30B_A3B),
                         ("vl-30b", QWEN3_VL_30B_A3B), ("vl-defaults", VL_DEFAULTS),
                         ("35-text", SMALL_35_TEXT), ("35", SMALL_35),
                         ("35-defaults", QWEN3_5_MOE_DEFAULTS)]:
        path = model_dir(tmp_path, config)
        real = [(n, p.numel()) for n, p in _meta_model(path).named_parameters()]
        assert [(p.name, p.numel) for p in parameters(read_shape(str(path)), "lm")] == real
        totals[name] = sum(n for _, n in real)
    assert totals["30b"] == 30_532_122_624
    assert totals["vl-30b"] == 31_070_754_032
    assert totals["vl-defaults"] == 14_052_070_640
    assert totals["35-defaults"] == 35_114_261_360
    parts = estimate(load_experiment(VLM, [
        f"model.name_or_path={model_dir(tmp_path, QWEN3_VL_30B_A3B)}"])).parts
    assert parts["language_model"] == totals["30b"]  # the same language model
    assert sum(parts.values()) == totals["vl-30b"]


def test_which_layers_are_sparse(tmp_path):
    """As the decoder layer decides: not in mlp_only_layers, and every decoder_sparse_step-th."""
    shape = read_shape(str(model_dir(tmp_path, {**SMALL, "num_hidden_layers": 6,
                                                "decoder_sparse_step": 2,
                                                "mlp_only_layers": [3]})))
    assert shape.moe.layers == (1, 5)
    names = {p.name for p in parameters(shape, "lm")}
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.3.mlp.gate_proj.weight" in names


ATTENTION = "peft.target_modules=[q_proj,k_proj,v_proj,o_proj]"


@pytest.mark.slow  # imports torch; the meta device (about 4 s)
@pytest.mark.parametrize("config, yaml, targets", [
    (SMALL, SFT, [ATTENTION]), (QWEN3_30B_A3B, SFT, [ATTENTION]),
    (SMALL, SFT, [r"peft.target_modules=model\.layers\.0\.self_attn\.(q|k)_proj"]),
    (SMALL_VL, VLM, []), (SMALL_35_TEXT, SFT, []), (SMALL_35, VLM, [])],
    ids=["small", "30b", "regex", "vl-all-linear", "3.5-text-all-linear", "3.5-all-linear"])
def test_lora_and_qlora_against_apply_peft(tmp_path, config, yaml, targets):
    """LoRA as apply_peft puts it, tensor by tensor: on the attention of a qwen3_moe (a
    regex there is resolved by peft to the names it matches, then put on every layer), and
    with finetune's default all-linear on qwen3_vl_moe (its regex of the language model's
    Linear names: the attention and the dense layer's MLP, no expert, no router) and on
    Qwen3.5-MoE (peft converts neither: the Gated DeltaNet's and attention's Linears, the
    shared expert's and its gate). QLoRA:
    bitsandbytes replaces nn.Linear only, so exactly those are 4-bit, and the experts and
    routers are among what prepare_model_for_kbit_training casts to fp32 (bitsandbytes
    cannot quantize on the CPU: the quantized set is read from the model's nn.Linear
    modules, as test_estimate_vision_peft.py does)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from finetune.model.peft import apply_peft

    auto = AutoModelForCausalLM if yaml == SFT else AutoModelForImageTextToText
    path = model_dir(tmp_path, config)
    experiment = load_experiment(yaml, ["precision=bf16", f"model.name_or_path={path}",
                                        "peft.type=lora", "peft.r=2", *targets])
    with torch.device("meta"):
        model = auto.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
        model = apply_peft(model, experiment, gradient_checkpointing=False)
    dtypes = {torch.float32: "fp32", torch.bfloat16: "bf16"}

    def name(n: str) -> str:
        n = n.removeprefix("base_model.model.").replace(".base_layer.", ".")
        return re.sub(r"\.lora_([AB])\.default\.weight$", r".lora_\1", n)

    real = {name(n): (p.numel(), p.numel() * p.element_size(), dtypes[p.dtype], p.requires_grad)
            for n, p in model.named_parameters()}
    result = estimate(experiment)
    counted = {t.name: (t.numel, t.nbytes, t.dtype, t.trainable)
               for t in census(result.shape, result.settings)}
    assert counted == real
    assert not any(".experts." in n or ".gate." in n for n in real if ".lora_" in n)
    if config is SMALL_VL:
        assert "model.language_model.layers.1.mlp.down_proj.lora_A" in real
    if config is SMALL_35:
        assert "model.language_model.layers.0.mlp.shared_expert_gate.lora_A" in real

    qlora = estimate(load_experiment(yaml, [f"model.name_or_path={path}", "peft.type=qlora",
                                            "peft.r=2", "precision=bf16", *targets]))
    tensors = census(qlora.shape, qlora.settings)
    with torch.device("meta"):
        base = auto.from_config(AutoConfig.from_pretrained(path))
    linear = {f"{n}.weight" for n, m in base.named_modules()
              if isinstance(m, torch.nn.Linear) and n != "lm_head"
              and not n.startswith("model.visual")}
    assert {t.name for t in tensors if t.dtype == "nf4"} == linear
    experts = [t for t in tensors if t.role in ("experts", "router")]
    assert experts and all(t.dtype == "fp32" and not t.trainable for t in experts)


@pytest.mark.slow  # imports torch; the meta device (about 1 s)
def test_lora_reaching_the_experts_is_refused(tmp_path):
    """finetune's default all-linear on a text qwen3_moe: peft maps gate_proj/up_proj/
    down_proj/gate to the fused parameters (target_parameters), which take no lora
    dropout (training refuses the default one: model/peft.py, tests/test_lora_moe.py);
    the estimate refuses it as one error naming the key, for a list and a regex reaching
    them too."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM
    from finetune.model.peft import apply_peft

    path = model_dir(tmp_path, SMALL)
    lora = [f"model.name_or_path={path}", "peft.type=lora", "peft.dropout=0"]
    experiment = load_experiment(SFT, lora)  # validate refuses the dropout of a local one
    hub_like = experiment.model_copy(update={"peft": experiment.peft.model_copy(
        update={"dropout": 0.05})})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        with pytest.raises(ConfigError, match="peft.dropout: 0.05 cannot go with LoRA on "
                                              "qwen3_moe's experts"):
            apply_peft(model, hub_like, gradient_checkpointing=False)
    for targets in ([], ["peft.target_modules=[q_proj,gate]"],
                    ["peft.target_modules=.*experts.(gate|up)_proj"]):
        with pytest.raises(ConfigError, match="reaches this qwen3_moe's MLPs") as raised:
            estimate(load_experiment(SFT, [*lora, *targets]))
        assert len(raised.value.problems) == 1


@pytest.mark.slow  # imports torch; two small layers, a few forwards (about 3 s)
def test_layer_activations_against_autograd(tmp_path):
    """Each layer of the small model (sparse, dense), CPU autocast, one row of 128 tokens,
    with transformers' default experts implementation (grouped_mm; CUDA's default too):
    what autograd keeps, less the 16-bit copies of the 2-D weights (the experts run
    grouped_mm in their own dtype, which autocast leaves alone), against layer_bytes plus
    the rotary cos/sin (made once per forward) and, in a sparse layer, grouped_mm's
    offsets (int32, one per expert: per layer, not per token): to the byte, fp32 weights
    trained and frozen, and bf16 weights without renormalised top-k weights. The routing
    is data-dependent, the total is not: another seed's router keeps as much."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    path = model_dir(tmp_path, {**SMALL, "num_hidden_layers": 2})
    shape = read_shape(str(path))
    config = AutoConfig.from_pretrained(path)
    config._attn_implementation = "sdpa"
    seq = 128
    for seed, dtype, norm_topk in [(0, torch.float32, True), (1, torch.float32, True),
                                   (0, torch.bfloat16, False)]:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).train().to(dtype)
        assert model.config._experts_implementation == "grouped_mm"
        inner = model.model
        inner.layers[0].mlp.gate.norm_topk_prob = norm_topk
        storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        x = torch.randn(1, seq, shape.hidden, dtype=dtype, requires_grad=True)
        cos, sin = inner.rotary_emb(x, torch.arange(seq)[None])
        base = replace(CPU_AUTOCAST, residual=x.element_size())
        moe = replace(shape.moe, norm_topk=norm_topk)
        for trained in (True, False):
            reg = replace(base, base_trainable=trained)
            for p in model.parameters():
                p.requires_grad_(trained)
            for n, layer in enumerate(inner.layers):
                _, kept = kept_by_autograd(lambda: layer(x, position_embeddings=(cos, sin)),
                                           storages)
                if dtype == torch.float32:
                    kept -= sum(2 * p.numel() for p in layer.parameters() if p.dim() == 2)
                expected = seq * layer_bytes(replace(shape, moe=moe), reg, frozenset(), seq,
                                             index=n) + 2 * cos.numel() * cos.element_size()
                if n in shape.moe.layers:
                    expected += 4 * shape.moe.experts
                assert kept == expected, (seed, dtype, trained, n, kept, expected)


@pytest.mark.slow  # imports torch; two small layers, a few forwards (about 2 s)
def test_hybrid_layer_activations_against_autograd(tmp_path):
    """Qwen3.5-MoE's layers (a Gated DeltaNet one, a gated attention one, each with routed
    experts and a shared expert), fp32 weights, CPU autocast, 128 tokens, trained and
    frozen: what autograd keeps, less the 16-bit copies of the weights autocast makes
    (not of the experts), against layer_bytes plus what test_estimate_qwen3_5.py adds
    (the norms' 1 + weight in fp32; the attention layer's rotary cos/sin and the CPU's
    copy of sdpa's output) and grouped_mm's offsets: the attention layer to the byte, the
    Gated DeltaNet one within 0.01% (left out there: exp(A_log), per layer)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    path = model_dir(tmp_path, SMALL_35_TEXT)
    shape = read_shape(str(path))
    config = AutoConfig.from_pretrained(path)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    inner = model.model
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seq = 128
    x = torch.randn(1, seq, shape.hidden, requires_grad=True)
    cos, sin = inner.rotary_emb(x, torch.arange(seq)[None].expand(3, 1, -1))
    for trained in (True, False):
        reg = replace(CPU_AUTOCAST, base_trainable=trained)
        for p in model.parameters():
            p.requires_grad_(trained)
        for n, layer in enumerate(inner.layers):
            _, kept = kept_by_autograd(lambda: layer(x, position_embeddings=(cos, sin)),
                                       storages)
            kept -= sum(2 * p.numel() for name, p in layer.named_parameters()
                        if p.dim() > 1 and ".experts." not in name)
            expected = seq * layer_bytes(shape, reg, frozenset(), seq, index=n) + sum(
                4 * m.weight.numel() for m in layer.modules()
                if type(m).__name__ == "Qwen3_5MoeRMSNorm") + 4 * shape.moe.experts
            if n in shape.linear_layers:
                assert abs(kept - expected) <= 0.0001 * kept, (n, trained, kept, expected)
            else:
                expected += seq * shape.q_dim * 2 + 4 * (cos.numel() + sin.numel())
                assert kept == expected, (n, trained, kept, expected)


def test_zero3_gathers_a_layer_with_its_experts(tmp_path):
    """ZeRO-3 gathers a decoder layer at a time (and prefetches the next), experts and
    router included: Qwen3-30B-A3B's is 623M parameters, 16 bits."""
    path = model_dir(tmp_path, QWEN3_30B_A3B)
    h, e, i = 2048, 128, 768
    layer = (h * 4096 + 2 * h * 512 + 4096 * h + 2 * 128  # attention, q/k norms
             + e * (2 * i * h + h * i) + e * h + 2 * h)   # experts, router, norms
    assert layer == 623_120_640
    experiment = load_experiment(SFT, [f"model.name_or_path={path}", "peft.type=none",
                                       "distributed.strategy=deepspeed",
                                       "distributed.deepspeed.zero_stage=3"])
    settings = settings_of(experiment, gpus=2)
    states = model_states(census(read_shape(str(path)), settings), [], settings,
                          Layout("deepspeed", 3))
    assert states.buffers == 2 * 2 * layer


def test_the_report_says_what_it_assumed(tmp_path):
    path = model_dir(tmp_path, QWEN3_30B_A3B)
    text = render_text(estimate(load_experiment(SFT, [f"model.name_or_path={path}",
                                                      "peft.type=lora", ATTENTION])))
    assert "model: qwen3_moe, 30.532B parameters" in text
    assert "mixture of experts (48 of 48 layers): 128 experts, top 8 a token, no capacity " \
           "factor" in text
    assert "transformers' default experts implementation grouped_mm" in text
    hybrid = render_text(estimate(load_experiment(VLM, [
        f"model.name_or_path={model_dir(tmp_path, SMALL_35)}"])))
    assert "mixture of experts (2 of 2 layers): 6 experts, top 2 a token, and a shared " \
           "expert every token reaches, no capacity factor" in hybrid


def _text(**values) -> dict:
    return {**SMALL, **values}


@pytest.mark.parametrize("config, message", [
    (_text(num_experts_per_tok=7), "num_experts_per_tok (7) must be at most num_experts (6)"),
    (_text(moe_intermediate_size=None), "moe_intermediate_size must be an integer"),
    (_text(num_experts=0), "num_experts must be an integer"),
    (_text(mlp_only_layers="1"), "mlp_only_layers must be a list of layer indexes"),
    (_text(decoder_sparse_step=0), "decoder_sparse_step must be an integer"),
    ({**SMALL_VL, "text_config": {**SMALL_VL["text_config"], "num_experts_per_tok": 61,
                                  "num_experts": None}},
     "num_experts must be an integer"),
    ({**SMALL_35, "text_config": {**SMALL_35["text_config"],
                                  "shared_expert_intermediate_size": 0}},
     "shared_expert_intermediate_size must be an integer"),
], ids=["top-k", "intermediate", "experts", "dense-layers", "step", "vl", "shared"])
def test_bad_configs_are_one_error_naming_the_key(tmp_path, config, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as raised:
        read_shape(str(model_dir(tmp_path, config)))
    assert len(raised.value.problems) == 1
