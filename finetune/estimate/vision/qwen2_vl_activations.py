"""What one image saves for the backward in Qwen2-VL's and Qwen2.5-VL's vision tower and
merger (an estimate, walked op by op with activations.py's dtype rules).

The patch convolution's output is the tower's stream: 16-bit under autocast (unlike
CLIP's, no fp32 position embedding is added), so every block's input and residual are.
A block saves: the norm's saves (LayerNorm, or Qwen2.5-VL's RMSNorm: fp32 input, rstd
and the normed value for its weight), the fused qkv projection's input and its whole
output (v is a view of it), the rotary q and k (cast back to the stream's dtype),
sdpa's output and log-sum-exp per head, the output projection's input (the heads'
outputs concatenated: a copy), then the MLP's (quick-GELU: fc1's output and its sigmoid;
gated SiLU: gate, its SiLU and up). The rotary cos and sin (fp32, head_dim per patch) are
computed once and saved by every block: counted once. The merger normalises each patch
and runs its MLP (Linear, GELU, Linear) over each merge x merge group.
"""

from __future__ import annotations

from dataclasses import replace

from finetune.estimate import walk
from finetune.estimate.vision.common import (PIXEL_BYTES, Training, activation_saves,
                                             layer_norm_saves, stream_bytes)


def _norm(w: walk._Walk, x: walk._T, v, reg: walk.Regime) -> walk._T:
    if v.qwen25:  # Qwen2_5_VLRMSNorm: as the decoder's RMSNorm
        return walk._norm(w, x, 1, reg, reg.base_trainable)
    return layer_norm_saves(w, x, reg)


def block_bytes(v, reg: walk.Regime, block: int) -> int:
    """Bytes one vision block saves per patch."""
    w = walk._Walk()
    h, i = v.hidden, v.intermediate
    x = w.new(h, stream_bytes(reg))
    y = _norm(w, x, v, reg)
    qkv = walk._linear(w, y, 3 * h, reg, False)
    c = qkv.nbytes
    w.save(qkv)                                         # v is a view of the fused output
    w.save(w.new(h, c), w.new(h, c))                    # rotary q and k, cast back
    if reg.attention == "eager":  # fp32 softmax and its cast, per head and key
        keys = v.window_positions(block)
        w.save(w.new(v.heads * keys, 4), w.new(v.heads * keys, c))
    else:
        w.save(w.new(h, c), w.new(v.heads, 4))          # sdpa's output and log-sum-exp
    out = w.new(h, c)                                   # the heads' outputs, concatenated
    o = walk._linear(w, out, h, reg, False)
    x2 = w.new(h, max(x.nbytes, o.nbytes))
    y2 = _norm(w, x2, v, reg)
    if v.qwen25:  # down(silu(gate(y)) * up(y)): silu saves gate, the product both factors
        g = walk._linear(w, y2, i, reg, False)
        u = walk._linear(w, y2, i, reg, False)
        a = w.new(i, g.nbytes)
        w.save(g, a, u)
        walk._linear(w, w.new(i, max(a.nbytes, u.nbytes)), h, reg, False)
    else:
        f = walk._linear(w, y2, i, reg, False)
        walk._linear(w, activation_saves(w, f, v.act), h, reg, False)
    return w.total


def merger_bytes(v, reg: walk.Regime, training: Training) -> int:
    """Bytes the merger saves per image: its norm per patch, its MLP per token."""
    reg = replace(reg, base_trainable=training.projector)
    w = walk._Walk()
    x = w.new(v.hidden, stream_bytes(reg))
    if v.qwen25:  # with a frozen tower only the normed value, for the weight's gradient
        walk._norm(w, x, 1, reg, training.projector, grad=training.tower)
    else:
        layer_norm_saves(w, x, reg)
    per_patch = w.total
    w = walk._Walk()
    merged = w.new(v.hidden * v.merge ** 2, 4 if reg.autocast else x.nbytes)
    first = walk._linear(w, merged, merged.elems, reg, False)
    hidden = activation_saves(w, first, "gelu")
    walk._linear(w, hidden, v.out_hidden, reg, False)
    # Qwen2.5-VL: the int64 indices that order the groups back from the windows, and
    # (for a trained tower's gradient) into them
    per_token = w.total + ((16 if training.tower else 8) if v.qwen25 else 0)
    return v.positions * per_patch + v.image_tokens * per_token


def image_bytes(v, reg: walk.Regime, checkpointing: bool,
                training: Training = Training()) -> int:
    """Bytes one image keeps from the forward to the backward: its pixels, the patch
    convolution's 16-bit input, the rotary cos/sin, every block (with checkpointing its
    input and one recomputed block), and the merger's. A frozen tower saves nothing; a
    frozen merger saves only what the tower's gradient needs."""
    pixels = v.positions * v.patch_values
    total = pixels * PIXEL_BYTES                        # the batch's pixel_values
    if not training.tower and not training.projector:
        return total
    if training.tower:
        tower = replace(reg, base_trainable=True)
        if tower.autocast or tower.residual != PIXEL_BYTES:
            total += pixels * tower.compute             # the convolution's 16-bit input
        total += v.positions * 2 * v.head_dim * 4       # rotary cos and sin, fp32
        blocks = [block_bytes(v, tower, n) for n in range(v.layers)]
        if checkpointing:
            kept = v.layers * v.hidden * stream_bytes(tower) + max(blocks)
        else:
            kept = sum(blocks)
        total += v.positions * kept
    return total + merger_bytes(v, reg, training)
