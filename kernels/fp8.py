"""FP8 (e4m3 / e5m2) quantization and the scaled GEMM, without Transformer Engine.

Two weight layouts, both with fp32 *decoding* scales (x ~= q * scale) and current (just-in-time) scaling:
  - "channel": one scale per output row of a (N, K) weight, activations one scale per token (row); the GEMM is
    `torch._scaled_mm` with row-wise scales (cuBLAS, sm >= 89);
  - "block": one scale per 128 x 128 tile of the weight (DeepSeek-V3 / veRL's layout), activations one scale per
    1 x 128 slice of a row; the GEMM is `torch.nn.functional.scaled_mm` with BlockWise1x128 x BlockWise128x128
    scales (cuBLAS >= 12.9 on Hopper).
The training linear (`fp8_linear`) also quantizes a whole tensor under one scale (`quantize_tensor`, the
"tensorwise" recipe: cuBLAS's tensor-wise scaled GEMM, and one pass that writes a tensor's codes in both layouts).
A scale is amax / FP8_MAX, so the largest magnitude of a group lands on the format's largest finite value; values
are clamped to +-FP8_MAX before the cast (saturation, never inf or nan); an all-zero group gets scale 1 and zero
codes. Round-to-nearest of e4m3 (3 mantissa bits) bounds each element's error by 2**-4 of its magnitude where
its scaled value is a normal number, and by half the subnormal step (2**-10) times the scale below that
(`error_bound`).

`reference_mm` is the GEMM's meaning: dequantize both operands to fp32 and multiply; tests hold the GPU kernels to
it. Nothing here imports the rest of rlhf_mcore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# Round-to-nearest relative error of a normal value: half an ulp = 2**-(mantissa bits + 1).
REL_ERR = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
# The smallest normal magnitude of each format (below it the spacing is fixed: SUBNORMAL_STEP).
MIN_NORMAL = {E4M3: 2.0 ** -6, E5M2: 2.0 ** -14}
SUBNORMAL_STEP = {E4M3: 2.0 ** -9, E5M2: 2.0 ** -16}
BLOCK = 128
LAYOUTS = ("channel", "block")
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) and newer


class Fp8Unsupported(ValueError):
    """FP8 cannot run here (device, GPU generation or shape); the message names the key and the fix."""


def check_fp8_device(device, key: str, value: str = "fp8") -> None:
    """Refuse FP8 where the GEMM cannot run: no CUDA device, or a GPU older than sm_89. One line, naming `key` and
    the `value` it was given."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise Fp8Unsupported(f"{key}={value} needs a CUDA GPU with FP8 tensor cores (sm >= 89: Ada, Hopper), but the "
                             f"device is {device}; unset {key} (bf16) to run here.")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        raise Fp8Unsupported(f"{key}={value} needs FP8 tensor cores (sm >= 89: Ada, Hopper), but "
                             f"{torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}; unset {key} (bf16).")


def check_block_shape(shape, what: str, key: str) -> None:
    """Refuse a weight whose dims are not multiples of the 128 x 128 block."""
    if any(d % BLOCK for d in shape):
        raise Fp8Unsupported(f"{key}: {what} has shape {tuple(shape)}, not divisible by the {BLOCK} x {BLOCK} FP8 "
                             f"block; use the per-channel layout (fp8_layout='channel') for this model.")


def _scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Decoding scale amax / FP8_MAX in fp32; all-zero groups get 1 (their codes are 0 either way)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / FP8_MAX[dtype], torch.ones_like(amax))


def _cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = FP8_MAX[dtype]
    return (x.float() / scale).clamp_(-m, m).to(dtype)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row of x (M, K): (codes (M, K) fp8, scale (M, 1) fp32). A weight's per-output-channel layout,
    an activation's per-token scaling. On CUDA one Triton kernel (fp8_triton)."""
    if x.is_cuda:
        from .fp8_triton import quantize_rows_cuda

        return quantize_rows_cuda(x, dtype)
    scale = _scale(x.abs().amax(dim=-1, keepdim=True), dtype)
    return _cast(x, scale, dtype), scale


def quantize_cols_t(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per column of x (M, K), returned as the codes of x.T: (codes (K, M), scale (K, 1)), i.e.
    `quantize_rows(x.t().contiguous())`. On CUDA two tiled Triton kernels that never write x.T in bf16."""
    if x.is_cuda:
        from .fp8_triton import quantize_cols_t_cuda

        return quantize_cols_t_cuda(x, dtype)
    return quantize_rows(x.t().contiguous(), dtype)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the whole tensor, a 0-dim tensor in x's dtype (exact: it is one of x's values). One reduction
    kernel on CUDA, no host synchronisation."""
    return torch.linalg.vector_norm(x, ord=float("inf"))


def quantize_tensor(x: torch.Tensor, dtype: torch.dtype = E4M3, amax: torch.Tensor | None = None,
                    transpose: bool = False, seen: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One scale for all of x (M, K) ("tensorwise", Transformer Engine's per-tensor scaling): (codes (M, K),
    scale (1, 1) fp32, and with `transpose` the codes of x.T (K, M), else None). The transposed codes are the same
    codes, transposed: what the backward GEMMs take. `amax` (0-dim, max |x|) when the caller has it (a weight's,
    cached between optimizer steps; delayed scaling's, from earlier steps: values beyond it saturate); else computed
    here. `seen` (one fp32 element): max |x| is folded into it (seen = max(seen, max |x|)), from the cast's own read
    (`ActivationAmaxes`). On CUDA one Triton kernel reads x once and writes both layouts."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    amax = tensor_amax(x) if amax is None else amax
    if x.is_cuda:
        from .fp8_triton import quantize_tensor_cuda

        return quantize_tensor_cuda(x, dtype, amax, transpose, seen)
    if seen is not None:
        torch.maximum(seen, tensor_amax(x).float().reshape(seen.shape), out=seen)
    scale = _scale(amax.reshape(1, 1), dtype)
    q = _cast(x, scale, dtype)
    return q, scale, q.t().contiguous() if transpose else None


def transpose_codes(q: torch.Tensor) -> torch.Tensor:
    """q.T contiguous for FP8 codes q (M, K): the codes of x.T from those of x under one scale (`quantize_tensor`'s
    transpose, without reading x again). On CUDA one tiled Triton copy."""
    if q.is_cuda:
        from .fp8_triton import transpose_codes_cuda

        return transpose_codes_cuda(q if q.stride(-1) == 1 else q.contiguous())
    return q.t().contiguous()


def quantize_blocks(w: torch.Tensor, dtype: torch.dtype = E4M3, block: int = BLOCK
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per block x block tile of w (N, K), dims multiples of `block`: (codes (N, K), scale (N/b, K/b))."""
    n, k = w.shape
    tiles = w.reshape(n // block, block, k // block, block)
    scale = _scale(tiles.abs().amax(dim=(1, 3)), dtype)  # (N/b, K/b)
    q = _cast(tiles, scale[:, None, :, None], dtype).reshape(n, k)
    return q, scale


def quantize_row_blocks(x: torch.Tensor, dtype: torch.dtype = E4M3, block: int = BLOCK
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per 1 x block slice of each row of x (M, K): (codes (M, K), scale (M, K/b)). On CUDA one Triton
    kernel, its scales outer-dim major (strides (1, M)) as the blockwise GEMM wants them."""
    if x.is_cuda and block == BLOCK:
        from .fp8_triton import quantize_row_blocks_cuda

        return quantize_row_blocks_cuda(x, dtype)
    m, k = x.shape
    groups = x.reshape(m, k // block, block)
    scale = _scale(groups.abs().amax(dim=-1), dtype)  # (M, K/b)
    return _cast(groups, scale[..., None], dtype).reshape(m, k), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of codes q (R, C) under `scale`: (R, 1) rows, (R, C/b) row slices or (R/b, C/b) tiles."""
    r, c = q.shape
    sr, sc = scale.shape
    full = scale.repeat_interleave(r // sr, dim=0).repeat_interleave(c // sc, dim=1)
    return q.float() * full


def error_bound(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """Elementwise bound on |dequantize(quantize(x)) - x|: half an ulp of the scaled value, which is
    REL_ERR * |x| for normal codes and half the subnormal step * scale below them."""
    r, c = x.shape
    sr, sc = scale.shape
    full = scale.repeat_interleave(r // sr, dim=0).repeat_interleave(c // sc, dim=1)
    return torch.maximum(x.abs().float() * REL_ERR[dtype], full * SUBNORMAL_STEP[dtype] / 2)


def reference_mm(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor
                 ) -> torch.Tensor:
    """The scaled GEMM's meaning: dequantize(a) (M, K) @ dequantize(b).T for b (N, K), in fp32 -> (M, N)."""
    return dequantize(a_q, a_scale) @ dequantize(b_q, b_scale).t()


# ------------------------------------------------------------------------------------------------ weights
@dataclass
class Fp8Weight:
    """An (N, K) linear weight in FP8: codes and fp32 scales, in one of LAYOUTS. Updated in place (`update_`), so
    CUDA graphs captured over it see the new values."""

    q: torch.Tensor         # (N, K) e4m3
    scale: torch.Tensor     # (N, 1) "channel" | (N/128, K/128) "block"
    layout: str
    mm_scale: torch.Tensor  # the same scales as the GEMM takes them: (1, N) | (L4, N/128) strides (1, L4)

    @classmethod
    def empty_like(cls, w: torch.Tensor, layout: str) -> "Fp8Weight":
        if layout not in LAYOUTS:
            raise ValueError(f"fp8 layout {layout!r}: choose one of {LAYOUTS}.")
        n, k = w.shape
        q = torch.empty(n, k, dtype=E4M3, device=w.device)
        if layout == "channel":
            scale = torch.ones(n, 1, dtype=torch.float32, device=w.device)
            return cls(q, scale, layout, scale.view(1, n))  # a view: updated with scale
        kb = k // BLOCK
        l4 = (kb + 3) // 4 * 4  # cuBLAS pads the K blocks of b's scales to a multiple of 4
        padded = torch.ones(n // BLOCK, l4, dtype=torch.float32, device=w.device)
        return cls(q, padded[:, :kb], layout, padded.t())

    def update_(self, w: torch.Tensor) -> None:
        q, s = quantize_rows(w) if self.layout == "channel" else quantize_blocks(w)
        self.q.copy_(q)
        self.scale.copy_(s)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.q, self.scale)


class Fp8Rows(NamedTuple):
    """An activation already quantized per row (by the kernel that computed it, e.g. the native engine's fused
    add+norm): what `quantize_rows` would return for it, and the dtype it had (the GEMM's output dtype)."""

    q: torch.Tensor      # (M, K) fp8 codes
    scale: torch.Tensor  # (M, 1) fp32
    dtype: torch.dtype


def fp8_linear(x: torch.Tensor | Fp8Rows, w: Fp8Weight, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (M, K) @ w.T -> (M, N) in out_dtype (x's by default) with x quantized just in time (per token for
    "channel", per 1 x 128 for "block"), or given as its per-row codes (`Fp8Rows`, "channel" only).
    CUDA: cuBLAS FP8 GEMM; elsewhere: `reference_mm` (tests)."""
    if isinstance(x, Fp8Rows):
        if w.layout != "channel":
            raise ValueError(f"per-row FP8 activations multiply per-channel weights, not {w.layout!r} ones")
        return _rows_mm(x.q, x.scale, w, bias, out_dtype or x.dtype)
    out_dtype = out_dtype or x.dtype
    if w.layout == "channel":
        return _rows_mm(*quantize_rows(x), w, bias, out_dtype)
    if x.is_cuda:
        m = x.shape[0]
        pad = -m % 16  # cuBLAS's blockwise GEMM finds no algorithm for some row counts (measured: M = 1)
        xq, xs = quantize_row_blocks(torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x)
        out = _block_mm(xq, xs, w, out_dtype)[:m]
    else:
        xq, xs = quantize_row_blocks(x)
        out = reference_mm(xq, xs, w.q, w.scale).to(out_dtype)
    return out if bias is None else out + bias


# The rollout's row-wise FP8 GEMMs accumulate in the tensor cores' own precision (cuBLAS's "fast accumulation", no
# periodic promotion to fp32), as vLLM's FP8 GEMMs and Transformer Engine's forward GEMM do: at the 7B prefill's
# 32k rows gate_up 8.51 -> 7.24 ms (1.175x) and down 4.26 -> 3.71 ms (1.15x), relative error against the fp32
# product of the same codes 1.66e-3 -> 2.06e-3 / 3.79e-3 (K = 18,944); an H100, BENCHMARKS.md session 38. The training
# linears (kernels/fp8_linear.py) keep fp32 promotion: 1-8% there.
FAST_ACCUM = True


def _rows_mm(xq: torch.Tensor, xs: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, out_dtype: torch.dtype
             ) -> torch.Tensor:
    """Per-row codes xq (M, K) with scales xs (M, 1) times a per-channel weight: cuBLAS's row-wise scaled GEMM
    (`FAST_ACCUM`)."""
    if xq.is_cuda:
        out = torch._scaled_mm(xq, w.q.t(), scale_a=xs, scale_b=w.mm_scale, out_dtype=out_dtype,
                               use_fast_accum=FAST_ACCUM)
    else:
        out = reference_mm(xq, xs, w.q, w.scale).to(out_dtype)
    return out if bias is None else out + bias


def _block_mm(xq: torch.Tensor, xs: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """1x128 x 128x128 blockwise-scaled GEMM through cuBLAS (F.scaled_mm). The scales must be outer-dim major:
    a's (M, K/128) with strides (1, M) (quantize_row_blocks on CUDA writes them so), b's (L4, N/128) with strides
    (1, L4), L4 = K/128 rounded up to 4 (Fp8Weight.mm_scale)."""
    from torch.nn.functional import ScalingType, scaled_mm

    return scaled_mm(xq, w.q.t(), xs, ScalingType.BlockWise1x128, w.mm_scale, ScalingType.BlockWise128x128,
                     output_dtype=out_dtype)
