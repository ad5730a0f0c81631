"""SwiGLU whose output leaves the kernel as FP8 codes, and its backward whose gradient does (Triton): the producer
casts of the delayed recipe's MLP (`fp8_mlp`).

Under the delayed recipe a tensor's FP8 scale is known before the tensor exists (the site's amax history), so the
kernel that computes it can write its codes at once instead of a bf16 tensor that a cast kernel then reads again:

    swiglu_cast      y (M, 2F) -> codes of h = silu(y[:, :F]) * y[:, F:] (M, F) and of h.T (F, M)
                     (fc2's input: its forward GEMM and its weight-gradient GEMM)
    swiglu_bwd_cast  g = dL/dh (M, F), y -> codes of dy (M, 2F) and of dy.T (2F, M)
                     (fc1's output gradient: its input-gradient GEMM and its weight-gradient GEMM)

Each value is rounded to y's dtype before its cast, so the codes, the scale and the amax folded into `seen` are bit for
bit what `fused_layer.swiglu` (or its backward) followed by `fp8.quantize_tensor(..., amax=, seen=)` give: the unfused
path, which the delayed recipe keeps for a site's first cast (it has no history yet), for fp32 y and on CPU. y is
16-bit here (the transposed store is `tl.trans` of the code tile, as the cast kernel's 16-bit path). Saved per
element of fc2's input: the bf16 write and read (4 bytes of the 7 the unfused pair moves); per element of fc1's output
gradient the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import FP8_MAX

# (row tile, column tile, warps) of each kernel: the fastest of `bench_fp8._swiglu_cast_tiles` at the 7B width (F =
# 18,944, 4,096 rows, an H100, session 45; codes bit for bit those of 64 x 64 on 4 warps): the forward 230 -> 199 us,
# the backward 617 -> 376 us (64 x 64 tiles held ~6 fp32 values a thread x 32 elements: register-bound on 4 warps).
FWD_TILES = (32, 64, 4)
BWD_TILES = (32, 64, 8)


@triton.jit
def _codes(v, scale, QMAX: tl.constexpr):
    return tl.minimum(tl.maximum(tl.div_rn(v, scale), -QMAX), QMAX)


@triton.jit
def _swiglu_cast_kernel(y_ptr, amax_ptr, q_ptr, qt_ptr, s_ptr, seen_ptr, M, F, stride_ym, stride_qm, stride_qtk,
                        QMAX: tl.constexpr, TRANSPOSE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Program (row block, column block of F): h of the tile in y's dtype, its codes under amax / QMAX stored in q
    (M, F) and with TRANSPOSE in qt (F, M); its max |h| folded into seen; program (0, 0) writes the scale."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (cols[None, :] < F)
    y_tile = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    a = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(y_tile + F, mask=mask, other=0.0).to(tl.float32)
    h = (a * tl.sigmoid(a) * b).to(y_ptr.dtype.element_ty).to(tl.float32)  # fused_layer's swiglu, to the bit
    amax = tl.load(amax_ptr).to(tl.float32)
    scale = tl.where(amax > 0, tl.div_rn(amax, QMAX), 1.0)
    q = _codes(h, scale, QMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], q, mask=mask)
    tl.atomic_max(seen_ptr, tl.max(tl.max(tl.abs(h), axis=1), axis=0))
    if TRANSPOSE:
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * stride_qtk + rows[None, :], tl.trans(q), mask=tl.trans(mask))
    if (pid_m == 0) & (pid_k == 0):
        tl.store(s_ptr, scale)


@triton.jit
def _swiglu_bwd_cast_kernel(g_ptr, y_ptr, amax_ptr, q_ptr, qt_ptr, s_ptr, seen_ptr, M, F, stride_gm, stride_ym,
                            stride_qm, stride_qtk, QMAX: tl.constexpr, TRANSPOSE: tl.constexpr, BM: tl.constexpr,
                            BK: tl.constexpr):
    """Program (row block, column block of F): dy's two halves of the tile (fused_layer's backward, in y's dtype),
    their codes stored at columns c and F + c of q (M, 2F) and with TRANSPOSE at rows c and F + c of qt (2F, M);
    their max |dy| folded into seen; program (0, 0) writes the scale."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (cols[None, :] < F)
    r64 = rows[:, None].to(tl.int64)
    y_tile = y_ptr + r64 * stride_ym + cols[None, :]
    a = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(y_tile + F, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r64 * stride_gm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    da = (g * b * sig * (1.0 + a * (1.0 - sig))).to(y_ptr.dtype.element_ty).to(tl.float32)
    db = (g * a * sig).to(y_ptr.dtype.element_ty).to(tl.float32)
    amax = tl.load(amax_ptr).to(tl.float32)
    scale = tl.where(amax > 0, tl.div_rn(amax, QMAX), 1.0)
    qa = _codes(da, scale, QMAX).to(q_ptr.dtype.element_ty)
    qb = _codes(db, scale, QMAX).to(q_ptr.dtype.element_ty)
    q_tile = q_ptr + r64 * stride_qm + cols[None, :]
    tl.store(q_tile, qa, mask=mask)
    tl.store(q_tile + F, qb, mask=mask)
    tl.atomic_max(seen_ptr, tl.maximum(tl.max(tl.max(tl.abs(da), axis=1), axis=0),
                                       tl.max(tl.max(tl.abs(db), axis=1), axis=0)))
    if TRANSPOSE:
        qt_tile = qt_ptr + cols[:, None].to(tl.int64) * stride_qtk + rows[None, :]
        tl.store(qt_tile, tl.trans(qa), mask=tl.trans(mask))
        tl.store(qt_tile + F * stride_qtk, tl.trans(qb), mask=tl.trans(mask))
    if (pid_m == 0) & (pid_k == 0):
        tl.store(s_ptr, scale)


def _outputs(m: int, k: int, dtype: torch.dtype, transpose: bool, device) -> tuple:
    q = torch.empty(m, k, dtype=dtype, device=device)
    qt = torch.empty(k, m, dtype=dtype, device=device) if transpose else q  # q: an unused pointer
    return q, qt, torch.empty(1, 1, dtype=torch.float32, device=device)


def swiglu_cast(y: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor, seen: torch.Tensor, transpose: bool,
                bm: int = FWD_TILES[0], bk: int = FWD_TILES[1], num_warps: int = FWD_TILES[2]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes (M, F) of swiglu(y) for y (M, 2F) with contiguous rows under the scale from `amax` (0-dim), the scale
    (1, 1), and with `transpose` the codes of its transpose (F, M); its max |h| folded into `seen` (one fp32)."""
    m, f = y.shape[0], y.shape[1] // 2
    q, qt, scale = _outputs(m, f, dtype, transpose, y.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(f, bk))
    _swiglu_cast_kernel[grid](y, amax, q, qt, scale, seen, m, f, y.stride(0), q.stride(0), qt.stride(0),
                              QMAX=FP8_MAX[dtype], TRANSPOSE=transpose, BM=bm, BK=bk, num_warps=num_warps)
    return q, scale, qt if transpose else None


def swiglu_bwd_cast(g: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor, seen: torch.Tensor,
                    transpose: bool, bm: int = BWD_TILES[0], bk: int = BWD_TILES[1], num_warps: int = BWD_TILES[2]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes (M, 2F) of dL/dy for g = dL/dh (M, F) and y (M, 2F) (contiguous rows) under the scale from `amax`,
    the scale (1, 1), and with `transpose` the codes of dy.T (2F, M); max |dy| folded into `seen`."""
    m, f = g.shape
    q, qt, scale = _outputs(m, 2 * f, dtype, transpose, y.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(f, bk))
    _swiglu_bwd_cast_kernel[grid](g, y, amax, q, qt, scale, seen, m, f, g.stride(0), y.stride(0), q.stride(0),
                                  qt.stride(0), QMAX=FP8_MAX[dtype], TRANSPOSE=transpose, BM=bm, BK=bk,
                                  num_warps=num_warps)
    return q, scale, qt if transpose else None
