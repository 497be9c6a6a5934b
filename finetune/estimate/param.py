"""One parameter tensor of a model, as named_parameters() yields it (shapes.py lists a
language model's, vision.py a vision tower's and projector's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    # 'embedding' (the LM's token embedding), 'norm', 'linear' (a layer's Linear weight),
    # 'bias', 'head'; a vision tower's: 'conv' (patch embedding), 'position' (class and
    # position embeddings, read without a matmul)
    role: str
    module: str  # owning module name
    out: int = 0  # output features of a Linear weight (8-bit scales are per output row)
