"""Rollout correction: importance-sampling (IS) weights and rejection masks for off-policy rollouts.

The rollout engine samples from `pi_rollout` (its own kernels and dtype, or older weights in asynchronous
training); the trainer's loss is written for `pi_old`, the actor's recomputed log-probs of the same weights.
Per token the ratio is `rho_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_log_prob - rollout_log_prob)`.

- IS weights (`rollout_is`): `token` uses `rho_t` per token; `sequence` uses the product over the response,
  `exp(sum_t log rho_t)`, on every token of the sequence. Weights are truncated from above at
  `rollout_is_threshold` (TIS) and, with `rollout_is_batch_normalize`, divided by their mean over the batch
  (over tokens for `token`, over sequences for `sequence`). They multiply the per-token policy-gradient loss.
- Rejection (`rollout_rs`): tokens (`token`) or whole sequences (`sequence`: the product of the ratios;
  `geometric`: their geometric mean, `exp(mean_t log rho_t)`) whose ratio leaves
  `[rollout_rs_threshold_lower, rollout_rs_threshold]` are removed from the loss mask. The lower bound
  defaults to `1 / rollout_rs_threshold`.
- Veto (`rollout_token_veto_threshold`): a sequence with any token whose `rho_t` is below the threshold is
  removed whole (one catastrophic token poisons the sequence's gradient).

Log-ratios are clamped to [-20, 20] before `exp` so weights stay finite; the veto compares the unclamped
log-ratio instead. The semantics and key names are veRL 0.7's `algorithm.rollout_correction`; every weight and
mask is zero outside `response_mask`.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch

from rlhf_mcore.algos.masked import masked_mean, masked_sum

__all__ = [
    "SAFETY_BOUND",
    "IS_LEVELS",
    "RS_LEVELS",
    "RolloutCorrection",
    "is_weights",
    "truncate_is_weights",
    "batch_normalize_is_weights",
    "rejection_mask",
    "token_veto_mask",
    "compute_rollout_correction",
]

SAFETY_BOUND = 20.0  # |log-ratio| clamp before exp(): weights stay within [exp(-20), exp(20)]
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


def _level_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log-ratio each token is judged by at `level`, clamped, as (B, T)."""
    if level == "token":
        lr = log_ratio  # (B, T)
    elif level == "sequence":
        lr = masked_sum(log_ratio, response_mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)  # (B, T)
    elif level == "geometric":
        lr = masked_mean(log_ratio, response_mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)  # (B, T)
    else:
        raise ValueError(f"unknown rollout correction level {level!r}; choose one of {', '.join(RS_LEVELS)}")
    return lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)


def is_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """Untruncated IS weights (B, T) from `log_ratio = old_log_prob - rollout_log_prob` (B, T): `exp(log_ratio)`
    per token (`token`) or `exp(sum over the sequence)` on each of its tokens (`sequence`); 0 off the mask."""
    if level not in IS_LEVELS:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r}; choose one of {', '.join(IS_LEVELS)}")
    w = torch.exp(_level_log_ratio(log_ratio, response_mask, level))  # (B, T)
    return torch.where(response_mask.bool(), w, torch.zeros((), dtype=w.dtype, device=w.device))  # (B, T)


def truncate_is_weights(weights: torch.Tensor, threshold: float) -> torch.Tensor:
    """TIS: weights (B, T) capped at `threshold` from above."""
    if not threshold > 0:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold must be > 0, got {threshold}")
    return weights.clamp(max=threshold)  # (B, T)


SumFn = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the ranks that hold the rest of the batch


def batch_normalize_is_weights(weights: torch.Tensor, response_mask: torch.Tensor, level: str,
                               batch_sum: Optional[SumFn] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights (B, T) divided by their mean over the batch, and that mean (a 0-dim tensor).

    `token`: the mean over all valid tokens; `sequence`: the mean over sequences with a valid token (one
    weight each, so long sequences do not count more). `batch_sum`, when the batch is split over data-parallel
    ranks: sums a (2,) float64 tensor (weight sum, count) over them. A mean of 0 leaves the weights unchanged.
    """
    mask = response_mask.to(weights.dtype)  # (B, T)
    if level == "token":
        stats = torch.stack([(weights * mask).sum(), mask.sum()])  # (2,)
    elif level == "sequence":
        has_tokens = mask.sum(-1) > 0  # (B,)
        seq_w = masked_mean(weights, mask, dim=-1)  # (B,) the sequence's weight
        stats = torch.stack([seq_w[has_tokens].sum(), has_tokens.sum().to(weights.dtype)])  # (2,)
    else:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r}; choose one of {', '.join(IS_LEVELS)}")
    if batch_sum is not None:
        stats = batch_sum(stats.double())
    mean = (stats[0] / stats[1].clamp(min=1)).to(weights.dtype)
    if not mean > 0:
        return weights, torch.ones((), dtype=weights.dtype, device=weights.device)
    return weights / mean, mean


def rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str, upper: float,
                   lower: Optional[float] = None) -> torch.Tensor:
    """Keep-mask (B, T), 1 where the ratio at `level` (`token`, `sequence` product, `geometric` mean) lies in
    `[lower, upper]` and the token is valid; `lower` defaults to `1 / upper`."""
    if level not in RS_LEVELS:
        raise ValueError(f"algorithm.rollout_correction.rollout_rs={level!r}; choose one of {', '.join(RS_LEVELS)}")
    lower = 1.0 / upper if lower is None else lower
    ratio = torch.exp(_level_log_ratio(log_ratio, response_mask, level))  # (B, T)
    keep = (ratio >= lower) & (ratio <= upper)  # (B, T)
    return (keep & response_mask.bool()).to(response_mask.dtype)  # (B, T)


def token_veto_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Keep-mask (B, T): 0 on every token of a sequence with a valid token whose ratio is below `threshold`.

    Compared in log space on the unclamped log-ratio, `log_ratio < log(threshold)` (veRL's test), so a threshold
    below exp(-SAFETY_BOUND) still catches the tokens past the clamp; a log-ratio of -inf vetoes, NaN does not.
    """
    if not threshold > 0:
        raise ValueError(f"algorithm.rollout_correction.rollout_token_veto_threshold must be > 0, got {threshold}")
    valid = response_mask.bool()  # (B, T)
    bad = log_ratio.double() < math.log(threshold)  # (B, T) in float64: exact for any fp32 / bf16 log-ratio
    vetoed = (bad & valid).any(-1, keepdim=True)  # (B, 1)
    return (valid & ~vetoed).to(response_mask.dtype)  # (B, T)


@dataclass
class RolloutCorrection:
    """What the policy loss needs from the rollout correction, with its metrics."""

    response_mask: torch.Tensor  # (B, T) the loss mask: rejected / vetoed tokens removed
    rollout_is_weights: Optional[torch.Tensor] = None  # (B, T) when IS is on, detached
    metrics: dict[str, float] = field(default_factory=dict)


def _frac(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(masked_mean(x.to(mask.dtype), mask))


def compute_rollout_correction(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                               response_mask: torch.Tensor, *, rollout_is: Optional[str] = None,
                               rollout_is_threshold: float = 2.0, rollout_is_batch_normalize: bool = False,
                               rollout_rs: Optional[str] = None, rollout_rs_threshold: Optional[float] = None,
                               rollout_rs_threshold_lower: Optional[float] = None,
                               rollout_token_veto_threshold: Optional[float] = None,
                               batch_sum: Optional[SumFn] = None) -> RolloutCorrection:
    """IS weights and the loss mask from the trainer's `old_log_prob` (B, T) and the rollout's
    `rollout_log_prob` (B, T) on `response_mask` (B, T); the keywords are `algorithm.rollout_correction`'s
    (`batch_sum`: see :func:`batch_normalize_is_weights`).

    Metrics (`rollout_corr/...`, over this rank's valid tokens / sequences): `rollout_is_mean` and
    `rollout_is/max` (weights before truncation), `rollout_is_ratio_fraction_high` (share of tokens truncated),
    `rollout_is_batch_norm_factor`; `rollout_rs_masked_fraction` / `rollout_rs_seq_masked_fraction` (tokens /
    sequences with a rejected token); `rollout_is_veto_fraction` (sequences vetoed).
    """
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
                         f"{tuple(rollout_log_prob.shape)} and response_mask {tuple(response_mask.shape)} must have "
                         f"one shape (B, T)")
    dtype = torch.promote_types(torch.promote_types(old_log_prob.dtype, rollout_log_prob.dtype), torch.float32)
    log_ratio = (old_log_prob.to(dtype) - rollout_log_prob.to(dtype)).detach()  # (B, T) at least fp32
    fmask = response_mask.to(dtype)  # (B, T)
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        raw = is_weights(log_ratio, response_mask, rollout_is)  # (B, T)
        metrics["rollout_corr/rollout_is_mean"] = float(masked_mean(raw, fmask))
        metrics["rollout_corr/rollout_is/max"] = float(raw.masked_fill(~response_mask.bool(), 0).max()) \
            if response_mask.any() else 0.0
        metrics["rollout_corr/rollout_is_ratio_fraction_high"] = _frac(raw > rollout_is_threshold, fmask)
        weights = truncate_is_weights(raw, rollout_is_threshold)  # (B, T)
        if rollout_is_batch_normalize:
            weights, factor = batch_normalize_is_weights(weights, response_mask, rollout_is, batch_sum=batch_sum)
            metrics["rollout_corr/rollout_is_batch_norm_factor"] = float(factor)
    keep = response_mask
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError(f"algorithm.rollout_correction.rollout_rs={rollout_rs!r} needs rollout_rs_threshold "
                             f"(the largest ratio kept, e.g. 2.0)")
        keep = keep * rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold,
                                     rollout_rs_threshold_lower)  # (B, T)
        rejected = response_mask.bool() & ~keep.bool()  # (B, T)
        metrics["rollout_corr/rollout_rs_masked_fraction"] = _frac(rejected, fmask)
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = float(rejected.any(-1).float().mean()) \
            if rejected.shape[0] else 0.0
    if rollout_token_veto_threshold is not None:
        veto = token_veto_mask(log_ratio, response_mask, rollout_token_veto_threshold)  # (B, T)
        vetoed = (response_mask.bool() & ~veto.bool()).any(-1)  # (B,)
        metrics["rollout_corr/rollout_is_veto_fraction"] = float(vetoed.float().mean()) if vetoed.numel() else 0.0
        keep = keep * veto  # (B, T)
    if weights is not None:
        weights = (weights * keep.to(weights.dtype)).detach()  # (B, T) zero where the loss mask is
    return RolloutCorrection(response_mask=keep, rollout_is_weights=weights, metrics=metrics)
