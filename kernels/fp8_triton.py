"""Just-in-time FP8 quantization of activations on the GPU: one Triton kernel per call (amax, scale, cast), instead
of the half dozen torch kernels of `fp8.quantize_rows` that bound an FP8 decode step (BENCHMARKS.md, "FP8").

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
