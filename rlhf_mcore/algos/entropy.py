"""Token entropy of the policy and the entropy bonus (`actor.entropy_coeff`)."""
from __future__ import annotations

from typing import Any

import torch

from rlhf_mcore.algos.aggregation import agg_loss

__all__ = ["entropy_from_logits", "compute_entropy_loss"]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy of softmax(logits) over the last dim: (..., V) -> (...).

    `logsumexp(z) - sum(softmax(z) * z)`, which is stable for large logits.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def compute_entropy_loss(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    entropy_coeff: float,
    loss_agg_mode: str = "token-mean",
    global_tokens: Any = None,
    global_seqs: Any = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The entropy bonus as a term to *add* to the loss: `-entropy_coeff * agg(entropy)`.

    `entropy` (B, T) per token (see :func:`entropy_from_logits`). Maximising entropy keeps exploration up.
    Metric `entropy` is the aggregated entropy (the same share semantics as the loss with global counts).
    """
    entropy_agg = agg_loss(
        entropy,
        response_mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    return -entropy_coeff * entropy_agg, {"entropy": entropy_agg.detach()}
