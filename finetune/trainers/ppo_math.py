"""The arithmetic of PPO, pure torch: GAE, whitening over the global batch, the clipped
policy and value losses, and the adaptive KL controller. No model, no Trainer; unit-tested
against hand computations (tests/test_ppo.py)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def global_sum(*values: float | torch.Tensor, device=None) -> list[float]:
    """Sums over all ranks of a few scalars (one all-reduce, float64)."""
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    return _all_reduce_sum(tensor).tolist()


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens ([batch, T]; mask 1 on the
    tokens of each response, which start at column 0 and are contiguous). The value after
    a response's last token is 0. Returns (advantages, returns), 0 where mask is 0."""
    mask = mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    advantages = torch.zeros_like(values)
    last = torch.zeros_like(values[:, 0])
    length = values.shape[1]
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        advantages[:, t] = last
    return advantages, (advantages + values) * mask


def whiten(values: torch.Tensor, mask: torch.Tensor, device=None) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries of every rank together:
    mean and unbiased variance from all-reduced sums, so one process and several use the
    same formula on the same numbers."""
    mask = mask.to(values.dtype)
    total, count = global_sum(float((values * mask).sum()), float(mask.sum()), device=device)
    if count < 2:
        return values * mask
    mean = total / count
    (squares,) = global_sum(float((((values - mean) * mask) ** 2).sum()), device=device)
    variance = squares / (count - 1)
    return (values - mean) / math.sqrt(variance + 1e-8) * mask


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                        advantages: torch.Tensor, mask: torch.Tensor, cliprange: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO policy loss max(-A r, -A clip(r, 1-c, 1+c)) and whether the clipped
    term was the larger (the clip fraction's numerator), both 0 off the mask."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    mask = mask.to(logprobs.dtype)
    return torch.maximum(unclipped, clipped) * mask, (clipped > unclipped).to(mask.dtype) * mask


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, cliprange_value: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 0.5 x max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2) and whether
    the clipped term was the larger, both 0 off the mask."""
    clipped_values = torch.clamp(values, old_values - cliprange_value,
                                 old_values + cliprange_value)
    unclipped = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    mask = mask.to(values.dtype)
    return 0.5 * torch.maximum(unclipped, clipped) * mask, \
        (clipped > unclipped).to(mask.dtype) * mask


def adaptive_kl(coef: float, kl: float, target: float, horizon: int, samples: int) -> float:
    """Ziegler et al. (2019): coef x (1 + clip(KL / target - 1, -0.2, 0.2) x n / horizon)."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * samples / horizon)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       device=None) -> float:
    """1 - Var(R - V) / Var(R) over the masked entries of every rank."""
    mask = mask.to(values.dtype)
    diff = (returns - values) * mask
    ret = returns * mask
    n, s_r, s_r2, s_d, s_d2 = global_sum(float(mask.sum()), float(ret.sum()),
                                         float((ret ** 2).sum()), float(diff.sum()),
                                         float((diff ** 2).sum()), device=device)
    if n < 2:
        return float("nan")
    var_r = s_r2 / n - (s_r / n) ** 2
    var_d = s_d2 / n - (s_d / n) ** 2
    return 1.0 - var_d / var_r if var_r > 0 else float("nan")
