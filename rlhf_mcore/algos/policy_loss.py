"""Policy-gradient losses, registered by name (`actor.policy_loss`): `vanilla` (PPO clip), `gspo`, and
`sft` (negative log-likelihood, for supervised warm starts through the same engine).

A policy loss is called as::

    loss, metrics = get_policy_loss("vanilla")(
        old_log_prob, log_prob, advantages, response_mask,            # each (B, T)
        loss_agg_mode="token-mean", clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
        clip_ratio_c=3.0, global_tokens=None, global_seqs=None, loss_scale_factor=None,
        rollout_is_weights=None)

and returns a scalar loss (to minimise) and a dict of detached 0-dim tensors (`pg_clipfrac`, `ppo_kl`,
`pg_clipfrac_lower`, `approx_kl`); metrics are means over this call's valid tokens. Unused keywords are
ignored, so the trainer passes one uniform set. `global_tokens` / `global_seqs` / `loss_scale_factor` go to
:func:`rlhf_mcore.algos.aggregation.agg_loss` (micro-batch invariance). `rollout_is_weights` (B, T), when
given, multiplies the per-token losses (importance-sampling correction for off-policy rollouts).

The math follows veRL 0.7's `compute_policy_loss_vanilla` / `compute_policy_loss_gspo`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlhf_mcore.algos.aggregation import agg_loss
from rlhf_mcore.algos.masked import masked_mean
from rlhf_mcore.registry import Registry

__all__ = [
    "PolicyLossFn",
    "register_policy_loss",
    "get_policy_loss",
    "list_policy_losses",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_sft_loss",
]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
_POLICY_LOSSES: Registry[PolicyLossFn] = Registry(
    "policy loss", "Register a new one with @rlhf_mcore.algos.register_policy_loss(name).")

LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| is clamped to this before exp() (veRL's value), token level
GSPO_LOG_RATIO_MAX = 10.0  # GSPO clamps the sequence log-ratio from above only (veRL's value)


def register_policy_loss(name: str, *, override: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: make `fn` available as `actor.policy_loss=<name>`."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        return _POLICY_LOSSES.add(name, fn, override=override)

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`; a ValueError lists the known names otherwise."""
    return _POLICY_LOSSES.get(name, key="actor.policy_loss")


def list_policy_losses() -> list[str]:
    """Names of all registered policy losses."""
    return _POLICY_LOSSES.names()


def _clip_bounds(clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None):
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    if low < 0 or high < 0:
        raise ValueError(f"clip ratios must be >= 0, got clip_ratio_low={low}, clip_ratio_high={high}")
    return low, high


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    global_tokens: Any = None,
    global_seqs: Any = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clipping (DAPO clip-higher) and dual-clip.

    Per token, with `r = exp(log_prob - old_log_prob)`:
    `L = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))`, and for `A < 0` additionally
    `L = min(L, -A clip_ratio_c)` (dual-clip PPO, arXiv:1912.09729: bounds the loss of very off-policy
    tokens with negative advantage). `clip_ratio_low/high` default to `clip_ratio`.

    Metrics: `pg_clipfrac` (share of tokens where the clipped branch is active), `pg_clipfrac_lower`
    (share where dual-clip is active), `ppo_kl` (mean of `old_log_prob - log_prob`, the k1 estimate of
    KL(pi_old || pi)), `approx_kl` (the k3 estimate `r - 1 - log r`, lower variance).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"actor.clip_ratio_c (dual-clip bound) must be > 1.0, got {clip_ratio_c}; the default is 3.0")
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)

    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    loss_unclipped = -advantages * ratio  # (B, T)
    loss_clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)  # (B, T)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)  # (B, T)
    loss_dual = torch.minimum(loss_ppo, -advantages * clip_ratio_c)  # (B, T)
    negative = advantages < 0
    pg_losses = torch.where(negative, loss_dual, loss_ppo)  # (B, T)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    loss = agg_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        dual_clipped = (loss_ppo > -advantages * clip_ratio_c) & negative  # (B, T)
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask),
            "pg_clipfrac_lower": masked_mean(dual_clipped.float(), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
            "approx_kl": masked_mean(ratio - 1 - log_ratio, response_mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "seq-mean-token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    global_tokens: Any = None,
    global_seqs: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (arXiv:2507.18071): PPO clipping on the *sequence-level* ratio `s_i = exp(mean_t log r_i,t)`.

    The token-level ratio is `s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]`: its value is `s_i` for every token
    of sequence i, its gradient is that of the token's own log-prob. The loss is always aggregated
    `seq-mean-token-mean` (GSPO's definition, as in veRL) whatever `loss_agg_mode` says; GSPO papers use
    small clip ranges (e.g. `clip_ratio_low=3e-4`, `clip_ratio_high=4e-4`).
    """
    del loss_agg_mode  # GSPO fixes its aggregation; the argument is accepted for a uniform call signature
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = log_prob - old_log_prob  # (B, T)
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)  # (B,) mean over each sequence's tokens
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)  # (B, T)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))  # (B, T)
    loss_unclipped = -advantages * ratio  # (B, T)
    loss_clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)  # (B, T)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)  # (B, T)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    loss = agg_loss(
        pg_losses, response_mask, "seq-mean-token-mean", global_tokens=global_tokens, global_seqs=global_seqs
    )
    with torch.no_grad():
        clamped_log_ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask),
            "pg_clipfrac_lower": torch.zeros((), device=loss.device),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
            "approx_kl": masked_mean(torch.exp(clamped_log_ratio) - 1 - clamped_log_ratio, response_mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


@register_policy_loss("sft")
def compute_sft_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    global_tokens: Any = None,
    global_seqs: Any = None,
    loss_scale_factor: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised fine-tuning as a "policy loss": the negative log-likelihood of the response tokens
    (`launch/sft.py` runs it through the same engine; `old_log_prob` and `advantages` are ignored)."""
    nll = -log_prob  # (B, T)
    loss = agg_loss(nll, response_mask, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                    loss_scale_factor=loss_scale_factor)
    zero = torch.zeros((), device=loss.device)
    metrics = {"sft_nll": masked_mean(nll.detach(), response_mask), "pg_clipfrac": zero, "pg_clipfrac_lower": zero,
               "ppo_kl": zero, "approx_kl": zero}
    return loss, metrics
