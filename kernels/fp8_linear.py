"""A linear layer whose three GEMMs run in FP8 with current scaling (no Transformer Engine).

    y = x @ W.T          x per token (row), W per output channel, both e4m3
    dx = dy @ W          dy per token in `grad_dtype` (e4m3 or e5m2), W per input channel (its columns), e4m3
    dW = dy.T @ x        dy per output channel (its columns), x per input channel (its columns)

Every operand is quantized along the GEMM's output dimension, so each scale is a row-wise scale of
`torch._scaled_mm` (one per row of the left operand, one per column of the right one) and the scales factor out
of the K sum exactly. The operands are kept in their original dtype between forward and backward (re-quantized
along the other axis there, by `fp8.quantize_cols_t`, which writes the transposed codes without a bf16 transpose
copy), so activation memory is what a bf16 linear keeps; master weights, gradients and the
optimizer stay as they are (fp32 main params under Megatron's optimizer). On CPU the GEMMs are the dequantized
fp32 reference (`fp8.reference_mm`): slow, for tests only. cuBLAS wants every FP8 GEMM dim a multiple of 16: the
token rows are zero-padded (zeros add nothing to dW).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .fp8 import E4M3, E5M2, quantize_cols_t, quantize_rows, reference_mm

GRAD_DTYPES = {"e4m3": E4M3, "e5m2": E5M2}
_ALIGN = 16


def scaled_mm_rows(a: torch.Tensor, b: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """a (M, K) @ b.T for b (N, K), each quantized per row (its GEMM output dim): (M, N) in out_dtype."""
    return _mm(*quantize_rows(a, a_dtype), *quantize_rows(b, b_dtype), out_dtype)


def _mm(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype
        ) -> torch.Tensor:
    """Codes aq (M, K) @ bq.T for bq (N, K), row scales sa (M, 1) and sb (N, 1): (M, N) in out_dtype."""
    if aq.is_cuda:
        return torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb.t().contiguous(), out_dtype=out_dtype)
    return reference_mm(aq, sa, bq, sb).to(out_dtype)


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    pad = -x.shape[0] % _ALIGN
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


class Fp8LinearFunction(torch.autograd.Function):
    """y = x @ weight.T (+ bias) for x (M, K); see the module docstring. dgrad_group: all-reduce dx over it
    (a column-parallel layer's input gradient under tensor parallelism)."""

    @staticmethod
    def forward(ctx, x, weight, bias, grad_dtype, dgrad_group):
        m = x.shape[0]
        xp = _pad_rows(x)
        y = scaled_mm_rows(xp, weight, E4M3, E4M3, x.dtype)[:m]
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(xp, weight)
        ctx.m, ctx.has_bias, ctx.grad_dtype, ctx.group = m, bias is not None, grad_dtype, dgrad_group
        return y

    @staticmethod
    def backward(ctx, dy):
        xp, weight = ctx.saved_tensors
        dyp = _pad_rows(dy.contiguous())
        # dx = dy @ W: dy per token, W.T per row (W's input channels)
        dx = _mm(*quantize_rows(dyp, ctx.grad_dtype), *quantize_cols_t(weight, E4M3), xp.dtype)[:ctx.m]
        if ctx.group is not None:
            dist.all_reduce(dx, group=ctx.group)
        dw = None
        if weight.requires_grad:
            # dW = dy.T @ x: both per channel (their columns); e5m2 x e5m2 has no FP8 GEMM, x stays e4m3
            dw = _mm(*quantize_cols_t(dyp, ctx.grad_dtype), *quantize_cols_t(xp, E4M3), weight.dtype)
        db = dy.sum(0) if ctx.has_bias else None
        return dx, dw, db, None, None


def fp8_linear_train(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     grad_dtype: torch.dtype = E4M3, dgrad_group=None) -> torch.Tensor:
    """x (..., K) @ weight.T (+ bias) with FP8 GEMMs forward and backward; (..., N)."""
    lead = x.shape[:-1]
    y = Fp8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, grad_dtype, dgrad_group)
    return y.reshape(*lead, weight.shape[0])
