"""Fused element-wise parts of a transformer layer for the train engine (Triton): SwiGLU and packed RoPE.

Without Transformer Engine, Megatron's local layer runs these as chains of small eager kernels: SwiGLU is a
chunk, a SiLU and a multiply forward, and a SiLU backward, two multiplies and a concatenation backward; the
rotary embedding of the query and the key is a slice, two multiplies, a negation, a concatenation and an add,
each way. On micro-batches of a few thousand tokens those launches and their host-side dispatch, not the
arithmetic, bound the step. Each function here is one kernel forward and one backward, computing in fp32 and
rounding once to the input's dtype (the eager chain rounds after every operation, so bf16 results differ in the
last bit; fp32 inputs agree with the references to rounding).

    swiglu(y)              y (..., 2F) -> silu(y[..., :F]) * y[..., F:]          (the reference: `swiglu_reference`)
    rope_rotate(x, cos, sin)
                           x (T, H, D), cos/sin (T, D): x * cos + rotate_half(x) * sin, rotate_half(x) =
                           cat(-x[..., D/2:], x[..., :D/2])  (the reference: `rope_reference`; Megatron's
                           non-interleaved rotation over the whole head dimension)

Both are `torch.autograd.Function`s. Triton runs on CUDA tensors, or on CPU tensors under the Triton
interpreter (`TRITON_INTERPRET=1` set before this module is imported; slow, for tests).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; calling a kernel raises a clear error
    triton = None

__all__ = ["swiglu", "swiglu_grad", "swiglu_reference", "rope_rotate", "rope_reference", "rope_supported",
           "triton_available"]

# Columns one SwiGLU program handles (a power of two).
BLOCK_F = 1024
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_available() -> bool:
    """Whether the `triton` package imported (not whether there is a GPU)."""
    return triton is not None


def swiglu_reference(y: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half of the last dimension, eagerly (what Megatron's local MLP computes)."""
    a, b = torch.chunk(y, 2, dim=-1)
    return torch.nn.functional.silu(a) * b


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by per-token cos/sin (T, D), eagerly (Megatron's `_apply_rotary_pos_emb_bshd`)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def rope_supported(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rope_rotate` takes these shapes: x (T, H, D) with D even and D/2 a power of two, cos (T, D)."""
    d = x.size(-1)
    half = d // 2
    return (x.dim() == 3 and cos.dim() == 2 and cos.shape == (x.size(0), d) and d % 2 == 0 and half > 0
            and half & (half - 1) == 0)


if triton is not None:

    @triton.jit
    def _swiglu_fwd_kernel(y_ptr, out_ptr, F, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        a = tl.load(y_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(y_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
        out = a * tl.sigmoid(a) * b
        tl.store(out_ptr + row * F + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(g_ptr, y_ptr, dy_ptr, F, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        a = tl.load(y_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(y_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * F + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        da = g * b * sig * (1.0 + a * (1.0 - sig))
        db = g * a * sig
        tl.store(dy_ptr + row * 2 * F + cols, da.to(dy_ptr.dtype.element_ty), mask=mask)
        tl.store(dy_ptr + row * 2 * F + F + cols, db.to(dy_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, SIGN: tl.constexpr, BLOCK_H: tl.constexpr,
                     HALF: tl.constexpr):
        """Token t, all heads: out1 = x1*c1 - S*x2*s1, out2 = x2*c2 + S*x1*s2 (S = +1 forward; the backward
        is the transposed rotation: the same with S = -1 and the sine halves swapped, passed as SIGN=-1)."""
        t = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        d = tl.arange(0, HALF)
        hmask = (heads < H)[:, None]
        base = t * H * 2 * HALF + heads[:, None] * 2 * HALF + d[None, :]
        x1 = tl.load(x_ptr + base, mask=hmask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + base + HALF, mask=hmask, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + t * 2 * HALF + d).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + t * 2 * HALF + HALF + d).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + t * 2 * HALF + d).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + t * 2 * HALF + HALF + d).to(tl.float32)[None, :]
        if SIGN > 0:
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
        else:  # d/dx of the forward: dx1 = g1*c1 + g2*s2, dx2 = g2*c2 - g1*s1
            o1 = x1 * c1 + x2 * s2
            o2 = x2 * c2 - x1 * s1
        tl.store(out_ptr + base, o1.to(out_ptr.dtype.element_ty), mask=hmask)
        tl.store(out_ptr + base + HALF, o2.to(out_ptr.dtype.element_ty), mask=hmask)


def _check_runnable(t: torch.Tensor, what: str) -> None:
    if triton is None:
        raise RuntimeError(f"{what} needs the `triton` package (pip install '.[dev]' or 'triton').")
    if not t.is_cuda and not _INTERPRETED:
        raise RuntimeError(f"{what} runs on CUDA tensors (got {t.device}); on CPU use the reference, or set "
                           "TRITON_INTERPRET=1 before importing this module (tests).")


def _swiglu_grid(rows: int, f: int) -> tuple[int, int]:
    return rows, triton.cdiv(f, BLOCK_F)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        y = y.contiguous()
        f = y.size(-1) // 2
        out = torch.empty(*y.shape[:-1], f, dtype=y.dtype, device=y.device)
        rows = y.numel() // (2 * f) if f else 0
        if rows:
            _swiglu_fwd_kernel[_swiglu_grid(rows, f)](y, out, f, BLOCK=BLOCK_F)
        ctx.save_for_backward(y)
        return out

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return swiglu_grad(g, y)


def swiglu_grad(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """dL/dy (..., 2F) of `swiglu` from g = dL/d swiglu(y) (..., F), in one kernel (y contiguous)."""
    g = g.contiguous()
    f = y.size(-1) // 2
    dy = torch.empty_like(y)
    rows = y.numel() // (2 * f) if f else 0
    if rows:
        _swiglu_bwd_kernel[_swiglu_grid(rows, f)](g, y, dy, f, BLOCK=BLOCK_F)
    return dy


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(y[..., :F]) * y[..., F:] for y (..., 2F), one kernel each way (fp32 inside, y's dtype out)."""
    _check_runnable(y, "swiglu")
    if y.size(-1) % 2:
        raise ValueError(f"swiglu needs an even last dimension (the two halves of the gated projection); got "
                         f"shape {tuple(y.shape)}.")
    return _SwiGLU.apply(y)


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    t, h, d = x.shape
    out = torch.empty_like(x)
    if t and h:
        _rope_kernel[(t,)](x, cos, sin, out, h, SIGN=sign, BLOCK_H=triton.next_power_of_2(h), HALF=d // 2)
    return out


class _RopeRotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rope_launch(x.contiguous(), cos, sin, 1)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rope_launch(g.contiguous(), cos, sin, -1), None, None


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) * cos + rotate_half(x) * sin with per-token tables cos/sin (T, D) (no gradient to the
    tables); one kernel each way."""
    _check_runnable(x, "rope_rotate")
    if not rope_supported(x, cos) or sin.shape != cos.shape:
        raise ValueError(f"rope_rotate takes x (T, H, D) with D/2 a power of two and cos/sin (T, D); got x "
                         f"{tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)} (use rope_reference).")
    return _RopeRotate.apply(x, cos, sin)
