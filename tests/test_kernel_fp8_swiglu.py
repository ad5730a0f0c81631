"""The SwiGLU kernels that write FP8 codes (`kernels/fp8_swiglu.py`, the delayed recipe's MLP) against the unfused
pair they replace: `fused_layer.swiglu` (or its backward) followed by `fp8.quantize_tensor` under the same amax.

Without CUDA they run under the Triton interpreter with fp32 outputs in place of the codes (the interpreter's float8
conversion is not the GPU's; see test_kernel_fp8_cast.py): the scaled, clamped values before the rounding must equal
the unfused pair's exactly. On a GPU the codes, their transpose, the scale and the amax are compared bit for bit.
"""
from __future__ import annotations

import pytest
import torch
from triton_kernels import import_kernel_module

from rlhf_mcore.kernels import fp8

CUDA = torch.cuda.is_available()
fs = import_kernel_module("fp8_swiglu")
fl = import_kernel_module("fused_layer")

SHAPES = [(37, 100), (64, 64), (130, 48), (1, 16)]  # (M, F): y is (M, 2F)


def _scaled_clamped(x: torch.Tensor, amax: float, qmax: float) -> torch.Tensor:
    scale = torch.tensor(amax, dtype=torch.float32) / qmax if amax > 0 else torch.tensor(1.0)
    return (x.float() / scale).clamp(-qmax, qmax)


def _inputs(m: int, f: int, device="cpu", seed=7):
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(m, 2 * f, generator=g) * 2).bfloat16().to(device)
    dh = torch.randn(m, f, generator=g).bfloat16().to(device)
    return y, dh


@pytest.mark.skipif(CUDA, reason="the interpreter's fp32 stand-in; on a GPU the next test compares the codes")
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_cast_arithmetic_under_the_interpreter(shape):
    """Forward and backward kernels with fp32 outputs: the values (and transposed values) equal the unfused pair's
    scaled, clamped values for ragged tiles, an amax below the largest value (saturation) and a zero amax (scale 1);
    the scale; the amax folded into `seen` (never lowered). Mutations (run): the forward's value not rounded to y's
    dtype before its cast -> the forward checks fail; the backward's second half stored at column c instead of
    F + c -> the backward checks fail; the backward's seen from da only -> its seen check fails."""
    m, f = shape
    y, dh = _inputs(m, f)
    h = fl.swiglu(y)
    dy = fl.swiglu_grad(dh, y)
    for want_src, cols in ((h, f), (dy, 2 * f)):
        bm, bk, _ = fs.FWD_TILES if want_src is h else fs.BWD_TILES  # the shipped tiles
        grid = (-(-m // bm), -(-f // bk))
        for amax in (want_src.float().abs().max().item(), 0.5, 0.0):
            q = torch.full((m, cols), float("nan"))
            qt = torch.full((cols, m), float("nan"))
            s = torch.empty(1, 1)
            seen = torch.tensor([0.25])
            a = torch.tensor(amax, dtype=torch.float32)
            if want_src is h:
                fs._swiglu_cast_kernel[grid](y, a, q, qt, s, seen, m, f, y.stride(0), q.stride(0), qt.stride(0),
                                             QMAX=448.0, TRANSPOSE=True, BM=bm, BK=bk)
            else:
                fs._swiglu_bwd_cast_kernel[grid](dh, y, a, q, qt, s, seen, m, f, dh.stride(0), y.stride(0),
                                                 q.stride(0), qt.stride(0), QMAX=57344.0, TRANSPOSE=True, BM=bm,
                                                 BK=bk)
            qmax = 448.0 if want_src is h else 57344.0
            want = _scaled_clamped(want_src, amax, qmax)
            assert torch.equal(q, want) and torch.equal(qt, want.t())
            assert s.item() == pytest.approx(amax / qmax if amax > 0 else 1.0, rel=1e-7)
            assert seen.item() == max(0.25, want_src.float().abs().max().item())


@pytest.mark.skipif(not CUDA, reason="FP8 codes need a GPU (the interpreter's float8 conversion differs)")
@pytest.mark.parametrize("shape", SHAPES + [(4096, 1536), (4096, 18944)])
def test_swiglu_casts_equal_the_unfused_pair_on_cuda(shape):
    """On the GPU: `swiglu_cast` and `swiglu_bwd_cast` write the codes, transposed codes and scale of
    `fused_layer.swiglu` (its backward) + `fp8.quantize_tensor` bit for bit, and fold the same amax into `seen`, under
    the tensor's own amax and under a smaller one (saturation), in both formats; without `transpose` no transposed
    codes."""
    m, f = shape
    y, dh = _inputs(m, f, "cuda")
    h, dy = fl.swiglu(y), fl.swiglu_grad(dh, y)
    for dtype in (fp8.E4M3, fp8.E5M2):
        for src, fused in ((h, lambda a, s, t, d=dtype: fs.swiglu_cast(y, d, a, s, t)),
                           (dy, lambda a, s, t, d=dtype: fs.swiglu_bwd_cast(dh, y, d, a, s, t))):
            for amax in (src.float().abs().max(), torch.tensor(0.5, device="cuda")):
                seen_f, seen_u = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
                q, s, qt = fused(amax, seen_f, True)
                qu, su, qtu = fp8.quantize_tensor(src, dtype, amax=amax, transpose=True, seen=seen_u)
                assert torch.equal(q.view(torch.uint8), qu.view(torch.uint8))
                assert torch.equal(qt.view(torch.uint8), qtu.view(torch.uint8))
                assert torch.equal(s, su) and torch.equal(seen_f, seen_u)
                assert fused(amax, torch.zeros(1, device="cuda"), False)[2] is None
