"""Mixture-of-experts MLPs of the Qwen3 family (`qwen3_moe`; the language model of
`qwen3_vl_moe`, vision/qwen3_vl.py; Qwen3.5-MoE's hybrid one, `qwen3_5_moe_text` and
`qwen3_5_moe`, with a shared expert), as transformers 5 builds and runs them
(models/qwen3_moe, qwen3_vl_moe, qwen3_5_moe; integrations/moe.py).

A sparse layer's `mlp` holds `experts` (every expert's weights fused in two 3-D
nn.Parameters: gate_up_proj (experts, 2 x moe_intermediate, hidden) and down_proj (experts,
hidden, moe_intermediate), no nn.Linear) and a router `gate` (a weight (experts, hidden) read
with F.linear, no nn.Linear either). bitsandbytes (which replaces nn.Linear) leaves them
whole, in 16 bits, and prepare_model_for_kbit_training then casts them to fp32 like every
other unquantized weight. LoRA: finetune's regex for qwen3_vl_moe's language model
(vision_parts), and all-linear on Qwen3.5-MoE, reach its Linears only (the attention, the
dense MLPs, Qwen3.5-MoE's shared expert and its gate); on a text qwen3_moe, peft
turns targets naming the MLP (all-linear does) into LoRA on the fused parameters, which
the estimator refuses (refuse_lora_on_experts). Layers in mlp_only_layers, or off
decoder_sparse_step, keep a dense MLP.

The forward: softmax over the router's logits (fp32), top num_experts_per_tok of them
(renormalised where norm_topk_prob, always in qwen3_vl_moe), then the experts
implementation transformers picks by default on CUDA and on the CPU alike, grouped_mm:
each token's hidden state copied once per chosen expert, sorted by expert, one grouped
matmul for gate_up and one for down (torch's grouped_mm, not autocast: it runs in the
experts' weights' dtype, fp32 masters included), SiLU(gate) * up, the result times the
routing weight, back in order, summed over the top k. No capacity factor: every token
reaches its k experts, so what a layer saves is tokens x k rows however the router splits
them (only the split between experts depends on the data).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from finetune.errors import ConfigError
from finetune.estimate.param import Param
from finetune.estimate.walk import _T, Regime, _Walk, _linear

CONFIG = {"qwen3_moe": ("qwen3_moe/configuration_qwen3_moe.py", "Qwen3MoeConfig"),
          "qwen3_vl_moe_text": ("qwen3_vl_moe/configuration_qwen3_vl_moe.py",
                                "Qwen3VLMoeTextConfig"),
          "qwen3_5_moe_text": ("qwen3_5_moe/configuration_qwen3_5_moe.py",
                               "Qwen3_5MoeTextConfig")}
# The text model each is counted as (qwen3_vl_moe's is a qwen3_moe)
TEXT_KIND = {"qwen3_vl_moe_text": "qwen3_moe"}
# Qwen3.5-MoE: every layer sparse, the router always renormalised, and a shared expert
# (a dense SwiGLU MLP of shared_expert_intermediate_size, its output times the sigmoid of
# shared_expert_gate, a Linear to 1) beside the routed ones; it has no dense MLP size.
SHARED = "qwen3_5_moe_text"
IMPLEMENTATION = "grouped_mm"


@dataclass(frozen=True)
class Experts:
    experts: int          # num_experts
    top_k: int            # num_experts_per_tok
    intermediate: int     # moe_intermediate_size (each expert's)
    layers: tuple[int, ...]  # the sparse layers
    norm_topk: bool       # the top-k weights renormalised to sum to 1
    shared: int = 0       # Qwen3.5-MoE: the shared expert's intermediate size (0: none)


def read(config: dict[str, Any], layers: int, where: str,
         to_int: Callable[..., int]) -> Experts:
    """The experts' sizes of a config already filled with its class's defaults
    (CONFIG); which layers are sparse as the decoder layer decides it."""
    experts = to_int(config, "num_experts", where)
    top_k = to_int(config, "num_experts_per_tok", where)
    if top_k > experts:
        raise ConfigError([f"{where}: num_experts_per_tok ({top_k}) must be at most "
                           f"num_experts ({experts})"])
    kind = config["model_type"]
    if kind == SHARED:
        return Experts(experts=experts, top_k=top_k,
                       intermediate=to_int(config, "moe_intermediate_size", where),
                       layers=tuple(range(layers)), norm_topk=True,
                       shared=to_int(config, "shared_expert_intermediate_size", where))
    step = to_int(config, "decoder_sparse_step", where)
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in dense):
        raise ConfigError([f"{where}: mlp_only_layers must be a list of layer indexes, "
                           f"got {str(dense)[:40]}"])
    sparse = tuple(n for n in range(layers) if n not in dense and (n + 1) % step == 0)
    return Experts(experts=experts, top_k=top_k,
                   intermediate=to_int(config, "moe_intermediate_size", where),
                   layers=sparse,
                   norm_topk=kind == "qwen3_vl_moe_text"
                   or bool(config.get("norm_topk_prob")))


def sparse(shape, n: int) -> bool:
    return shape.moe is not None and n in shape.moe.layers


def parameters(shape, mlp: str) -> list[Param]:
    """A sparse layer's router and experts in named_parameters() order: the experts
    first (Qwen3-MoE, Qwen3-VL-MoE), the router first (Qwen3.5-MoE: its shared expert's
    Linears follow, shapes.linears)."""
    e, h, i = shape.moe.experts, shape.hidden, shape.moe.intermediate
    router = [Param(f"{mlp}.gate.weight", e * h, "router", f"{mlp}.gate", e)]
    experts = [Param(f"{mlp}.experts.gate_up_proj", e * 2 * i * h, "experts", f"{mlp}.experts"),
               Param(f"{mlp}.experts.down_proj", e * h * i, "experts", f"{mlp}.experts")]
    return router + experts if shape.moe.shared else experts + router


def _index(layer: str) -> int:
    return int(layer.rsplit(".", 1)[1])


def after_attention(shape, layer: str) -> list[Param]:
    """A sparse layer's router and experts where they follow its attention's parameters
    (no shared expert: no Linear of the MLP to put them before)."""
    if not sparse(shape, _index(layer)) or shape.moe.shared:
        return []
    return parameters(shape, f"{layer}.mlp")


def last_linear(shape, layer: str) -> str:
    """The Linear after which a decoder layer's norms come in named_parameters()."""
    if not sparse(shape, _index(layer)):
        return f"{layer}.mlp.down_proj"
    if shape.moe.shared:
        return f"{layer}.mlp.shared_expert_gate"
    return f"{layer}.self_attn.o_proj"


def shared_linears(shape, mlp: str) -> list[tuple[str, int, int]]:
    """The shared expert's Linears and its gate's (name, in, out), in named_modules() order."""
    h, s = shape.hidden, shape.moe.shared
    if not s:
        return []
    e = f"{mlp}.shared_expert"
    return [(f"{e}.gate_proj", h, s), (f"{e}.up_proj", h, s), (f"{e}.down_proj", s, h),
            (f"{mlp}.shared_expert_gate", h, 1)]


def module_names(shape, mlp: str) -> list[str]:
    names = [mlp, f"{mlp}.experts", f"{mlp}.experts.act_fn", f"{mlp}.gate"]
    if shape.moe.shared:
        names += [f"{mlp}.shared_expert", f"{mlp}.shared_expert.act_fn"] + [
            name for name, _, _ in shared_linears(shape, mlp)]
    return names


def mlp_bytes(w: _Walk, y: _T, shape, reg: Regime, targets: frozenset[str]) -> None:
    """What a sparse MLP saves for the backward, per token, on the normed input y (which
    requires grad). The experts' matmuls run in their weights' dtype, which is the
    residual stream's in every regime (fp32 masters; 16 bits when ZeRO-3/FSDP cast the
    module; the base's dtype under LoRA; fp32 after prepare_model_for_kbit_training)."""
    moe, h = shape.moe, shape.hidden
    k, i, e = moe.top_k, moe.intermediate, moe.experts
    trains = reg.base_trainable
    # The router: F.linear (autocast: a 16-bit input), softmax in fp32 saves its output,
    # topk its indices (int64); renormalising divides in place (saves result and sum).
    if trains:
        w.save(w.cast(y, reg.compute) if reg.autocast else y)
    logits = reg.compute if reg.autocast else y.nbytes
    w.save(w.new(e, 4), w.new(k, 8))
    if moe.norm_topk:
        w.save(w.new(k, 4), w.new(1, 4))
    routing = w.new(k, logits)  # the top-k weights, cast back to the logits' dtype
    # grouped_mm: a gather of k rows a token, three int64 index vectors of k a token
    # (the gather's, the routing weights', the output's reorder)
    weights = reg.residual
    w.save(w.new(k, 8), w.new(k, 8), w.new(k, 8))
    rows = w.new(k * h, y.nbytes)
    if trains:
        w.save(w.cast(rows, weights))
    gate_up = w.new(k * 2 * i, weights)
    act = w.new(k * i, weights)
    w.save(gate_up, act)  # silu saves gate, the product saves silu(gate) and up (views)
    product = w.new(k * i, weights)
    if trains:
        w.save(product)
    down = w.new(k * h, weights)
    w.save(down, routing)  # times the routing weight: saves both
    if moe.shared:  # a dense SwiGLU MLP on y, times sigmoid(shared_expert_gate(y))
        g = _linear(w, y, moe.shared, reg, "gate_proj" in targets)
        u = _linear(w, y, moe.shared, reg, "up_proj" in targets)
        w.save(g, w.new(moe.shared, g.nbytes), u)  # silu saves g; the product its inputs
        m = w.new(moe.shared, max(g.nbytes, u.nbytes))
        d = _linear(w, m, h, reg, "down_proj" in targets)
        gate = _linear(w, y, 1, reg, "shared_expert_gate" in targets)
        w.save(w.new(1, gate.nbytes), d)  # the sigmoid's output, times the MLP's


def note(shape) -> str:
    moe = shape.moe
    return (f"mixture of experts ({len(moe.layers)} of {shape.layers} layers): "
            f"{moe.experts} experts, top {moe.top_k} a token"
            f"{', and a shared expert every token reaches' if moe.shared else ''}, "
            f"no capacity factor (every "
            f"token reaches its {moe.top_k}; how they split between experts changes nothing "
            f"counted); transformers' default experts implementation {IMPLEMENTATION} "
            "(grouped matmuls in the experts' weights' dtype, fp32 in full fine-tuning); "
            "the experts and routers are nn.Parameters, not nn.Linear: LoRA counted on "
            "none of them, QLoRA quantizes none (fp32 after "
            "prepare_model_for_kbit_training)")


# What peft (0.21, under transformers 5) renames for qwen3_moe: LoRA on these v4 names
# becomes LoRA on the fused parameters (target_parameters): gate_up_proj, down_proj,
# gate.weight. That LoRA keeps every sparse layer's whole experts' weights (W + BA) for
# the backward, and refuses lora_dropout > 0.
PEFT_RENAMED = ("gate_proj", "up_proj", "down_proj", "gate")


def refuse_lora_on_experts(shape, target) -> None:
    """peft.target_modules that reach a text qwen3_moe's experts or router (all-linear
    does) are refused: the estimator does not count that LoRA. peft converts no other
    (qwen3_vl_moe, qwen3_5_moe and qwen3_5_moe_text: LoRA on their Linears only)."""
    if shape.model_type != "qwen3_moe":
        return
    if isinstance(target, str) and target.lower() == "all-linear":
        reached = True
    elif isinstance(target, str):  # peft probes the v4 names with the regex
        names = [f"{shape.prefix}layers.{n}.mlp.{leaf}" for n in range(shape.layers)
                 for leaf in (PEFT_RENAMED[:3] if not sparse(shape, n) else
                              ("experts.gate_proj", "experts.up_proj", "experts.down_proj",
                               "gate"))]
        try:
            reached = any(re.fullmatch(target, name) for name in names)
        except re.error:
            return  # the regex's own error is reported by shapes.matched
    else:
        reached = any(t == leaf or t.endswith(f".{leaf}") for t in target
                      for leaf in PEFT_RENAMED)
    if reached:
        raise ConfigError([
            f"peft.target_modules: {target!r} reaches this qwen3_moe's MLPs, which peft "
            "turns into LoRA on the fused expert parameters and the router (target_parameters; "
            "it refuses lora dropout then, and the backward keeps each layer's whole experts' "
            "weights): the estimator does not count that. Target the attention, e.g. "
            "peft.target_modules=[q_proj,k_proj,v_proj,o_proj]"])


def peft_target(shape, target, names: list[str]):
    """peft (0.21) resolves a regex target_modules of a qwen3_moe to the last names of
    the modules it matches, then matches those in every layer: a regex naming layer 0's
    q_proj puts LoRA on every q_proj. names: the model's module names."""
    if shape.model_type != "qwen3_moe" or not isinstance(target, str) \
            or target.lower() == "all-linear":
        return target
    try:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names if re.fullmatch(target, n)})
    except re.error:
        return target  # reported by shapes.matched
    return leaves or target
