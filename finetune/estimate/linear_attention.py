"""Qwen3.5's hybrid language model (transformers models/qwen3_5, `qwen3_5_text`, inside every
`qwen3_5` vision-language model): its layer_types make most layers Gated DeltaNet layers
(module `linear_attn`, Qwen3_5GatedDeltaNet) and every few a gated attention layer
(`self_attn`: q_proj makes a query and a sigmoid output gate, 2x wide; q/k norms; rotary
on a quarter of each head, which changes nothing saved). Both have the layer's usual MLP and
two RMSNorms, Qwen3.5's zero-centred ones (x * (1 + w) in fp32: Gemma's, shape.gemma).

A Gated DeltaNet layer holds in_proj_qkv (queries, keys and values in one), in_proj_z (the
output gate), in_proj_b and in_proj_a (a scalar per value head: the write strength beta
and the decay's input), a depthwise causal conv1d over the queries, keys and values,
dt_bias and A_log (a scalar per value head), a gated RMSNorm per value head and out_proj.

What it saves for the backward is walked for transformers' own PyTorch path, the one every
finetune install runs (flash-linear-attention and causal-conv1d are not installed; with
them the kernels save other, fewer tensors): F.conv1d and SiLU, then
torch_chunk_gated_delta_rule, which works in fp32 on chunks of CHUNK tokens (the sequence
padded to a multiple of it) and keeps, per token and value head, its l2-normed queries and
keys, the UT system and the intra-chunk scores (a row of CHUNK values each), the solved
values and decayed keys, and per chunk the recurrent state (key_dim x value_dim a head).
Checked against autograd (tests/test_estimate_qwen3_5.py) to within 0.01%: what a
sequence saves is spread over its tokens in whole bytes, and exp(A_log), a value per head
and layer, is left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from finetune.errors import ConfigError
from finetune.estimate import walk
from finetune.estimate.param import Param

CONFIG = ("qwen3_5/configuration_qwen3_5.py", "Qwen3_5TextConfig")
CHUNK = 64          # torch_chunk_gated_delta_rule's chunk_size
KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class DeltaNet:
    """A Gated DeltaNet layer's sizes (linear_* of Qwen3_5TextConfig)."""
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    kernel: int  # linear_conv_kernel_dim

    @property
    def keys(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def values(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def conv(self) -> int:
        """Channels of the conv1d: queries, keys and values."""
        return 2 * self.keys + self.values


def read(config: dict[str, Any], layers: int, where: str,
         integer: Callable[..., int]) -> tuple[tuple[int, ...], DeltaNet]:
    """(the Gated DeltaNet layers, their sizes) of a qwen3_5_text config (with its class's
    defaults), its integers read by shapes.py's reader (`integer`, passed in: shapes
    imports this module). layer_types, where absent, is what Qwen3_5TextConfig makes of
    full_attention_interval (default 4): every interval-th layer full attention."""
    kinds = config.get("layer_types")
    if kinds is None:
        interval = integer(config, "full_attention_interval", where, default=4)
        kinds = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or not all(k in KINDS for k in kinds):
        raise ConfigError([f"{where}: layer_types must list {layers} (num_hidden_layers) of "
                           f"{' or '.join(KINDS)}, got {str(kinds)[:60]}"])
    sizes = DeltaNet(*(integer(config, key, where) for key in (
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "linear_conv_kernel_dim")))
    if sizes.value_heads % sizes.key_heads:
        raise ConfigError([f"{where}: linear_num_value_heads ({sizes.value_heads}) must be a "
                           f"multiple of linear_num_key_heads ({sizes.key_heads})"])
    return tuple(n for n, k in enumerate(kinds) if k == "linear_attention"), sizes


def projections(shape, module: str) -> list[tuple[str, int, int]]:
    """A Gated DeltaNet's Linears (name, in, out), in named_modules() order."""
    d, h = shape.delta, shape.hidden
    return [(f"{module}.out_proj", d.values, h), (f"{module}.in_proj_qkv", h, d.conv),
            (f"{module}.in_proj_z", h, d.values), (f"{module}.in_proj_b", h, d.value_heads),
            (f"{module}.in_proj_a", h, d.value_heads)]


def parameters(shape, module: str) -> list[Param]:
    """linear_attn's parameters, in named_parameters() order: its own (dt_bias, A_log)
    first, then conv1d's, the norm's and the Linears'."""
    d = shape.delta
    params = [Param(f"{module}.dt_bias", d.value_heads, "norm", module),
              Param(f"{module}.A_log", d.value_heads, "norm", module),
              Param(f"{module}.conv1d.weight", d.conv * d.kernel, "conv", f"{module}.conv1d",
                    d.conv),
              Param(f"{module}.norm.weight", d.value_head_dim, "norm", f"{module}.norm")]
    for name, inp, out in projections(shape, module):
        params.append(Param(f"{name}.weight", inp * out, "linear", name, out))
    return params


def module_names(shape, module: str) -> list[str]:
    return [module, f"{module}.conv1d", f"{module}.norm",
            *(name for name, _, _ in projections(shape, module))]


def mixer_bytes(w: walk._Walk, y: walk._T, shape, reg: walk.Regime, targets: frozenset[str],
                seq: int, grad: bool) -> walk._T:
    """What linear_attn saves on the normed input y; returns its output (out_proj's).
    Its conv1d weight, norm weight, dt_bias and A_log are in the residual dtype (fp32 but
    under plain LoRA and 16-bit sharding)."""
    d, trained = shape.delta, reg.base_trainable
    qkv = walk._linear(w, y, d.conv, reg, "in_proj_qkv" in targets, grad)
    walk._linear(w, y, d.values, reg, "in_proj_z" in targets, grad)
    b = walk._linear(w, y, d.value_heads, reg, "in_proj_b" in targets, grad)
    walk._linear(w, y, d.value_heads, reg, "in_proj_a" in targets, grad)
    # causal_conv1d_fn: the input cast to the weight's dtype; conv1d (16-bit under
    # autocast) saves its input, a frozen weight's too, and SiLU its input (conv's output)
    conv_in = w.cast(qkv, reg.residual)
    conv_in = w.cast(conv_in, reg.compute) if reg.autocast else conv_in
    w.save(conv_in, w.new(d.conv, conv_in.nbytes))
    w.save(w.new(d.value_heads, b.nbytes))  # beta = sigmoid(b): its output
    # g = -exp(A_log) * softplus(a.float() + dt_bias): softplus saves its fp32 input, the
    # product (for a trained A_log) softplus's output
    w.save(w.new(d.value_heads, 4))
    if trained:
        w.save(w.new(d.value_heads, 4))
    w.save(w.new(sequence_bytes(shape, reg, seq) // seq, 1))
    out = qkv.nbytes  # the rule's output, cast back to the queries' dtype
    # Qwen3_5RMSNormGated per value head: its fp32 input and rsqrt, the normed value in
    # `out` (for a trained weight), the fp32 gate SiLU saves and its output, and the
    # weighted value the gate's product saves
    w.save(w.new(d.values, 4), w.new(d.value_heads, 4))
    if trained:
        w.save(w.new(d.values, out))
    w.save(w.new(d.values, 4), w.new(d.values, 4), w.new(d.values, max(out, reg.residual)))
    return walk._linear(w, w.new(d.values, out), shape.hidden, reg, "out_proj" in targets)


def sequence_bytes(shape, reg: walk.Regime, seq: int) -> int:
    """Bytes a Gated DeltaNet layer saves per sequence of seq tokens in
    torch_chunk_gated_delta_rule, and conv1d's output past the sequence (its K - 1 padding
    columns, which SiLU's saved input keeps). The rule pads the sequence to chunks of CHUNK
    tokens and works in fp32, per value head (queries and keys are repeated to every value
    head first); its matmuls save 16-bit casts of their operands under autocast (a cast
    per call), the operands themselves otherwise. The first chunk's state is zeros (no
    gradient); the last chunk's state update is never read, and its graph is freed."""
    d, c = shape.delta, reg.compute
    padded = -(-seq // CHUNK) * CHUNK
    chunks, heads, dk, dv = padded // CHUNK, d.value_heads, d.key_head_dim, d.value_head_dim
    w = walk._Walk()

    def fp32(per_token: int, tokens: int = padded) -> walk._T:
        return w.new(heads * per_token * tokens, 4)

    def matmul(*operands: walk._T) -> None:
        w.save(*(w.cast(x, c) if reg.autocast else x for x in operands))

    # l2norm saves its fp32 input and inverse norm, for the queries and for the keys,
    # before the padding
    w.save(fp32(dk, seq), fp32(1, seq), fp32(dk, seq), fp32(1, seq))
    q, k, v, beta, k_beta = fp32(dk), fp32(dk), fp32(dv), fp32(1), fp32(dk)
    w.save(k, v, beta, fp32(CHUNK), w.new(CHUNK * CHUNK, 1))  # k/v * beta; decays, mask
    for a in (k_beta, q):  # k_beta @ k^T and q @ k^T, each times the pairwise decays
        matmul(a, k)
        w.save(w.new(heads * CHUNK * padded, c if reg.autocast else 4))
    # decayed k_beta; solve_triangular's system and its two results; decayed q (and k,
    # read by the state updates: none with one chunk); exp(cumulative decay) for each,
    # and the chunks' decays
    k_cum, q2, k2, intra = fp32(dk), fp32(dk), fp32(dk), fp32(CHUNK)
    w.save(k_beta, fp32(CHUNK), fp32(dv), k_cum, q, fp32(1), fp32(1),
           w.new(heads * chunks, 4))
    if chunks > 1:
        w.save(fp32(1))
    for i in range(chunks):
        state, v_new = fp32(dk * dv, 1), fp32(dv, CHUNK)
        if reg.autocast:  # the chunk's slices, cast per matmul
            k_cum, q2, k2, intra = fp32(dk, CHUNK), fp32(dk, CHUNK), fp32(dk, CHUNK), \
                fp32(CHUNK, CHUNK)
        # v_new = new_values - k_cum @ S; out = q @ S + intra @ v_new
        for a in (k_cum, q2):
            matmul(state) if i == 0 else matmul(a, state)
        matmul(intra, v_new)
        if i < chunks - 1:  # S * chunk decay + k^T @ v_new
            w.save(state)
            matmul(k2, v_new)
    return w.total + (d.kernel - 1) * d.conv * (c if reg.autocast else reg.residual)


def note(shape) -> str:
    """What the report says the estimate assumed of the Gated DeltaNet layers."""
    return (f"Gated DeltaNet layers ({len(shape.linear_layers)} of {shape.layers}): "
            "transformers' PyTorch linear attention (torch_chunk_gated_delta_rule over chunks "
            f"of {CHUNK} tokens, F.conv1d), what finetune runs; flash-linear-attention and "
            "causal-conv1d, where installed, would save other tensors")
