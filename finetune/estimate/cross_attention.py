"""Llama 3.2 Vision's (mllama's) cross-attention decoder layers, inside its language model at
text_config.cross_attention_layers (transformers models/mllama,
MllamaCrossAttentionDecoderLayer): what they hold and what they save for the backward.

A cross-attention layer has a self-attention layer's parameters and linears (q_proj, k_proj,
v_proj, o_proj, the MLP, two RMSNorms) under `cross_attn` instead of `self_attn`, plus an
RMSNorm over each head of q and of k (q_norm, k_norm) and two scalar gates. Its queries are
the text tokens; its keys and values are the projector's output, every tile's positions of
every image of the row (the padded tiles too: the processor pads pixel_values to
max_image_tiles). So part of what it saves is per text token (this module's layer_bytes,
walked as activations.layer_bytes walks a self-attention layer) and part per image
(image_bytes): k_proj and v_proj over the vision states, k_norm, the keys and values sdpa
keeps, and the cross-attention mask, a key per text token and vision position, in the
model's dtype (which autocast casts for every layer's sdpa call, and sdpa saves that cast).
transformers skips these layers for a batch without pictures and runs them for every row of
a batch with one: the estimate counts them for every row, unless no row has a picture
(images_per_row 0: core.activation_bytes passes them as skipped).
"""

from __future__ import annotations

from finetune.estimate import walk
from finetune.estimate.param import Param


def attention_name(shape, n: int) -> str:
    """The attention module's name in layer n."""
    return "cross_attn" if n in shape.cross_layers else "self_attn"


def layer_extras(shape, layer: str) -> list[Param]:
    """A cross-attention layer's parameters beyond a self-attention layer's (its q/k norms
    and gates), after the layer's norms in the parameter list."""
    if int(layer.rsplit(".", 1)[1]) not in shape.cross_layers:
        return []
    attention = f"{layer}.cross_attn"
    return [Param(f"{attention}.q_norm.weight", shape.head_dim, "norm", f"{attention}.q_norm"),
            Param(f"{attention}.k_norm.weight", shape.head_dim, "norm", f"{attention}.k_norm"),
            Param(f"{layer}.cross_attn_attn_gate", 1, "norm", layer),
            Param(f"{layer}.cross_attn_mlp_gate", 1, "norm", layer)]


def _gated(w: walk._Walk, x: walk._T, reg: walk.Regime) -> walk._T:
    """gate.tanh() * x: the product saves x for the gate's gradient (a trained gate); the
    (1,)-shaped gate promotes a 16-bit x to its own dtype, the stream's."""
    if reg.base_trainable:
        w.save(x)
    return w.new(x.elems, max(x.nbytes, reg.residual))


def layer_bytes(shape, reg: walk.Regime, targets: frozenset[str], grad: bool = True) -> int:
    """Bytes a cross-attention layer saves per text token: the norms, q_proj and q_norm,
    sdpa's query, output and log-sum-exp, o_proj, the attention gate's input, the MLP (as a
    self-attention layer's), the text-row mask's product (its mask, per token, the same
    tensor for every layer: counted here) and the MLP gate's input."""
    w = walk._Walk()
    h, i = shape.hidden, shape.intermediate
    x = w.new(h, reg.residual)
    y = walk._norm(w, x, 1, reg, reg.base_trainable, grad)
    q = walk._linear(w, y, shape.q_dim, reg, "q_proj" in targets, grad)
    q = walk._norm(w, q, shape.heads, reg, reg.base_trainable)
    c = reg.compute if reg.autocast else q.nbytes
    w.save(w.cast(q, c))
    out = w.new(shape.q_dim, c)  # eager's scores are per key: image_bytes counts them
    if reg.attention != "eager":  # sdpa's output and log-sum-exp
        w.save(out, w.new(shape.heads, 4))
    o = walk._linear(w, out, h, reg, "o_proj" in targets)
    x2 = w.new(h, max(reg.residual, _gated(w, o, reg).nbytes))
    y2 = walk._norm(w, x2, 1, reg, reg.base_trainable)
    g = walk._linear(w, y2, i, reg, "gate_proj" in targets)
    u = walk._linear(w, y2, i, reg, "up_proj" in targets)
    a = w.new(i, g.nbytes)
    w.save(g, u) if reg.liger else w.save(g, a, u)
    d = walk._linear(w, w.new(i, max(a.nbytes, u.nbytes)), h, reg, "down_proj" in targets)
    w.save(w.new(1, reg.residual))  # full_text_row_masked_out_mask * d saves the mask
    _gated(w, w.new(h, max(d.nbytes, reg.residual)), reg)
    return w.total


def image_bytes(shape, reg: walk.Regime, layer_targets: list[frozenset[str]], seq: int,
                checkpointing: bool, grad: bool) -> int:
    """Bytes the cross-attention layers save per image of a row (of seq text tokens): the
    vision states (keys per image: shape.vision.vision_keys) through every layer's k_proj,
    v_proj and k_norm (one input tensor for all of them: saved once), the keys and values
    sdpa keeps (repeated to every query head: transformers repeats them where there is a
    mask), eager's scores, and the cross-attention mask. With activation checkpointing the
    layers keep their inputs (the vision states and the mask, once) and one recomputed
    layer. grad: whether the vision states require grad (a trained tower or projector)."""
    keys = shape.vision.vision_keys
    layers = [n for n in shape.cross_layers if n < shape.layers]
    w = walk._Walk()
    states = w.new(shape.hidden, reg.compute if reg.autocast else reg.residual)
    mask = w.new(seq, reg.residual)  # per vision key: the text tokens' mask entries
    per_layer = []
    for n in layers:
        before = w.total
        targets = layer_targets[n]
        k = walk._linear(w, states, shape.kv_dim, reg, "k_proj" in targets, grad)
        v = walk._linear(w, states, shape.kv_dim, reg, "v_proj" in targets, grad)
        k = walk._norm(w, k, shape.kv_heads, reg, reg.base_trainable)
        c = reg.compute if reg.autocast else k.nbytes
        if shape.kv_heads != shape.heads:  # repeat_kv copies them per query head
            k, v = w.new(shape.q_dim, k.nbytes), w.new(shape.q_dim, v.nbytes)
        w.save(w.cast(k, c), w.cast(v, c))
        if reg.attention == "eager":  # the fp32 softmax and its cast, per head and token
            w.save(w.new(shape.heads * seq, 4), w.new(shape.heads * seq, c))
        else:
            w.save(w.cast(mask, c))
        per_layer.append(w.total - before)
    if not checkpointing:
        return keys * w.total
    kept = states.elems * states.nbytes + (seq * reg.residual if reg.attention != "eager" else 0)
    return keys * (kept + max(per_layer, default=0))
