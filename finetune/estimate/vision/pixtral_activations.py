"""What one image saves for the backward in Mistral 3's Pixtral tower and projector (an
estimate, walked op by op with activations.py's dtype rules).

The patch convolution's output (16-bit under autocast) goes through ln_pre, an RMSNorm
whose weight brings the stream back to the weights' dtype. A layer: RMSNorm, q/k/v
projections without bias, rotary q and k (q * cos + rotate_half(q) * sin: the products
save only cos and sin, which every layer shares, and promote q and k to the stream's
dtype), attention, o_proj over the heads' outputs (sdpa's output as it lies; eager's
transposed copy), the residual, RMSNorm and a gated MLP (gate, its activation, up, down).
Under sdpa the tower gives a block mask over the batch's patches (in the stream's dtype;
nothing saves it), which autocast casts to 16 bits for every layer's call, and sdpa
saves that cast: a key's worth a patch and layer; a flash kernel takes none. The projector
RMS-normalises each patch, unfolds 2x2 groups into one token and runs merging_layer,
linear_1, GELU and linear_2.
"""

from __future__ import annotations

from finetune.estimate import walk
from finetune.estimate.vision.common import PIXEL_BYTES, Training, activation_saves


def layer_bytes(v, reg: walk.Regime) -> int:
    """Bytes one tower layer saves per patch."""
    w = walk._Walk()
    h, i = v.hidden, v.intermediate
    x = w.new(h, reg.residual)
    y = walk._norm(w, x, 1, reg, reg.base_trainable)
    q, k, val = (walk._linear(w, y, h, reg, False) for _ in range(3))
    c = reg.compute if reg.autocast else val.nbytes
    rotated = max(q.nbytes, reg.residual)            # times the stream-dtype cos and sin
    w.save(w.cast(w.new(h, rotated), c), w.cast(w.new(h, rotated), c), w.cast(val, c))
    out = w.new(h, c)
    if reg.attention == "eager":  # fp32 softmax and its cast, per head and key
        w.save(w.new(v.heads * v.positions, 4), w.new(v.heads * v.positions, c))
    else:  # sdpa's output (o_proj reads it as it lies) and log-sum-exp
        w.save(out, w.new(v.heads, 4))
        if reg.attention == "sdpa":                 # the mask's 16-bit cast, a key each
            w.save(w.new(v.positions, c))
    o = walk._linear(w, out, h, reg, False)
    x2 = w.new(h, max(x.nbytes, o.nbytes))
    y2 = walk._norm(w, x2, 1, reg, reg.base_trainable)
    g = walk._linear(w, y2, i, reg, False)
    u = walk._linear(w, y2, i, reg, False)
    a = w.new(i, g.nbytes)
    w.save(g, a, u)                                 # act(gate) saves gate; the product both
    walk._linear(w, w.new(i, max(a.nbytes, u.nbytes)), h, reg, False)
    return w.total


def projector_bytes(v, reg: walk.Regime, training: Training) -> int:
    """Bytes the projector saves per image: its norm per patch, the rest per token."""
    projector = reg.for_projector(training.projector)
    w = walk._Walk()
    x = w.new(v.hidden, reg.residual)
    walk._norm(w, x, 1, projector, training.projector, grad=training.tower)
    per_patch = w.total
    w = walk._Walk()
    merged = walk._linear(w, w.new(v.hidden * v.merge ** 2, reg.residual), v.hidden,
                          projector, False)
    first = walk._linear(w, merged, v.text_hidden, projector, False)
    walk._linear(w, activation_saves(w, first, v.projector_act), v.text_hidden, projector,
                 False)
    return v.positions * per_patch + v.features * w.total


def image_bytes(v, reg: walk.Regime, checkpointing: bool,
                training: Training = Training()) -> int:
    """Bytes one image keeps from the forward to the backward: its pixels, the
    convolution's 16-bit input, ln_pre's saves, the rotary cos/sin,
    the layers that reach the loss (with checkpointing their inputs and one recomputed
    layer) and the projector's. A frozen tower saves nothing; a frozen projector only
    what the tower's gradient needs."""
    width, height = v.resized
    pixels = v.channels * width * height
    total = pixels * PIXEL_BYTES                    # the batch's pixel_values
    if not training.tower and not training.projector:
        return total
    if training.tower:
        tower = reg.for_tower()
        if tower.base_trainable and (tower.autocast or tower.residual != PIXEL_BYTES):
            total += pixels * tower.compute         # the convolution's 16-bit input
        w = walk._Walk()
        conv = w.new(v.hidden, tower.compute if tower.autocast else tower.residual)
        walk._norm(w, conv, 1, tower, tower.base_trainable)   # ln_pre
        total += v.positions * (w.total + 2 * v.head_dim * tower.residual)  # + cos, sin
        layer = layer_bytes(v, tower)
        kept = v.layers_kept
        if checkpointing:  # each layer's inputs: its stream, and the block mask they share
            layers = kept * v.hidden * tower.residual + (layer if kept else 0)
            if kept and tower.attention == "sdpa":
                total += v.positions ** 2 * tower.residual
        else:
            layers = kept * layer
        total += v.positions * layers
    return total + projector_bytes(v, reg, training)
