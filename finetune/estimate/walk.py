"""The walk that activations.py (a decoder layer) and vision/ (towers and projectors) share:
a regime of dtypes, tensors tracked by identity, and what norms and linears save for the
backward (see activations.py for the rules)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import count


@dataclass(frozen=True)
class Regime:
    residual: int          # bytes of the residual stream, embeddings and norm weights
    compute: int           # bytes of matmul inputs/outputs
    autocast: bool
    base_trainable: bool   # full fine-tuning: the layer weights get gradients
    quantized: int         # 4 or 8: bitsandbytes base linears (4-bit returns the input's dtype)
    adapter: int = 0       # bytes of LoRA weights (0: no LoRA)
    rank: int = 0
    dropout: bool = False
    dora: bool = False
    cuda: bool = True      # CUDA: bool dropout masks, and peft's autocast test sees autocast
    attention: str = "sdpa"
    mask_keys: int = 0     # key positions per query in the mask sdpa/eager keeps (0: none)
    liger: bool = False    # use_liger_kernel: Liger's RMSNorm and SwiGLU save less
    # A vision tower's weights on the gradient path: trained, or lora (an adapter on every
    # linear, the base frozen); a frozen tower is on none (vision_peft.tower_weights)
    tower: str = "trained"

    def for_tower(self) -> "Regime":
        """The regime of a tower's own layers."""
        return replace(self, base_trainable=self.tower == "trained")

    def for_projector(self, trains: bool) -> "Regime":
        return replace(self, base_trainable=trains, tower="trained")


@dataclass(frozen=True)
class _T:
    elems: int   # per token
    nbytes: int  # per element
    ident: int   # which tensor: ops that save the same one save it once


class _Walk:
    def __init__(self) -> None:
        self.saved: dict[int, int] = {}
        self._ids = count()

    def new(self, elems: int, nbytes: int) -> _T:
        return _T(elems, nbytes, next(self._ids))

    def save(self, *tensors: _T) -> None:
        for t in tensors:
            self.saved[t.ident] = t.elems * t.nbytes

    def cast(self, t: _T, nbytes: int) -> _T:
        return t if t.nbytes == nbytes else self.new(t.elems, nbytes)

    @property
    def total(self) -> int:
        return sum(self.saved.values())


def _norm(w: _Walk, x: _T, rows: int, reg: Regime, trainable: bool, grad: bool = True) -> _T:
    """RMSNorm: x.float(), x * rsqrt(mean(x^2) + eps), weight * that.to(x.dtype).
    grad: whether x requires grad (not so for the first layer's input under LoRA)."""
    xf = w.cast(x, 4)
    if grad:
        w.save(xf, w.new(rows, 4))  # the fp32 input and one rsqrt per row
    normed = w.cast(w.new(x.elems, 4), x.nbytes)
    if trainable and not reg.liger:  # Liger's kernel saves only x and the rsqrt per row
        w.save(normed)
    return w.new(x.elems, max(x.nbytes, reg.residual))


def _gemma_norm(w: _Walk, x: _T, rows: int, trainable: bool, grad: bool = True) -> _T:
    """Gemma's RMSNorm: x.float() * rsqrt(mean(x^2) + eps), times (1 + weight) in fp32, cast
    back to x's dtype: saves the fp32 input and one rsqrt per row, and the fp32 normed
    value for the weight's gradient."""
    xf = w.cast(x, 4)
    if grad:
        w.save(xf, w.new(rows, 4))
    if trainable:
        w.save(w.new(x.elems, 4))
    return w.new(x.elems, x.nbytes)


def _linear(w: _Walk, x: _T, out: int, reg: Regime, lora: bool, grad: bool = True) -> _T:
    lora = lora or reg.tower == "lora"
    if reg.base_trainable:
        w.save(w.cast(x, reg.compute) if reg.autocast else x)
    if reg.quantized == 4:
        result = w.new(out, x.nbytes)  # Linear4bit casts its output back to the input dtype
    else:
        result = w.new(out, reg.compute if reg.autocast else x.nbytes)
    if lora:
        # peft casts x to the adapter dtype, except on quantized layers when it sees CUDA
        # autocast on (torch.is_autocast_enabled() asks about CUDA).
        skip = bool(reg.quantized) and reg.autocast and reg.cuda
        xa = x if skip else w.cast(x, reg.adapter)
        if reg.dropout:
            if grad:  # the mask: bool on CUDA, the input's dtype on the CPU
                w.save(w.new(x.elems, 1 if reg.cuda else xa.nbytes))
            xa = w.new(x.elems, xa.nbytes)
        a_in = w.cast(xa, reg.compute) if reg.autocast else xa
        mid = reg.compute if reg.autocast else xa.nbytes
        w.save(a_in, w.new(reg.rank, mid))
        if reg.dora:  # approximate: DoRA also keeps the base and the adapter outputs
            w.save(w.new(out, result.nbytes), w.new(out, mid))
    return result
