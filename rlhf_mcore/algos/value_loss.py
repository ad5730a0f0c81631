"""The critic's clipped value loss (PPO), as in veRL 0.7's `compute_value_loss`."""
from __future__ import annotations

from typing import Any

import torch

from rlhf_mcore.algos.aggregation import agg_loss
from rlhf_mcore.algos.masked import masked_mean

__all__ = ["compute_value_loss"]


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    global_tokens: Any = None,
    global_seqs: Any = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))` over valid tokens.

    `vpreds` (B, T) are the critic's current predictions, `values` (B, T) its predictions at rollout time
    (`V_old`), `returns` (B, T) the regression targets. Clipping keeps one update from moving a value by
    more than `cliprange_value` (c). Metrics: `vf_clipfrac` (share of tokens where the clipped branch is
    larger), `vpred_mean`.
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)  # (B, T)
    loss_unclipped = (vpreds - returns) ** 2  # (B, T)
    loss_clipped = (vpred_clipped - returns) ** 2  # (B, T)
    vf_losses = torch.maximum(loss_unclipped, loss_clipped)  # (B, T)
    loss = 0.5 * agg_loss(
        vf_losses,
        response_mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask),
            "vpred_mean": masked_mean(vpreds, response_mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}
