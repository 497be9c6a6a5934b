"""Activation memory of a vision-language model's images: what the vision tower and the
projector save for the backward pass, per image (an estimate, walked op by op in the
same way and with the same dtype rules as activations.py walks a decoder layer).

LLaVA's CLIP tower (transformers models/clip): a patch convolution over the fp32
pixel_values, class + position embeddings, a pre-LayerNorm, then encoder layers of
LayerNorm, q/k/v/out projections with biases, unmasked attention, LayerNorm and a
fc1/activation/fc2 MLP; the selected hidden states go through the projector's linear_1,
activation and linear_2. Layers past the deepest feature layer run, but nothing reads
their output, so their graph is freed when the forward returns.
"""

from __future__ import annotations

from finetune.estimate import activations as act
from finetune.estimate.vision import PIXEL_BYTES, VisionShape


def _layer_norm_saves(w: act._Walk, x: act._T, reg: act.Regime) -> act._T:
    """LayerNorm saves its input (autocast runs it in fp32: a 16-bit input is cast) and a
    mean and rstd per row; its output is fp32 under autocast, else the input's dtype."""
    xf = w.cast(x, 4) if reg.autocast else x
    w.save(xf, w.new(2, 4))
    return w.new(x.elems, 4 if reg.autocast else x.nbytes)


def _activation_saves(w: act._Walk, x: act._T, name: str) -> act._T:
    """quick_gelu is x * sigmoid(1.702 x): the product saves x and the sigmoid (which the
    sigmoid's own backward reads too); gelu and its tanh form save their input."""
    w.save(x)
    if name == "quick_gelu":
        w.save(w.new(x.elems, x.nbytes))
    return w.new(x.elems, x.nbytes)


def encoder_layer_bytes(v: VisionShape, reg: act.Regime) -> int:
    """Bytes one CLIP encoder layer saves per position (the ops in order, as activations.py
    walks a decoder layer). No mask and no rotary embedding: q, k and v keep their dtype."""
    w = act._Walk()
    h = v.hidden
    x = w.new(h, reg.residual)
    y = _layer_norm_saves(w, x, reg)
    q, k, val = (act._linear(w, y, h, reg, False) for _ in range(3))
    w.save(q, k, val)
    out = w.new(h, q.nbytes)
    if reg.attention == "eager":  # the softmax (fp32) and its cast back, per head and key
        w.save(w.new(v.heads * v.positions, 4), w.new(v.heads * v.positions, q.nbytes))
    else:  # sdpa's kernels: the output and a log-sum-exp per head
        w.save(out, w.new(v.heads, 4))
    o = act._linear(w, out, h, reg, False)
    x2 = w.new(h, max(reg.residual, o.nbytes))
    y2 = _layer_norm_saves(w, x2, reg)
    f = act._linear(w, y2, v.intermediate, reg, False)
    a = _activation_saves(w, f, v.act)
    act._linear(w, a, h, reg, False)
    return w.total


def image_bytes(v: VisionShape, reg: act.Regime, checkpointing: bool) -> int:
    """Bytes one image keeps from the forward to the backward: its pixels, the patch
    embedding's and pre-norm's saves, the encoder layers that reach the loss (with
    checkpointing their inputs and one recomputed layer) and the projector's."""
    pixels = v.channels * v.image_size ** 2
    total = pixels * PIXEL_BYTES            # the batch's pixel_values
    if reg.autocast or reg.residual != PIXEL_BYTES:
        total += pixels * reg.compute       # the 16-bit cast the patch convolution saves
    w = act._Walk()
    _layer_norm_saves(w, w.new(v.hidden, reg.residual), reg)  # pre_layrnorm
    layer = encoder_layer_bytes(v, reg)
    kept = v.layers_kept
    if checkpointing:
        layers = kept * v.hidden * reg.residual + (layer if kept else 0)
    else:
        layers = kept * layer
    total += v.positions * (w.total + layers)
    w = act._Walk()
    features = w.new(v.hidden * len(v.feature_layers), reg.residual)
    first = act._linear(w, features, v.text_hidden, reg, False)
    hidden = _activation_saves(w, first, v.projector_act)
    act._linear(w, hidden, v.text_hidden, reg, False)
    return total + v.image_tokens * w.total
