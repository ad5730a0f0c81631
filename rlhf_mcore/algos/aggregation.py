"""Loss aggregation: a `[B, T]` per-token loss matrix -> one scalar, with an optional global normaliser.

Modes (`actor.loss_agg_mode`; the same names as veRL):

- `token-mean`: sum over all valid tokens / number of valid tokens.
- `seq-mean-token-sum`: per sequence, the sum over its tokens; then the mean over sequences.
- `seq-mean-token-mean`: per sequence, the mean over its tokens; then the mean over sequences.
- `seq-mean-token-sum-norm`: per sequence, the sum over its tokens divided by a constant
  `loss_scale_factor` (default: the padded response length `T`; set it to `max_response_length` to keep it
  constant); then the mean over sequences. This is Dr.GRPO's unbiased loss (arXiv:2503.20783).

Sequences with no valid token are not counted in the sequence modes.

Micro-batch and data-parallel invariance (what the train engine relies on). Every mode is a *sum* of
per-token or per-sequence terms divided by one count. When a mini-batch is split into micro-batches (and
across DP ranks), pass the count of the *whole mini-batch*:

- `global_tokens`: the number of valid tokens in the mini-batch over all micro-batches and DP ranks
  (used by `token-mean`);
- `global_seqs`: the number of sequences with at least one valid token in the mini-batch over all
  micro-batches and DP ranks (used by the three sequence modes).

Then each micro-batch returns its exact share, and the shares *sum* to the whole-mini-batch loss (and so do
the gradients). A backend that averages instead of summing (Megatron's pipeline schedule divides by the
number of micro-batches; data-parallel all-reduce averages over DP ranks) must multiply the returned value
by that count. Without the global counts each call normalises by its own counts, which equals the
whole-batch loss only when there is one micro-batch.

Difference from veRL 0.7: its `seq-mean-token-sum-norm` returns `sum / loss_scale_factor` without dividing by
the number of sequences (the effective scale then depends on the micro-batch size); here it is divided by the
sequence count like the other sequence modes, so the loss is a per-sequence mean and invariant to splitting.
Empty batches give 0, never NaN.
"""
from __future__ import annotations

import torch

from rlhf_mcore.registry import Registry

__all__ = ["agg_loss", "list_loss_agg_modes"]

# mode -> fn(masked (B, T), tokens_per_seq (B,), loss_scale_factor, T) -> per-sequence losses (B,);
# `token-mean` is the one token-level mode and is handled in agg_loss itself.
_SEQ_MODES: Registry = Registry("loss_agg_mode", "")
_TOKEN_MEAN = "token-mean"


def _seq_token_sum(masked, tokens_per_seq, scale, length):
    return masked.sum(dim=-1)


def _seq_token_mean(masked, tokens_per_seq, scale, length):
    return masked.sum(dim=-1) / tokens_per_seq.clamp(min=1)


def _seq_token_sum_norm(masked, tokens_per_seq, scale, length):
    scale = length if scale is None else scale
    if scale <= 0:
        raise ValueError(f"loss_scale_factor must be > 0 (e.g. max_response_length), got {scale}")
    return masked.sum(dim=-1) / scale


_SEQ_MODES.add("seq-mean-token-sum", _seq_token_sum)
_SEQ_MODES.add("seq-mean-token-mean", _seq_token_mean)
_SEQ_MODES.add("seq-mean-token-sum-norm", _seq_token_sum_norm)


def list_loss_agg_modes() -> list[str]:
    """Every loss aggregation mode (`actor.loss_agg_mode`, `critic.loss_agg_mode`)."""
    return [_TOKEN_MEAN] + _SEQ_MODES.names()


def _as_divisor(count, like: torch.Tensor) -> torch.Tensor:
    """A count (int, float or tensor) as a float tensor on `like`'s device, at least 1."""
    # At least float32: a bf16 count of 100k tokens would be off by hundreds.
    count = torch.as_tensor(count, dtype=torch.promote_types(like.dtype, torch.float32), device=like.device)
    return count.clamp(min=1)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate `loss_mat` (B, T) over the valid entries of `loss_mask` (B, T) into a scalar.

    See the module docstring for the modes and for `global_tokens` / `global_seqs`, which make the result a
    micro-batch's exact share of a larger batch's loss.
    """
    mask = loss_mask.to(loss_mat.dtype)  # (B, T)
    # Entries outside the mask may hold anything (NaN from padded positions included): zero them first.
    masked = torch.where(loss_mask.bool(), loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if loss_agg_mode == _TOKEN_MEAN:
        tokens = mask.sum() if global_tokens is None else global_tokens
        return masked.sum() / _as_divisor(tokens, masked)
    if loss_agg_mode not in _SEQ_MODES:
        raise ValueError(f"unknown loss_agg_mode={loss_agg_mode!r}; choose one of {list_loss_agg_modes()}")
    tokens_per_seq = mask.sum(dim=-1)  # (B,)
    seq_present = (tokens_per_seq > 0).to(masked.dtype)  # (B,)
    seqs = seq_present.sum() if global_seqs is None else global_seqs
    seq_losses = _SEQ_MODES.get(loss_agg_mode, key="loss_agg_mode")(
        masked, tokens_per_seq, loss_scale_factor, loss_mat.shape[-1])  # (B,)
    return (seq_losses * seq_present).sum() / _as_divisor(seqs, masked)
