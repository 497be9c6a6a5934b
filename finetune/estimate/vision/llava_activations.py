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

from dataclasses import replace

from finetune.estimate import walk
from finetune.estimate.vision.common import (PIXEL_BYTES, Training, activation_saves,
                                             layer_norm_saves)


def encoder_layer_bytes(v, reg: walk.Regime) -> int:
    """Bytes one CLIP encoder layer saves per position (the ops in order, as activations.py
    walks a decoder layer). No mask and no rotary embedding: q, k and v keep their dtype."""
    w = walk._Walk()
    h = v.hidden
    x = w.new(h, reg.residual)
    y = layer_norm_saves(w, x, reg)
    q, k, val = (walk._linear(w, y, h, reg, False) for _ in range(3))
    w.save(q, k, val)
    out = w.new(h, q.nbytes)
    if reg.attention == "eager":  # the softmax (fp32) and its cast back, per head and key
        w.save(w.new(v.heads * v.positions, 4), w.new(v.heads * v.positions, q.nbytes))
    else:  # sdpa's kernels: the output and a log-sum-exp per head
        w.save(out, w.new(v.heads, 4))
    o = walk._linear(w, out, h, reg, False)
    x2 = w.new(h, max(reg.residual, o.nbytes))
    y2 = layer_norm_saves(w, x2, reg)
    f = walk._linear(w, y2, v.intermediate, reg, False)
    a = activation_saves(w, f, v.act)
    walk._linear(w, a, h, reg, False)
    return w.total


def image_bytes(v, reg: walk.Regime, checkpointing: bool,
                training: Training = Training()) -> int:
    """Bytes one image keeps from the forward to the backward: its pixels, the patch
    embedding's and pre-norm's saves, the encoder layers that reach the loss (with
    checkpointing their inputs and one recomputed layer) and the projector's. A frozen
    tower saves nothing; a frozen projector saves only what the tower's gradient needs."""
    pixels = v.channels * v.image_size ** 2
    total = pixels * PIXEL_BYTES            # the batch's pixel_values
    if training.tower:
        tower = replace(reg, base_trainable=True)
        if tower.autocast or tower.residual != PIXEL_BYTES:
            total += pixels * tower.compute  # the 16-bit cast the patch convolution saves
        w = walk._Walk()
        layer_norm_saves(w, w.new(v.hidden, tower.residual), tower)  # pre_layrnorm
        layer = encoder_layer_bytes(v, tower)
        kept = v.layers_kept
        if checkpointing:
            layers = kept * v.hidden * tower.residual + (layer if kept else 0)
        else:
            layers = kept * layer
        total += v.positions * (w.total + layers)
    elif not training.projector:
        return total
    projector = replace(reg, base_trainable=training.projector)
    w = walk._Walk()
    features = w.new(v.hidden * len(v.feature_layers), reg.residual)
    first = walk._linear(w, features, v.text_hidden, projector, False)
    hidden = activation_saves(w, first, v.projector_act)
    walk._linear(w, hidden, v.text_hidden, projector, False)
    return total + v.image_tokens * w.total
