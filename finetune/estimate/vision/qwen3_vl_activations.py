"""What one image saves for the backward in Qwen3-VL's vision tower and mergers (an
estimate, walked op by op with activations.py's dtype rules).

Qwen2-VL's walk (qwen2_vl_activations.py) counts most of it unchanged: the pixels, the
patch convolution's 16-bit input, the rotary cos/sin, every block (LayerNorms, fused
qkv, rotary q/k, sdpa, and the GELU-tanh MLP's fc1 output, all its activation saves) and
the merger (a LayerNorm per patch, then Linear, GELU, Linear per token: Qwen2-VL's).
Qwen3-VL adds:
- the learned position embeddings: pos_embed reads 4 grid positions a patch (bilinear
  interpolation) and weighs them, so with a trained tower the embedding saves its int64
  indices and the product its fp32 weights; the sum is cast to the stream's dtype and
  added (nothing saved), so the stream is the convolution's, 16-bit under autocast;
- a deepstack merger per deepstack block: a LayerNorm over each merged group of patches
  (the block's output viewed merge x merge patches a row: its input is the tensor the
  next block's norm, or the merger, saves already, unless the norm casts it, as CUDA's
  autocast does) and the merger's MLP per token.

The language model adds the deepstack features to the image tokens' hidden states after
its first layers (Qwen3VLTextModel._deepstack_process: a clone, a boolean-mask gather and
scatter). Those save only the mask's int64 indices, a few bytes per image token and
layer, beside the kilobytes a decoder layer saves per token: not counted.
"""

from __future__ import annotations

from dataclasses import replace

from finetune.estimate import walk
from finetune.estimate.vision import qwen2_vl_activations
from finetune.estimate.vision.common import (Training, activation_saves, layer_norm_saves,
                                             stream_bytes)

TAPS = 4  # bilinear interpolation: the 2x2 learned positions around a patch's


def position_bytes(v) -> int:
    """Bytes pos_embed's interpolation saves per image (a trained tower's): the int64
    indices the embedding reads and the fp32 weights their rows are multiplied by."""
    return v.positions * TAPS * (8 + 4)


def deepstack_bytes(v, reg: walk.Regime, training: Training, block: int) -> int:
    """Bytes one deepstack merger saves per image: its LayerNorm's over each merged group
    (the input only where no one else keeps it: the blocks save nothing under a frozen
    tower), then Linear, GELU, Linear."""
    # the mergers are part of the tower: LoRA'd or frozen with it, as the merger
    reg = replace(reg, base_trainable=training.projector and reg.tower == "trained")
    w = walk._Walk()
    group = w.new(v.hidden * v.merge ** 2, stream_bytes(reg))
    normed = layer_norm_saves(w, group, reg)
    if training.tower or block == v.layers - 1:  # the next block's input, or the merger's
        w.saved.pop(group.ident, None)
    first = walk._linear(w, normed, group.elems, reg, False)
    walk._linear(w, activation_saves(w, first, "gelu"), v.out_hidden, reg, False)
    return v.image_tokens * w.total


def image_bytes(v, reg: walk.Regime, checkpointing: bool,
                training: Training = Training()) -> int:
    """Bytes one image keeps from the forward to the backward: Qwen2-VL's tower and merger
    (with checkpointing every block's input and one recomputed block), the position
    embeddings' interpolation, and the deepstack mergers whose features the language
    model reads. A frozen tower saves nothing; frozen mergers only what the tower's
    gradient needs."""
    total = qwen2_vl_activations.image_bytes(v, reg, checkpointing, training)
    if not training.tower and not training.projector:
        return total
    if training.tower and reg.for_tower().base_trainable:
        total += position_bytes(v)
    return total + sum(deepstack_bytes(v, reg, training, block) for block in v.fed)
