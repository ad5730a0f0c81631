"""Just-in-time FP8 quantization of activations on the GPU: one Triton kernel per call (amax, scale, cast), instead
of the half dozen torch kernels of `fp8.quantize_rows` that bound an FP8 decode step (BENCHMARKS.md, "FP8").
`quantize_tensor_cuda` casts a tensor under one scale and can write its codes transposed from the same read (the
tensorwise training recipe), and fold the tensor's max |x| into a running amax there (the delayed recipe).
`quantize_cols_t_cuda` quantizes the columns of x into the codes of x.T (the FP8 training linear's backward operands) in
two tiled kernels -- column amax, then scaled cast with a transposed store -- instead of a bf16 transpose copy and a row
quantization of it (that copy measured 0.3 TB/s).

Same meaning as the torch functions in :mod:`.fp8` (scale = amax / FP8_MAX, 1 for an all-zero group, values
clamped to +-FP8_MAX), up to the last bit of the division.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import BLOCK, FP8_MAX


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, G, stride_xm, stride_qm, stride_sm, stride_sg, QMAX: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    """Program (row, group): the G contiguous values of `group` in `row`, in BLOCK_C chunks (two passes)."""
    row, grp = tl.program_id(0), tl.program_id(1)
    x_row = x_ptr + row * stride_xm + grp * G
    q_row = q_ptr + row * stride_qm + grp * G
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, G, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        v = tl.load(x_row + cols, mask=cols < G, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(v))
    amax = tl.max(acc, axis=0)
    scale = tl.where(amax > 0, amax / QMAX, 1.0)
    for start in range(0, G, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        mask = cols < G
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(v / scale, -QMAX), QMAX)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + grp * stride_sg, scale)


def _launch(x: torch.Tensor, dtype: torch.dtype, group: int, scale: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    q = torch.empty(m, k, dtype=dtype, device=x.device)
    block_c = min(1024, triton.next_power_of_2(group))
    _quant_groups_kernel[(m, k // group)](x, q, scale, group, x.stride(0), q.stride(0), scale.stride(0),
                                          scale.stride(1), QMAX=FP8_MAX[dtype], BLOCK_C=block_c)
    return q


def quantize_rows_cuda(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row codes (M, K) and scales (M, 1), as `fp8.quantize_rows`."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    return _launch(x, dtype, x.shape[1], scale), scale


def quantize_row_blocks_cuda(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 1 x 128 codes (M, K) and scales (M, K/128) laid out outer-dim major (strides (1, M)), the layout
    cuBLAS's blockwise GEMM takes."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    scale = torch.empty(k // BLOCK, m, dtype=torch.float32, device=x.device).t()  # (M, K/128), strides (1, M)
    return _launch(x, dtype, BLOCK, scale), scale


@triton.jit
def _col_amax_kernel(x_ptr, amax_ptr, M, K, stride_xm, BM: tl.constexpr, BK: tl.constexpr):
    """Program (row block, column block): the tile's column amax, folded into amax (K,) by atomic max (>= 0)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    v = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr + cols, tl.max(tl.abs(v), axis=0), mask=cols < K)


@triton.jit
def _col_cast_t_kernel(x_ptr, amax_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qk, QMAX: tl.constexpr,
                       BM: tl.constexpr, BK: tl.constexpr):
    """Program (row block, column block): codes of the tile under its columns' scales, stored transposed into q
    (K, M); the first row block writes the scales."""
    pid_m = tl.program_id(0)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    amax = tl.load(amax_ptr + cols, mask=cols < K, other=0.0)
    scale = tl.where(amax > 0, amax / QMAX, 1.0)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    v = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(v / scale[None, :], -QMAX), QMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + cols[:, None] * stride_qk + rows[None, :], tl.trans(q), mask=tl.trans(mask))
    if pid_m == 0:
        tl.store(s_ptr + cols, scale, mask=cols < K)


def quantize_cols_t_cuda(x: torch.Tensor, dtype: torch.dtype, bm: int = 64, bk: int = 64
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (K, M) and scales (K, 1) of x.T (M, K) quantized per row, as `fp8.quantize_rows(x.t().contiguous())`,
    without materializing x.T."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    amax = torch.zeros(k, dtype=torch.float32, device=x.device)
    q = torch.empty(k, m, dtype=dtype, device=x.device)
    scale = torch.empty(k, 1, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    _col_amax_kernel[grid](x, amax, m, k, x.stride(0), BM=bm, BK=bk)
    _col_cast_t_kernel[grid](x, amax, q, scale, m, k, x.stride(0), q.stride(0), QMAX=FP8_MAX[dtype], BM=bm, BK=bk)
    return q, scale


@triton.jit
def _tensor_cast_kernel(x_ptr, amax_ptr, q_ptr, qt_ptr, s_ptr, seen_ptr, M, K, stride_xm, stride_qm, stride_qtk,
                        QMAX: tl.constexpr, TRANSPOSE: tl.constexpr, LOAD_T: tl.constexpr, SEEN: tl.constexpr,
                        BM: tl.constexpr, BK: tl.constexpr):
    """Program (row block, column block): the tile's codes under the one scale amax / QMAX, stored as they lie in q
    (M, K) and, with TRANSPOSE, transposed in qt (K, M); program (0, 0) writes the scale. With SEEN the tile's
    max |x| is folded into seen (one fp32) by atomic max: delayed scaling's amax of this tensor, from the same read."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    amax = tl.load(amax_ptr).to(tl.float32)
    scale = tl.where(amax > 0, tl.div_rn(amax, QMAX), 1.0)  # IEEE division: torch's codes, bit for bit
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    v = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    qf = tl.minimum(tl.maximum(tl.div_rn(v, scale), -QMAX), QMAX)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], qf.to(q_ptr.dtype.element_ty), mask=mask)
    if SEEN:
        tl.atomic_max(seen_ptr, tl.max(tl.max(tl.abs(v), axis=1), axis=0))
    if TRANSPOSE:
        if LOAD_T:  # read the tile again as x.T: tl.trans of an fp32 tile's codes wrote wrong bytes (H100, triton 3.6)
            mt = (cols[:, None] < K) & (rows[None, :] < M)
            vt = tl.load(x_ptr + rows[None, :] * stride_xm + cols[:, None], mask=mt, other=0.0).to(tl.float32)
            qt = tl.minimum(tl.maximum(tl.div_rn(vt, scale), -QMAX), QMAX).to(qt_ptr.dtype.element_ty)
            tl.store(qt_ptr + cols[:, None] * stride_qtk + rows[None, :], qt, mask=mt)
        else:
            tl.store(qt_ptr + cols[:, None] * stride_qtk + rows[None, :], tl.trans(qf.to(qt_ptr.dtype.element_ty)),
                     mask=tl.trans(mask))
    if (pid_m == 0) & (pid_k == 0):
        tl.store(s_ptr, scale)


def quantize_tensor_cuda(x: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor, transpose: bool,
                         seen: torch.Tensor | None = None, bm: int = 64, bk: int = 64
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes (M, K) of x (contiguous rows) under one scale from `amax` (0-dim, any float dtype, on x's device),
    the scale (1, 1), and with `transpose` the codes of x.T (K, M) from the same read, as `fp8.quantize_tensor`.
    `seen` (one fp32 element, >= 0): max |x| folded into it (atomic max), as `fp8.quantize_tensor`'s."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=dtype, device=x.device)
    qt = torch.empty(k, m, dtype=dtype, device=x.device) if transpose else q  # q: an unused pointer
    scale = torch.empty(1, 1, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    _tensor_cast_kernel[grid](x, amax, q, qt, scale, scale if seen is None else seen, m, k, x.stride(0),
                              q.stride(0), qt.stride(0), QMAX=FP8_MAX[dtype], TRANSPOSE=transpose,
                              LOAD_T=x.element_size() > 2, SEEN=seen is not None, BM=bm, BK=bk)
    return q, scale, qt if transpose else None


@triton.jit
def _transpose_kernel(q_ptr, qt_ptr, M, K, stride_qm, stride_qtk, BM: tl.constexpr, BK: tl.constexpr):
    """Program (row block, column block): the tile of q (M, K) stored transposed in qt (K, M), bytes as they are."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    v = tl.load(q_ptr + rows[:, None] * stride_qm + cols[None, :], mask=mask, other=0)
    tl.store(qt_ptr + cols[:, None] * stride_qtk + rows[None, :], tl.trans(v), mask=tl.trans(mask))


def transpose_codes_cuda(q: torch.Tensor, bm: int = 64, bk: int = 128) -> torch.Tensor:
    """q.T (K, M) contiguous for FP8 codes q (M, K) with contiguous rows: one tiled copy of the bytes (read 1 byte
    and write 1 an element, against 2 + 2 to cast x.T again from bf16). At the 7B weights on an H100 (session 40) the
    64 x 128 tiles moved 1.9-2.7 TB/s (a byte clone 1.8-2.9; 64 x 64 1.7-2.4; torch's strided copy 4x slower), the
    gate_up weight's transpose 100 us against 244 to cast it again with its transpose."""
    m, k = q.shape
    qt = torch.empty(k, m, dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    _transpose_kernel[grid](q.view(torch.uint8), qt.view(torch.uint8), m, k, q.stride(0), qt.stride(0), BM=bm, BK=bk)
    return qt
