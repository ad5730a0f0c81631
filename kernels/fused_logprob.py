"""Fused log-probability + entropy over vocabulary-parallel logits (Triton).

Same contract and result as the torch reference :func:`.logprob_reference.vocab_parallel_logprobs` (see its
module docstring), computed without ever forming an fp32 `[tokens, V_local]` tensor:

Forward, one program per scored row, streaming this rank's real columns (`< valid_cols`) in blocks of
`BLOCK_V`, reading the logits in their own dtype and accumulating in fp32 with an online softmax:

    z = logits / T
    m  <- max(m, max_block z)                          running maximum
    S  <- S  · exp(m_old - m) + Σ_block exp(z - m)     running Σ exp(z - m)
    Sz <- Sz · exp(m_old - m) + Σ_block exp(z - m) · z running Σ exp(z - m) · z
    z_t = z[target - vocab_start] if this rank owns the target, else 0

Then, in torch, the tensor-parallel combine of the reference: `m* = all-reduce MAX(m)`, each rank rescales
`S, Sz` by `exp(m - m*)`, and one all-reduce SUM of `(S, Sz, z_t)`. Finally

    log p(target) = z_t - m* - log S,     E_p[z] = Sz / S,     entropy = m* + log S - E_p[z].

Backward (no communication, as in the reference), one program per scored row, recomputing the softmax
from the saved `m*`, `log S` and `E_p[z]`:

    p = exp(z - m* - log S)
    d logits = (1/T) · [ g_lp · (onehot(target) - p) + g_ent · p · (E_p[z] - z) ]

written straight into a gradient in the logits' dtype (padded vocabulary columns and unscored rows are 0).
The only extra memory is a few fp32 values per row.

Triton runs on CUDA tensors, or on CPU tensors under the Triton interpreter (`TRITON_INTERPRET=1` set before
this module is imported; slow, for tests). :func:`triton_available` says whether the `triton` package is
there, so a caller can fall back to the reference without importing triton itself.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .logprob_reference import vocab_parallel_logprobs

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; calling the kernel raises a clear error
    triton = None

__all__ = ["fused_vocab_parallel_logprobs", "triton_available"]

# Vocabulary columns one program handles per step; a power of two. Tests lower it to cover several blocks.
BLOCK_V = 4096
# Whether the kernels below were defined for the Triton interpreter (decided when this module is imported).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_available() -> bool:
    """Whether the `triton` package imported (not whether there is a GPU)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _row_stats_kernel(logits_ptr, row_stride, rows_ptr, labels_ptr, m_ptr, s_ptr, sz_ptr, zt_ptr,
                          temperature, vocab_start, valid_cols,
                          HAS_ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
        """Program i: online-softmax statistics (m, S, Sz) and z_t of scored row i over this rank's slice."""
        i = tl.program_id(0)
        if HAS_ROWS:
            row = tl.load(rows_ptr + i).to(tl.int64)
        else:
            row = i.to(tl.int64)
        base = logits_ptr + row * row_stride  # int64: rows × V can exceed 2**31
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.full([], 0.0, tl.float32)
        sz = tl.full([], 0.0, tl.float32)
        for start in range(0, valid_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            valid = cols < valid_cols
            z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) / temperature
            m_new = tl.maximum(m, tl.max(z, axis=0))
            # a block of only -inf logits leaves m_new = -inf; shift by 0 then, so exp() gives 0, not NaN
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - shift)
            e = tl.exp(z - shift)  # 0 on padding columns
            s = s * alpha + tl.sum(e, axis=0)
            sz = sz * alpha + tl.sum(e * tl.where(valid, z, 0.0), axis=0)  # (not 0 · -inf)
            m = m_new
        target = tl.load(labels_ptr + i) - vocab_start
        owned = (target >= 0) & (target < valid_cols)
        z_t = tl.load(base + tl.where(owned, target, 0), mask=owned, other=0.0).to(tl.float32) / temperature
        tl.store(m_ptr + i, m)
        tl.store(s_ptr + i, s)
        tl.store(sz_ptr + i, sz)
        tl.store(zt_ptr + i, tl.where(owned, z_t, 0.0))

    @triton.jit
    def _row_grad_kernel(logits_ptr, row_stride, grad_ptr, grad_row_stride, rows_ptr, labels_ptr,
                         log_norm_ptr, mean_z_ptr, g_lp_ptr, g_ent_ptr, temperature, vocab_start, valid_cols,
                         n_cols,
                         HAS_ROWS: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
                         BLOCK_V: tl.constexpr):
        """Program i: d loss / d logits of scored row i over all `n_cols` local columns (0 on padding)."""
        i = tl.program_id(0)
        if HAS_ROWS:
            row = tl.load(rows_ptr + i).to(tl.int64)
        else:
            row = i.to(tl.int64)
        base = logits_ptr + row * row_stride
        grad_base = grad_ptr + row * grad_row_stride
        log_norm = tl.load(log_norm_ptr + i)  # m* + log S: p = exp(z - log_norm)
        target = tl.load(labels_ptr + i) - vocab_start  # matches no real column unless this rank owns it
        if HAS_GLP:
            g_lp = tl.load(g_lp_ptr + i)
        else:
            g_lp = 0.0
        if HAS_GENT:
            g_ent = tl.load(g_ent_ptr + i)
            mean_z = tl.load(mean_z_ptr + i)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            valid = cols < valid_cols
            z = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) / temperature
            p = tl.exp(z - log_norm)
            g = tl.where(cols == target, g_lp, 0.0) - g_lp * p  # g_lp · (onehot - p)
            if HAS_GENT:
                g += g_ent * p * (mean_z - z)  # g_ent · dH/dz
            g = tl.where(valid, g / temperature, 0.0)
            tl.store(grad_base + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < n_cols)


def _check_runnable(logits: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("logprob_backend='triton' needs the `triton` package (pip install 'rlhf_mcore[triton]'); "
                           "use logprob_backend=auto (falls back to torch) or torch")
    if not logits.is_cuda and not _INTERPRETED:
        raise RuntimeError(f"logprob_backend='triton' runs on CUDA tensors (got logits on {logits.device}); on CPU "
                           "use logprob_backend=auto or torch, or set TRITON_INTERPRET=1 before importing "
                           "rlhf_mcore.kernels.fused_logprob to run the kernel under the Triton interpreter (tests)")


def _launch_config(n_cols: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a local vocabulary of `n_cols` columns."""
    block = min(BLOCK_V, triton.next_power_of_2(max(n_cols, 16)))
    return block, (8 if block >= 2048 else 4)


def _local_stats(logits, labels, rows, temperature, vocab_start, valid_cols):
    """Per scored row of this rank's slice: (m, S, Sz, z_t), each (M,) fp32; see the module docstring."""
    n = labels.shape[0]
    m, s, sz, z_t = torch.empty(4, n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return m, s, sz, z_t
    block, warps = _launch_config(valid_cols)
    _row_stats_kernel[(n,)](
        logits, logits.stride(0), rows if rows is not None else labels, labels, m, s, sz, z_t,
        temperature, vocab_start, valid_cols, HAS_ROWS=rows is not None, BLOCK_V=block, num_warps=warps)
    return m, s, sz, z_t


def _combine_over_tp(m, s, sz, z_t, group):
    """Global (m*, log S, E_p[z], z_t) from every rank's local statistics: all-reduce MAX, rescale, SUM."""
    if group is not None and dist.get_world_size(group) > 1:
        m_global = m.clone()
        dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=group)
        scale = torch.exp(m - m_global)  # 0 on a rank holding only padding (m = -inf)
        stats = torch.stack([s * scale, sz * scale, z_t])  # (3, M)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        m, (s, sz, z_t) = m_global, stats
    return m, s.log(), sz / s, z_t


class _FusedLogprobs(torch.autograd.Function):
    """Autograd wrapper of the two kernels; arguments as in the reference's `_VocabParallelLogprobs`."""

    @staticmethod
    def forward(ctx, logits, labels, rows, tp_group, temperature, vocab_start, valid_cols, compute_entropy):
        # logits (N, V_local), unit column stride ; labels (M,) global ids ; rows (M,) or None (M = N)
        ctx.set_materialize_grads(False)
        local = _local_stats(logits, labels, rows, temperature, vocab_start, valid_cols)
        m, log_s, mean_z, z_t = _combine_over_tp(*local, tp_group)
        log_probs = z_t - m - log_s  # (M,)
        ctx.save_for_backward(logits, labels, rows if rows is not None else labels.new_empty(0), m + log_s, mean_z)
        ctx.has_rows, ctx.compute_entropy = rows is not None, compute_entropy
        ctx.params = (temperature, vocab_start, valid_cols)
        if compute_entropy:
            return log_probs, m + log_s - mean_z
        return log_probs, torch.zeros(0, device=logits.device)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, labels, rows, log_norm, mean_z = ctx.saved_tensors
        temperature, vocab_start, valid_cols = ctx.params
        use_entropy = ctx.compute_entropy and grad_entropy is not None and grad_entropy.numel() > 0
        nothing = (None,) * 7
        n_scored, n_cols = labels.shape[0], logits.shape[1]
        if valid_cols == 0 or n_scored == 0 or (grad_log_probs is None and not use_entropy):
            return (torch.zeros_like(logits),) + nothing
        # every column of a scored row is written (0 on padding): only unscored rows need zero-filling
        grad = torch.zeros_like(logits) if ctx.has_rows else torch.empty_like(logits)
        g_lp = grad_log_probs.float().contiguous() if grad_log_probs is not None else log_norm
        g_ent = grad_entropy.float().contiguous() if use_entropy else log_norm
        block, warps = _launch_config(n_cols)
        _row_grad_kernel[(n_scored,)](
            logits, logits.stride(0), grad, grad.stride(0), rows if ctx.has_rows else labels, labels,
            log_norm, mean_z, g_lp, g_ent, temperature, vocab_start, valid_cols, n_cols,
            HAS_ROWS=ctx.has_rows, HAS_GLP=grad_log_probs is not None, HAS_GENT=use_entropy,
            BLOCK_V=block, num_warps=warps)
        return (grad,) + nothing


def _fused_core(flat, labels, rows, tp_group, temperature, vocab_start, valid_cols, chunk_size, compute_entropy):
    """The kernel as the core of :func:`vocab_parallel_logprobs` (`chunk_size` unused: no per-chunk buffer)."""
    _check_runnable(flat)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    return _FusedLogprobs.apply(flat, labels.contiguous(), None if rows is None else rows.contiguous(), tp_group,
                                temperature, vocab_start, valid_cols, compute_entropy)


def fused_vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, **kwargs):
    """:func:`.logprob_reference.vocab_parallel_logprobs` (same arguments, checks and outputs) computed
    by the fused kernel. Raises RuntimeError when triton is missing or the logits are not on CUDA (outside the
    interpreter)."""
    return vocab_parallel_logprobs(logits, labels, core=_fused_core, **kwargs)
