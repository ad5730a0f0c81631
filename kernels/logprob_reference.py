"""Per-token log-probabilities and entropy from vocabulary-parallel logits, in chunks of tokens.

With tensor parallelism the output layer leaves each TP rank with logits for its slice of the vocabulary,
`[tokens, V_padded / TP]`. Gathering the full `[tokens, V]` on one rank would cost `tokens × V` floats (for
Qwen2.5's 152k vocabulary and 16k tokens that is 10 GB in fp32), so the softmax statistics are reduced over
the TP group instead:

    m   = max_v z_v                                   all-reduce MAX over TP
    S   = sum_v exp(z_v - m),  Sz = sum_v exp(z_v - m) z_v,  z_t = z[target]   one all-reduce SUM over TP
    log p(target) = z_t - m - log S,     entropy = m + log S - Sz / S

with `z = logits / temperature` (the sampling temperature of the rollout, so the trainer scores tokens
under the distribution they were drawn from), and `z_t` contributed by the rank that owns the target id.

Only the requested rows are touched (`rows`: e.g. the response tokens, skipping prompts), a chunk of
`chunk_size` rows at a time, each cast to fp32 on its own: the extra memory is `chunk_size × V/TP` floats,
independent of the sequence length. The backward pass recomputes each chunk's softmax from the saved
per-row statistics (`m`, `log S`, the entropy's `E_p[z]`), so nothing of size `[rows, V]` is kept between
forward and backward either. No communication is needed in backward: each rank writes the gradient of its
own vocabulary slice, and the column-parallel output layer's backward all-reduces the input gradient.

Vocabulary padding: Megatron pads the embedding to a multiple of `make_vocab_size_divisible_by × TP`;
columns at global index `>= vocab_size` are excluded, so the result equals a log-softmax over the real
vocabulary (what Hugging Face computes).

:func:`vocab_parallel_logprobs` is the torch reference. A kernel (e.g. :mod:`.fused_logprob`) shares its
argument checks and output handling by passing its own `core`, and is then a drop-in with the same signature.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_logprobs", "check_logprob_args", "LogprobFn"]

# A log-prob/entropy implementation: same signature and outputs as `vocab_parallel_logprobs`.
LogprobFn = Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _chunk_logits(logits, rows, start, end, valid_cols, temperature) -> torch.Tensor:
    """Rows `start:end` of the work list as fp32 `z = logits / T` over this rank's real vocabulary: (n, v)."""
    if rows is None:
        block = logits[start:end, :valid_cols]
    else:
        block = logits.index_select(0, rows[start:end])[:, :valid_cols]
    z = block.float()
    if temperature != 1.0:
        z = z / temperature
    return z


class _VocabParallelLogprobs(torch.autograd.Function):
    """Autograd wrapper of the chunked computation; see the module docstring for the math."""

    @staticmethod
    def forward(ctx, logits, labels, rows, tp_group, temperature, vocab_start, valid_cols, chunk_size,
                compute_entropy):
        # logits (N, V_local) ; labels (M,) global ids ; rows (M,) row of `logits` per label, or None (M = N)
        ctx.set_materialize_grads(False)  # an unused output (e.g. entropy) then costs nothing in backward
        n_rows = labels.shape[0]
        device = logits.device
        log_probs = torch.empty(n_rows, dtype=torch.float32, device=device)  # (M,)
        entropy = torch.empty(n_rows, dtype=torch.float32, device=device) if compute_entropy else None  # (M,)
        row_max = torch.empty(n_rows, dtype=torch.float32, device=device)  # (M,)
        log_sum = torch.empty(n_rows, dtype=torch.float32, device=device)  # (M,)
        mean_z = torch.empty(n_rows, dtype=torch.float32, device=device) if compute_entropy else None  # (M,)
        distributed = _group_size(tp_group) > 1
        for start in range(0, n_rows, chunk_size):
            end = min(start + chunk_size, n_rows)
            z = _chunk_logits(logits, rows, start, end, valid_cols, temperature)  # (n, v)
            n = end - start
            if valid_cols > 0:
                m = z.max(dim=-1).values  # (n,)
            else:  # this rank holds only padding rows of the embedding
                m = torch.full((n,), float("-inf"), device=device)
            if distributed:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
            ez = torch.exp(z - m.unsqueeze(-1))  # (n, v)
            local_target = labels[start:end] - vocab_start  # (n,)
            owned = (local_target >= 0) & (local_target < valid_cols)  # (n,)
            picked = torch.zeros(n, dtype=torch.float32, device=device)  # (n,)
            if valid_cols > 0:
                idx = local_target.clamp(0, valid_cols - 1).unsqueeze(-1)  # (n, 1)
                picked = torch.where(owned, z.gather(-1, idx).squeeze(-1), picked)
            stats = [ez.sum(-1), picked]
            if compute_entropy:
                stats.append((ez * z).sum(-1))
            stats = torch.stack(stats)  # (2 or 3, n)
            if distributed:
                dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=tp_group)
            lse = stats[0].log()  # (n,)  log S
            log_probs[start:end] = stats[1] - m - lse
            row_max[start:end] = m
            log_sum[start:end] = lse
            if compute_entropy:
                ez_mean = stats[2] / stats[0]  # (n,)  E_p[z]
                mean_z[start:end] = ez_mean
                entropy[start:end] = m + lse - ez_mean
        ctx.save_for_backward(logits, labels, rows if rows is not None else labels.new_empty(0), row_max, log_sum,
                              mean_z if compute_entropy else row_max.new_empty(0))
        ctx.has_rows = rows is not None
        ctx.compute_entropy = compute_entropy
        ctx.params = (temperature, vocab_start, valid_cols, chunk_size)
        if compute_entropy:
            return log_probs, entropy
        return log_probs, torch.zeros(0, device=device)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, labels, rows, row_max, log_sum, mean_z = ctx.saved_tensors
        rows = rows if ctx.has_rows else None
        temperature, vocab_start, valid_cols, chunk_size = ctx.params
        grad_logits = torch.zeros_like(logits)  # (N, V_local); padded vocabulary columns keep 0
        use_entropy = ctx.compute_entropy and grad_entropy is not None and grad_entropy.numel() > 0
        n_rows = labels.shape[0]
        if valid_cols == 0 or (grad_log_probs is None and not use_entropy):
            return grad_logits, None, None, None, None, None, None, None, None
        for start in range(0, n_rows, chunk_size):
            end = min(start + chunk_size, n_rows)
            z = _chunk_logits(logits, rows, start, end, valid_cols, temperature)  # (n, v)
            p = torch.exp(z - (row_max[start:end] + log_sum[start:end]).unsqueeze(-1))  # (n, v) softmax
            g_lp = (grad_log_probs[start:end] if grad_log_probs is not None
                    else torch.zeros(end - start, device=z.device)).unsqueeze(-1)  # (n, 1)
            # d log p_t / dz = onehot(t) - p ;  d H / dz = p * (E_p[z] - z)
            grad_z = -g_lp * p  # (n, v)
            if use_entropy:
                grad_z += grad_entropy[start:end].unsqueeze(-1) * p * (mean_z[start:end].unsqueeze(-1) - z)
            local_target = labels[start:end] - vocab_start  # (n,)
            owned = (local_target >= 0) & (local_target < valid_cols)
            idx = local_target.clamp(0, valid_cols - 1).unsqueeze(-1)  # (n, 1)
            grad_z.scatter_add_(-1, idx, torch.where(owned.unsqueeze(-1), g_lp, torch.zeros_like(g_lp)))
            if temperature != 1.0:
                grad_z /= temperature
            grad_z = grad_z.to(grad_logits.dtype)
            if rows is None:
                grad_logits[start:end, :valid_cols] = grad_z
            else:  # rows are unique: every logits row is scored at most once
                full = torch.zeros(end - start, grad_logits.shape[1], dtype=grad_logits.dtype, device=z.device)
                full[:, :valid_cols] = grad_z
                grad_logits.index_copy_(0, rows[start:end], full)
        return grad_logits, None, None, None, None, None, None, None, None


def _chunked_core(flat, labels, rows, tp_group, temperature, vocab_start, valid_cols, chunk_size, compute_entropy):
    """The torch reference's computation (see the module docstring): chunks of `chunk_size` rows in fp32."""
    return _VocabParallelLogprobs.apply(flat, labels, rows, tp_group, temperature, vocab_start, valid_cols,
                                        chunk_size, compute_entropy)


def check_logprob_args(logits, labels, rows, tp_group, temperature, vocab_size, chunk_size):
    """The argument checks every log-prob backend shares. Returns `(flat (N, V_local) logits view, labels (M,),
    this rank's first global vocabulary id, its number of real (unpadded) columns)`."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens (got {temperature}); greedy rollouts are "
                         "scored at temperature 1.0")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    v_local = logits.shape[-1]
    flat = logits.reshape(-1, v_local)  # (N, V_local)
    labels_flat = labels.reshape(-1)
    if rows is None and labels_flat.shape[0] != flat.shape[0]:
        raise ValueError(f"labels has {labels_flat.shape[0]} entries but logits has {flat.shape[0]} rows; pass "
                         "`rows` to score a subset")
    if rows is not None and rows.shape != labels_flat.shape:
        raise ValueError(f"rows {tuple(rows.shape)} and labels {tuple(labels_flat.shape)} must have one entry each")
    vocab_start = _group_rank(tp_group) * v_local
    padded_vocab = v_local * _group_size(tp_group)
    vocab_size = padded_vocab if vocab_size is None else vocab_size
    if vocab_size > padded_vocab:
        raise ValueError(f"vocab_size={vocab_size} exceeds the logits' vocabulary {padded_vocab} "
                         f"(V_local={v_local} × TP={_group_size(tp_group)})")
    return flat, labels_flat, vocab_start, max(0, min(v_local, vocab_size - vocab_start))


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    rows: Optional[torch.Tensor] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    compute_entropy: bool = True,
    chunk_size: int = 2048,
    core: Optional[Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probability of `labels` and the entropy under `softmax(logits / temperature)`, vocab-parallel.

    logits: `(..., V_local)`, this TP rank's slice of the (padded) vocabulary; rank r holds global ids
        `[r·V_local, (r+1)·V_local)`. Leading dims are flattened to `N` rows (a view, no copy).
    labels: `(M,)` global token ids, one per scored row.
    rows: `(M,)` unique indices into the `N` flattened rows of `logits` (only these are read); `None` scores
        every row (`M = N`, labels then `(...)` like logits' leading dims).
    tp_group: the tensor-parallel group the vocabulary is split over (`None` or size 1: no communication).
    vocab_size: the real vocabulary size; columns at global ids `>= vocab_size` are ignored (padding).
    chunk_size: rows processed at once; bounds the fp32 working memory to `chunk_size × V_local`.
    core: the computation on the checked, flattened arguments, `core(flat, labels, rows, tp_group, temperature,
        vocab_start, valid_cols, chunk_size, compute_entropy) -> (log_probs, entropy)`; default the chunked
        torch reference. A kernel passes its own and shares everything else.

    Returns `(log_probs, entropy)`, each `(M,)` fp32 (entropy `None` when `compute_entropy=False`), both
    differentiable with respect to `logits`.
    """
    flat, labels_flat, vocab_start, valid_cols = check_logprob_args(logits, labels, rows, tp_group, temperature,
                                                                     vocab_size, chunk_size)
    log_probs, entropy = (core or _chunked_core)(
        flat, labels_flat.long(), None if rows is None else rows.long(), tp_group, float(temperature),
        vocab_start, valid_cols, int(chunk_size), bool(compute_entropy))
    if rows is None:
        shape = labels.shape
        log_probs = log_probs.view(shape)
        entropy = entropy.view(shape) if compute_entropy else None
    elif not compute_entropy:
        entropy = None
    return log_probs, entropy
