"""Masked reductions over padded `[batch, response_len]` tensors.

Every RL quantity here lives on a right-padded response grid with a 0/1 `response_mask`; these helpers
reduce over the valid entries only. They match veRL's `masked_mean` / `masked_var` / `masked_whiten`
numerically on every batch veRL accepts, and stay finite (instead of raising) on the degenerate batches
veRL rejects: an empty mask has mean 0 and variance 0, and a single valid token whitens to 0.
"""
from __future__ import annotations

import torch

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten"]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is non-zero. NaN/inf outside the mask never leak into the sum."""
    valid = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return (valid * mask).sum() if dim is None else (valid * mask).sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the masked entries (0 where the mask is empty, never NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked entries of the whole tensor; Bessel-corrected when `unbiased`.

    With fewer than two valid entries the unbiased variance is undefined; it is returned as 0 (veRL raises).
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        var = var * count / (count - 1) if count > 1 else torch.zeros_like(var)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise `values` to zero mean, unit (unbiased) variance over the masked entries of the whole batch.

    `(values - mean) / sqrt(var + 1e-8)` as in veRL; entries outside the mask are transformed too (callers
    multiply by the mask). With `shift_mean=False` the mean is added back after scaling.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean
