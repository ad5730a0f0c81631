"""The delayed recipe's SwiGLU MLP as one autograd Function: fc1, SwiGLU and fc2 with FP8 GEMMs, where the SwiGLU
kernel writes fc2's input as FP8 codes and its backward writes fc1's output gradient as FP8 codes (`fp8_swiglu`).

    y = x @ W1.T             (M, 2F) bf16     x cast at fc1's x site
    h = silu(y1) * y2        (M, F)  codes    written by the SwiGLU kernel under fc2's x site's scale
    out = h @ W2.T           (M, H)
    backward:
    dh = dout @ W2; dW2 = dout.T @ h          dout cast at fc2's dy site
    dy = swiglu'(y) . dh     (M, 2F) codes    written by the SwiGLU backward kernel under fc1's dy site's scale
    dx = dy @ W1; dW1 = dy.T @ x

Only delayed scaling allows this: a current-scaling cast needs the tensor's amax before its first code, which is a
read of the whole tensor after the kernel that produced it. Everything else is the two delayed
`Fp8TensorwiseLinearFunction`s around the activation: the same sites in the same order, the same kept weight codes,
the same weight-gradient fusion, the same codes bit for bit (the SwiGLU kernels round each value to y's dtype before
casting it). A site without a history yet (its first cast ever primes it with current scaling), an activation other
than the Triton one (Megatron's eager glu: CPU models, `fused_kernels` off), fp32 models or CPU tensors take the
unfused way through the same Function: the activation's output in y's dtype, then `ActivationAmaxes.quantize`.

Saved for the backward: x.T's and h.T's codes, y (bf16) and the weights' transposed codes: what the unfused layers
save. Rows are zero-padded to a multiple of 16 once, at the input (zero rows stay zero through SwiGLU).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from .fp8 import E4M3
from .fp8_linear import DelayedSites, WeightAmax, _accumulated, _mm_tensorwise, _pad_rows
from .fused_layer import swiglu_reference


class LinearState(NamedTuple):
    """One FP8 linear's state between calls: its weight's amax (and kept codes) and its two delayed sites."""
    weight_amax: WeightAmax
    sites: DelayedSites


class SwiGLU(NamedTuple):
    """An implementation of the MLP's activation: forward(y) -> h, backward(g, y) -> dL/dy, and whether its kernels
    can write their outputs as FP8 codes themselves (`fp8_swiglu`, on CUDA)."""
    forward: Callable[[torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    producer_casts: bool


def _eager_grad(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        y = y.detach().requires_grad_()
        (dy,) = torch.autograd.grad(swiglu_reference(y), y, g)
    return dy


def _triton_swiglu(y: torch.Tensor) -> torch.Tensor:
    from .fused_layer import swiglu

    return swiglu(y)


def _triton_grad(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    from .fused_layer import swiglu_grad

    return swiglu_grad(g, y)


# Megatron's eager gated SiLU (`silu(a) * b`, each op rounded to the input's dtype), its backward by autograd
EAGER_SWIGLU = SwiGLU(swiglu_reference, _eager_grad, False)
# `fused_layer.swiglu` (fp32 inside, rounded once): on CUDA the producer casts write the FP8 codes directly
TRITON_SWIGLU = SwiGLU(_triton_swiglu, _triton_grad, True)


def _producer_scale(act, t: torch.Tensor, sites: DelayedSites, site: int):
    """The site's (amax, seen) when the activation's kernel can write the codes itself, else None. 16-bit y only:
    the kernels store the transposed codes with `tl.trans`, which wrote wrong bytes from fp32 tiles in the cast
    kernel (H100, triton 3.6: `fp8_triton._tensor_cast_kernel`'s LOAD_T), so fp32 models take the unfused casts."""
    ok = act.producer_casts and t.is_cuda and t.element_size() == 2
    return sites.amaxes.scale_of(site) if ok else None


def _h_codes(act, y: torch.Tensor, sites: DelayedSites, transpose: bool) -> tuple:
    """Codes of swiglu(y) at fc2's x site (`sites`: fc2's), with their transpose if `transpose`."""
    scale = _producer_scale(act, y, sites, sites.x)
    if scale is None:
        return sites.amaxes.quantize(sites.x, act.forward(y), E4M3, transpose)
    from .fp8_swiglu import swiglu_cast

    return swiglu_cast(y, E4M3, *scale, transpose)


def _dy_codes(act, dh: torch.Tensor, y: torch.Tensor, sites: DelayedSites, dtype: torch.dtype, transpose: bool
              ) -> tuple:
    """Codes of dL/dy at fc1's dy site (`sites`: fc1's), with their transpose if `transpose`."""
    scale = _producer_scale(act, y, sites, sites.dy)
    if scale is None:
        return sites.amaxes.quantize(sites.dy, act.backward(dh, y), dtype, transpose)
    from .fp8_swiglu import swiglu_bwd_cast

    return swiglu_bwd_cast(dh, y, dtype, *scale, transpose)


class Fp8SwiGLUMLPFunction(torch.autograd.Function):
    """fc2(swiglu(fc1(x))) for x (M, H), weights w1 (2F, H) and w2 (H, F); see the module docstring. fc1, fc2: their
    `LinearState`s; act: `EAGER_SWIGLU` or `TRITON_SWIGLU`; dgrad_group: all-reduce dx over it (fc1 is
    column-parallel); backward: whether autograd will call backward; fuse_wgrad: weight gradients accumulate into
    `main_grad` (`fp8_linear._accumulated`)."""

    @staticmethod
    def forward(ctx, x, w1, w2, fc1, fc2, act, grad_dtype, dgrad_group, backward, fuse_wgrad=False):
        m = x.shape[0]
        xp = _pad_rows(x)
        xq, xs, xq_t = fc1.sites.amaxes.quantize(fc1.sites.x, xp, E4M3, backward)
        w1q, w1s, w1q_t = fc1.weight_amax.codes(w1, transpose=backward)
        y = _mm_tensorwise(xq, xs, w1q, w1s, x.dtype)
        hq, hs, hq_t = _h_codes(act, y, fc2.sites, backward)
        w2q, w2s, w2q_t = fc2.weight_amax.codes(w2, transpose=backward)
        out = _mm_tensorwise(hq, hs, w2q, w2s, x.dtype)[:m]
        if backward:
            ctx.save_for_backward(xq_t, xs, w1q_t, w1s, y, hq_t, hs, w2q_t, w2s)
            ctx.fc1, ctx.fc2, ctx.act, ctx.grad_dtype, ctx.group = fc1, fc2, act, grad_dtype, dgrad_group
            ctx.m, ctx.x_dtype = m, x.dtype
            ctx.needs, ctx.w_dtypes = (w1.requires_grad, w2.requires_grad), (w1.dtype, w2.dtype)
            ctx.weights = tuple(w if fuse_wgrad and w.requires_grad else None for w in (w1, w2))  # for main_grad
        return out

    @staticmethod
    def backward(ctx, dout):
        xq_t, xs, w1q_t, w1s, y, hq_t, hs, w2q_t, w2s = ctx.saved_tensors
        (w1, w2), (need_w1, need_w2) = ctx.weights, ctx.needs
        fc1, fc2 = ctx.fc1, ctx.fc2
        dop = _pad_rows(dout.contiguous())
        doq, dos, doq_t = fc2.sites.amaxes.quantize(fc2.sites.dy, dop, ctx.grad_dtype, need_w2)
        dh = _mm_tensorwise(doq, dos, w2q_t, w2s, ctx.x_dtype)
        dw2 = _wgrad(w2, need_w2, (doq_t, dos, hq_t, hs), ctx.x_dtype, ctx.w_dtypes[1])
        dyq, dys, dyq_t = _dy_codes(ctx.act, dh, y, fc1.sites, ctx.grad_dtype, need_w1)
        dx = _mm_tensorwise(dyq, dys, w1q_t, w1s, ctx.x_dtype)[:ctx.m]
        if ctx.group is not None:
            dist.all_reduce(dx, group=ctx.group)
        dw1 = _wgrad(w1, need_w1, (dyq_t, dys, xq_t, xs), ctx.x_dtype, ctx.w_dtypes[0])
        return dx, dw1, dw2, None, None, None, None, None, None, None


def _wgrad(fused_weight: torch.Tensor | None, needed: bool, operands: tuple, x_dtype: torch.dtype,
           w_dtype: torch.dtype):
    """dW = dy.T @ x from the codes and scales in `operands`, as `Fp8TensorwiseLinearFunction` returns it: under
    the fusion accumulated into the weight's main_grad, else in the weight's dtype."""
    if not needed:
        return None
    if fused_weight is not None:
        return _accumulated(fused_weight, operands, x_dtype)
    return _mm_tensorwise(*operands, w_dtype)


def fp8_swiglu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, fc1: LinearState, fc2: LinearState,
                   act: SwiGLU = TRITON_SWIGLU, grad_dtype: torch.dtype = E4M3, dgrad_group=None,
                   fuse_wgrad: bool = False) -> torch.Tensor:
    """fc2(swiglu(fc1(x))) for x (..., H) with FP8 GEMMs under the delayed recipe; (..., H_out). fc1 and fc2 hold
    the two linears' kept weight amaxes and their sites of one `ActivationAmaxes`."""
    lead = x.shape[:-1]
    backward = torch.is_grad_enabled() and (x.requires_grad or w1.requires_grad or w2.requires_grad)
    out = Fp8SwiGLUMLPFunction.apply(x.reshape(-1, x.shape[-1]), w1, w2, fc1, fc2, act, grad_dtype, dgrad_group,
                                     backward, fuse_wgrad)
    return out.reshape(*lead, w2.shape[0])
