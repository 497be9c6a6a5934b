"""`finetune_varlen`: attention for flattened batches without a dense mask.

A padding-free or packed sft batch is one row of several sequences whose position_ids
restart at each sequence. Under sdpa, transformers turns that into a (tokens x tokens)
block mask, and sdpa with a mask runs no flash kernel (../docs/benchmarks.md). Here the
sequence boundaries become cu_seqlens for PyTorch's own flash varlen kernel
(torch.nn.attention.varlen.varlen_attn), registered through transformers' public
AttentionInterface, so models select it with attn_implementation="finetune_varlen".

Where that kernel cannot run (CPU, fp32, a GPU older than Ampere, a sliding window on
torch 2.10) the same glue calls a reference kernel with the same signature: sdpa per
sequence. Inputs the varlen path does not cover (a padding mask,
cached decoding with fewer queries than keys, attention dropout, which the flash varlen
kernel lacks, or a bidirectional model) go to transformers' sdpa with the equivalent
dense mask, so the function is correct for every call a model makes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import flash_attention_mask

from finetune.config.derived.attention import VARLEN
from finetune.config.derived.kernels import FLASH_CAPABILITY

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None


@dataclass(frozen=True)
class Kernel:
    """A varlen kernel and what it takes. torch's flash kernel runs 16-bit tensors on GPUs
    of compute capability 8.0 or newer, and its signature moved: 2.10's takes is_causal
    and no scale, window_size or enable_gqa; later ones take window_size and scale, and
    then enable_gqa. `call` passes what this one takes; the reference takes everything."""
    fn: Callable
    parameters: frozenset[str]
    device_type: str | None = "cuda"   # None: any device
    dtypes: tuple[torch.dtype, ...] | None = (torch.float16, torch.bfloat16)  # None: any

    @classmethod
    def of(cls, fn: Callable, **kwargs) -> "Kernel":
        return cls(fn, frozenset(inspect.signature(fn).parameters), **kwargs)

    def runs(self, query: torch.Tensor, dtype: torch.dtype, window: tuple[int, int]) -> bool:
        """This kernel computes these inputs (a sliding window needs window_size)."""
        if self.dtypes is not None and dtype not in self.dtypes:
            return False
        if window != (-1, 0) and "window_size" not in self.parameters:
            return False
        if self.device_type is None:
            return True
        if query.device.type != self.device_type:
            return False
        return self.device_type != "cuda" or query.device.index in flash_devices()

    def call(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float | None,
             window: tuple[int, int]) -> torch.Tensor:
        kwargs: dict = {}
        if "window_size" in self.parameters:
            kwargs["window_size"] = window
        else:  # torch 2.10: causal without a window (runs() refused a window)
            kwargs["is_causal"] = True
        if "scale" in self.parameters:
            kwargs["scale"] = scale
        elif scale is not None:  # the kernel scales by 1/sqrt(dim): fold ours into q
            q = q * (scale * q.shape[-1] ** 0.5)
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in self.parameters:
                kwargs["enable_gqa"] = True
            else:  # repeat each kv head for its group of query heads
                group = q.shape[1] // k.shape[1]
                k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        return self.fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


# The CUDA devices whose capability runs torch's flash kernel, read once, outside any
# compiled region (register() runs before the model is built).
_flash_devices: frozenset[int] | None = None


def flash_devices() -> frozenset[int]:
    global _flash_devices
    if _flash_devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        _flash_devices = frozenset(i for i in range(count)
                                   if torch.cuda.get_device_capability(i) >= FLASH_CAPABILITY)
    return _flash_devices


def register() -> None:
    """Make `finetune_varlen` selectable. Its mask function is flash attention's: None
    when nothing is padded, else the 2D padding mask (never a dense one)."""
    flash_devices()
    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, flash_attention_mask)


def reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                     window_size=(-1, -1), enable_gqa=False):
    """varlen_attn's contract on any device: (tokens, heads, dim) inputs, one sdpa per
    sequence, a query attending to keys within window_size of the bottom-right-aligned
    diagonal (-1: unbounded)."""
    outputs = []
    for i in range(len(cu_seq_q) - 1):
        q = query[cu_seq_q[i]:cu_seq_q[i + 1]].transpose(0, 1)
        k = key[cu_seq_k[i]:cu_seq_k[i + 1]].transpose(0, 1)
        v = value[cu_seq_k[i]:cu_seq_k[i + 1]].transpose(0, 1)
        allowed = _window(q.shape[1], k.shape[1], window_size, q.device)
        outputs.append(F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=enable_gqa).transpose(0, 1))
    return torch.cat(outputs)


# torch's kernel where it runs, else the reference: the kernels tried in order.
KERNELS = tuple([Kernel.of(varlen_attn)] if varlen_attn is not None else []) + \
    (Kernel.of(reference_kernel, device_type=None, dtypes=None),)


def _window(n_q: int, n_k: int, window_size, device) -> torch.Tensor:
    """(n_q, n_k) booleans: key j is visible to query i (bottom-right aligned)."""
    left, right = window_size
    i = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)
    j = torch.arange(n_k, device=device)[None, :]
    allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if right >= 0:
        allowed &= j <= i + right
    if left >= 0:
        allowed &= j >= i - left
    return allowed


def boundaries(kwargs: dict, batch: int, length: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(cu_seqlens of queries, of keys, longest query, longest key) of a (batch, length)
    batch flattened row after row. A padding-free batch from TRL's collator carries them
    (cu_seq_lens_q/k, max_length_q/k as ints, computed on the CPU): used as given, with no
    host sync and nothing for a compiled graph to break on, whether or not the model
    passes position_ids down. Else they are read from position_ids: a sequence starts at
    each row and wherever the position does not follow the previous one (the rule
    transformers' sdpa mask applies to packed position_ids)."""
    cu_q, max_q = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if batch == 1 and cu_q is not None and max_q is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        max_k = kwargs.get("max_length_k")
        cu_q = cu_q.to(device=device, dtype=torch.int32)
        cu_k = cu_q if cu_k is None else cu_k.to(device=device, dtype=torch.int32)
        return cu_q, cu_k, int(max_q), int(max_q if max_k is None else max_k)
    starts = torch.zeros(batch, length, dtype=torch.bool, device=device)
    starts[:, 0] = True
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        pos = position_ids.expand(batch, length)
        starts[:, 1:] |= pos[:, 1:] != pos[:, :-1] + 1
    index = starts.reshape(-1).nonzero().flatten()
    total = torch.tensor([batch * length], device=device)
    cu = torch.cat([index, total]).to(torch.int32)
    longest = int(cu.diff().max())
    return cu, cu, longest, longest


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, softcap: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """An AttentionInterface function: query (batch, heads, q_len, dim), key and value
    (batch, kv_heads, kv_len, dim); returns (batch, q_len, heads, dim)."""
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"{VARLEN} does not support attention logit softcapping or "
                         "attention sinks; set model.attn_implementation: eager")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    batch, heads, n_q, dim = query.shape
    n_k = key.shape[2]
    if attention_mask is not None or n_q != n_k or dropout > 0 or not causal:
        return _dense(module, query, key, value, attention_mask, dropout, scaling,
                      sliding_window, causal, **kwargs)
    cu_q, cu_k, max_q, max_k = boundaries(kwargs, batch, n_q, query.device)
    dtype = query.dtype
    if query.is_cuda and dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")  # projections promoted to fp32 by RoPE
    window = (sliding_window - 1 if sliding_window else -1, 0)
    kernel = next(k for k in KERNELS if k.runs(query, dtype, window))
    q, k, v = (t.transpose(1, 2).reshape(batch * n_q, t.shape[1], dim).to(dtype)
               for t in (query, key, value))
    out = kernel.call(q, k, v, cu_q, cu_k, max_q, max_k, scaling, window)
    return out.reshape(batch, n_q, heads, dim), None


def _dense(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
           causal, **kwargs):
    """transformers' sdpa with the mask these inputs mean: padding (2D), causal aligned to
    the newest key, the sliding window, and sequence boundaries (boundaries())."""
    batch, _, n_q, _ = query.shape
    n_k = key.shape[2]
    if attention_mask is not None and attention_mask.dim() == 4:  # a caller's own mask
        mask = attention_mask
    else:
        left = sliding_window - 1 if sliding_window else -1
        mask = _window(n_q, n_k, (left, 0 if causal else -1), query.device)
        mask = mask.expand(batch, 1, n_q, n_k)
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, -n_k:].bool()
        elif n_q == n_k and ("position_ids" in kwargs or "cu_seq_lens_q" in kwargs):
            cu, _, _, _ = boundaries(kwargs, batch, n_q, query.device)
            owner = torch.zeros(batch * n_q, dtype=torch.long, device=query.device)
            owner[cu[1:-1].long()] = 1
            owner = owner.cumsum(0).view(batch, n_q)
            mask = mask & (owner[:, None, :, None] == owner[:, None, None, :])
        # A query that may see no key (a left-padding position) sees all instead: its
        # output is never used, and a fully masked row would make NaNs.
        mask = mask | ~mask.any(-1, keepdim=True)
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                  scaling=scaling, is_causal=False, **kwargs)
