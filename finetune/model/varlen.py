"""`finetune_varlen`: attention for flattened batches without a dense mask.

A padding-free or packed sft batch is one row of several sequences whose position_ids
restart at each sequence. Under sdpa, transformers turns that into a (tokens x tokens)
block mask, and sdpa with a mask runs no flash kernel (../docs/benchmarks.md). Here the
sequence boundaries become cu_seqlens for PyTorch's own flash varlen kernel
(torch.nn.attention.varlen.varlen_attn), registered through transformers' public
AttentionInterface, so models select it with attn_implementation="finetune_varlen".

Where that kernel cannot run (CPU, fp32) the same glue calls a reference kernel with the
same signature: sdpa per sequence. Inputs the varlen path does not cover (a padding mask,
cached decoding with fewer queries than keys, attention dropout, which the flash varlen
kernel lacks, or a bidirectional model) go to transformers' sdpa with the equivalent
dense mask, so the function is correct for every call a model makes.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import flash_attention_mask

from finetune.config.attention import VARLEN

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None
_KERNEL_GQA = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters


def register() -> None:
    """Make `finetune_varlen` selectable. Its mask function is flash attention's: None
    when nothing is padded, else the 2D padding mask (never a dense one)."""
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


# The boundaries of the batch in flight: every layer of one forward gets the same
# position_ids tensor, so they (and the one host sync for the longest sequence) are
# computed once per forward.
_segments: tuple[torch.Tensor, tuple, tuple] | None = None


def segments(position_ids: torch.Tensor | None, batch: int, length: int,
             device: torch.device) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32, longest) of a (batch, length) batch flattened row after row: a
    sequence starts at each row and wherever the position does not follow the previous one
    (the rule transformers' sdpa mask applies to packed position_ids)."""
    global _segments
    key = (batch, length)
    if position_ids is not None and _segments is not None and \
            _segments[0] is position_ids and _segments[1] == key:
        return _segments[2]
    starts = torch.zeros(batch, length, dtype=torch.bool, device=device)
    starts[:, 0] = True
    if position_ids is not None:
        pos = position_ids.expand(batch, length)
        starts[:, 1:] |= pos[:, 1:] != pos[:, :-1] + 1
    index = starts.reshape(-1).nonzero().flatten()
    total = torch.tensor([batch * length], device=device)
    cu = torch.cat([index, total]).to(torch.int32)
    result = (cu, int(cu.diff().max()))
    if position_ids is not None:
        _segments = (position_ids, key, result)
    return result


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
    cu, longest = segments(kwargs.get("position_ids"), batch, n_q, query.device)
    flat = [t.transpose(1, 2).reshape(batch * n_q, t.shape[1], dim) for t in (query, key, value)]
    dtype = query.dtype
    if query.is_cuda and dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")  # projections promoted to fp32 by RoPE
    kernel_ok = varlen_attn is not None and query.is_cuda and dtype in (torch.float16,
                                                                         torch.bfloat16)
    kernel, gqa = (varlen_attn, _KERNEL_GQA) if kernel_ok else (reference_kernel, True)
    q, k, v = (t.to(dtype) for t in flat)
    if heads != k.shape[1] and not gqa:  # older torch: repeat the kv heads instead
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    window = (sliding_window - 1 if sliding_window else -1, 0)
    extra = {"enable_gqa": heads != k.shape[1]} if gqa else {}
    out = kernel(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=window, **extra)
    return out.reshape(batch, n_q, heads, dim), None


def _dense(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
           causal, **kwargs):
    """transformers' sdpa with the mask these inputs mean: padding (2D), causal aligned to
    the newest key, the sliding window, and sequence boundaries from position_ids."""
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
        elif n_q == n_k and kwargs.get("position_ids") is not None:
            cu, _ = segments(kwargs["position_ids"], batch, n_q, query.device)
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
