"""Activation memory: the tensors autograd saves for the backward pass, per token.

An estimate, built the way Korthikanti et al. (2022) count activations, but by walking the
ops of a transformers llama/qwen decoder layer in order and tracking each tensor's dtype,
so that the differences between regimes come out by themselves:
- full fine-tuning under autocast keeps an fp32 residual stream (fp32 embeddings and
  norms) while matmuls run in 16 bits, and every linear saves its own 16-bit cast of its
  input;
- a frozen linear saves nothing (the input gradient needs only the weight); a LoRA
  adapter saves its dropout mask, its 16-bit input and its rank-r intermediate;
- sdpa/flash attention saves q, k, v, the output and a log-sum-exp, never the s x s
  scores (eager attention does); with a mask, transformers repeats k and v to every
  query head before sdpa (no GQA kernel then). A padding-free or packed batch under sdpa
  gets a dense mask over the whole flattened row; a varlen kernel keeps none;
- a mixture-of-experts MLP keeps top-k rows a token (moe.py).
The walk saves a tensor once however many ops save it, as autograd does.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.estimate import cross_attention, linear_attention, moe
from finetune.estimate.shapes import Shape
from finetune.estimate.walk import Regime, _gemma_norm, _linear, _norm, _T, _Walk

LOGIT_SAVED = 4       # fp32 log-softmax output, saved for the backward of the loss
LOGIT_TRANSIENT = 8   # its gradient and the logits' gradient (fp32), at the start of backward


def _any_norm(w: _Walk, x: _T, rows: int, reg: Regime, shape: Shape, grad: bool = True) -> _T:
    if shape.gemma:
        return _gemma_norm(w, x, rows, reg.base_trainable, grad)
    return _norm(w, x, rows, reg, reg.base_trainable, grad)


def _attention(w: _Walk, q: _T, k: _T, v: _T, shape: Shape, reg: Regime, seq: int) -> _T:
    """sdpa converts a boolean mask to the query's dtype on every call and saves it:
    mask_keys elements per token and layer (seq for a padding mask; every token of the
    micro batch for the block mask of a flattened, padding-free row)."""
    heads, q_dim = shape.heads, shape.q_dim
    # RoPE: q * cos + rotate_half(q) * sin, with cos/sin in the residual dtype (saved once
    # per model); the result is promoted to it.
    q = w.new(q.elems, max(q.nbytes, reg.residual))
    k = w.new(k.elems, max(k.nbytes, reg.residual))
    c = reg.compute if reg.autocast else q.nbytes
    masked = reg.attention == "sdpa" and reg.mask_keys > 0
    expand = reg.attention == "eager" or masked
    if expand and shape.kv_heads != shape.heads:  # repeat_kv copies k and v per query head
        k, v = w.new(q_dim, k.nbytes), w.new(q_dim, v.nbytes)
    q, k, v = w.cast(q, c), w.cast(k, c), w.cast(v, c)
    w.save(q, k, v)
    if reg.attention == "eager":
        keys = reg.mask_keys or seq
        w.save(w.new(heads * keys, 4), w.new(heads * keys, c))  # softmax (fp32), its cast
        if shape.attn_softcap:  # Gemma 2: cap * tanh(scores / cap); tanh saves its output
            w.save(w.new(heads * keys, c))
        out = w.new(q_dim, c)  # transpose(1, 2).contiguous() copies the output
        return out
    out = w.new(q_dim, c)  # kernels write (batch, seq, heads, dim): the transpose is free
    w.save(out, w.new(heads, 4))  # + log-sum-exp per head
    if masked:
        w.save(w.new(reg.mask_keys, c))
    return out


def _self_attention(w: _Walk, y: _T, shape: Shape, reg: Regime, targets: frozenset[str],
                    seq: int, grad: bool) -> _T:
    """q/k/v, their norms, attention and o_proj; returns o_proj's output. Qwen3.5's gated
    attention: q_proj also makes a gate, and o_proj reads the output times its sigmoid
    (the product saves the output and the sigmoid's, which saves it too)."""
    q_out = 2 * shape.q_dim if shape.attn_gate else shape.q_dim
    q = _linear(w, y, q_out, reg, "q_proj" in targets, grad)
    k = _linear(w, y, shape.kv_dim, reg, "k_proj" in targets, grad)
    v = _linear(w, y, shape.kv_dim, reg, "v_proj" in targets, grad)
    if shape.attn_gate:  # q_proj's halves; `gate` stands for the sigmoid's output
        q, gate = w.new(shape.q_dim, q.nbytes), w.new(shape.q_dim, q.nbytes)
    if shape.qk_norm:  # qwen3, gemma3: RMSNorm over each head of q and k
        q = _any_norm(w, q, shape.heads, reg, shape)
        k = _any_norm(w, k, shape.kv_heads, reg, shape)
    out = _attention(w, q, k, v, shape, reg, seq)
    if shape.attn_gate:
        w.save(out, gate)
        out = w.new(shape.q_dim, max(out.nbytes, gate.nbytes))
    return _linear(w, out, shape.hidden, reg, "o_proj" in targets)


def layer_bytes(shape: Shape, reg: Regime, targets: frozenset[str], seq: int,
                grad: bool = True, index: int = -1) -> int:
    """Bytes saved by one decoder layer, per token. grad: whether its input requires grad.
    index: the layer's (mllama's cross-attention layers walk their own way, Qwen3.5's
    Gated DeltaNet layers their token mixer: linear_attention.py)."""
    if index in shape.cross_layers:
        return cross_attention.layer_bytes(shape, reg, targets, grad)
    w = _Walk()
    h, i = shape.hidden, shape.intermediate
    x = w.new(h, reg.residual)
    y = _any_norm(w, x, 1, reg, shape, grad)
    if index in shape.linear_layers:
        o = linear_attention.mixer_bytes(w, y, shape, reg, targets, seq, grad)
    else:
        o = _self_attention(w, y, shape, reg, targets, seq, grad)
    if shape.sandwich:  # Gemma 2/3's post_attention_layernorm, on the attention's output
        o = _gemma_norm(w, o, 1, reg.base_trainable)
    x2 = w.new(h, max(reg.residual, o.nbytes))
    y2 = _any_norm(w, x2, 1, reg, shape)
    if moe.sparse(shape, index):  # routed experts (moe.py)
        moe.mlp_bytes(w, y2, shape, reg, targets)
        return w.total
    g = _linear(w, y2, i, reg, "gate_proj" in targets)
    u = _linear(w, y2, i, reg, "up_proj" in targets)
    a = w.new(i, g.nbytes)  # silu(g) saves g
    w.save(g, u) if reg.liger else w.save(g, a, u)  # a * u saves both; Liger recomputes a
    m = w.new(i, max(a.nbytes, u.nbytes))
    d = _linear(w, m, h, reg, "down_proj" in targets)
    if shape.sandwich:  # post_feedforward_layernorm, on the MLP's output
        _gemma_norm(w, d, 1, reg.base_trainable)
    return w.total


@dataclass(frozen=True)
class Activations:
    """Bytes for one sample (all its sequences); every term grows linearly with the batch."""
    layers: int         # decoder layers (with checkpointing: their inputs + one recomputed layer)
    other: int          # token ids, final norm, head input, labels
    logits_saved: int   # the loss's saved fp32 log-softmax
    logits_peak: int    # its gradient and the logits' gradient, alive together in backward
    vision: int = 0     # a vision-language model's images: tower and projector (vision.py)

    @property
    def total(self) -> int:
        return self.layers + self.other + self.logits_saved + self.logits_peak + self.vision


def activations(shape: Shape, reg: Regime, layer_targets: list[frozenset[str]], seq: int,
                logit_tokens: int, sequences: int, checkpointing: bool,
                head_trainable: bool, lm_head: bool, input_grad: bool = False,
                skipped: frozenset[int] = frozenset()) -> Activations:
    """Per sample. layer_targets: the LoRA-targeted projections of each layer. input_grad:
    the input embeddings require grad (a VLM's image features from a trained part).
    skipped: layers the forward does not run (mllama's cross-attention layers in a batch
    without pictures): they keep nothing."""
    run = [n for n in range(len(layer_targets)) if n not in skipped]
    per_layer = [layer_bytes(shape, reg, t, seq, index=n) if n in run else 0
                 for n, t in enumerate(layer_targets)]
    if not reg.base_trainable and not checkpointing and not input_grad:
        # Under LoRA the embeddings are frozen, so nothing before the first adapter needs a
        # gradient (with checkpointing, enable_input_require_grads changes that).
        first = next((n for n in run if layer_targets[n]), len(per_layer))
        per_layer[:first] = [0] * first
        if first < len(per_layer):
            per_layer[first] = layer_bytes(shape, reg, layer_targets[first], seq, grad=False,
                                           index=first)
    if checkpointing:  # each layer keeps its input; backward recomputes one layer at a time
        layers = len(run) * shape.hidden * reg.residual + max(per_layer)
    else:
        layers = sum(per_layer)
    w = _Walk()
    x = w.new(shape.hidden, reg.residual)
    y = _any_norm(w, x, 1, reg, shape)
    per_token = w.total
    if reg.base_trainable:
        per_token += 8                              # int64 ids, for the embedding's gradient
    if lm_head:
        per_token += 8                              # int64 shifted labels of the loss
    head_tokens = logit_tokens if lm_head else seq
    head_in = 0
    if head_trainable:
        head_in = y.elems * (reg.compute if reg.autocast else y.nbytes)
    vocab = shape.vocab if lm_head else 0
    # Gemma 2's soft-capping: tanh saves its output, the logits' dtype
    softcap = (reg.compute if reg.autocast else reg.residual) if shape.logit_softcap else 0
    return Activations(
        layers=sequences * seq * layers,
        other=sequences * (seq * per_token + head_tokens * head_in),
        logits_saved=sequences * logit_tokens * vocab * (LOGIT_SAVED + softcap),
        logits_peak=sequences * logit_tokens * vocab * LOGIT_TRANSIENT)
