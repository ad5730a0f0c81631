"""The tensorwise FP8 cast kernel (`kernels/fp8_triton.py: _tensor_cast_kernel`, behind `fp8.quantize_tensor` on
CUDA) against the torch path.

Without CUDA it runs under the Triton interpreter, whose float8 conversion is not the GPU's (it rounds some ties
the other way and maps a few values to the wrong code), so there the kernel writes fp32 instead of FP8 codes: the
scaled, clamped values before the rounding, which are the kernel's own arithmetic (scale from the amax, division,
saturation, the row-major store and the transposed one, the masks of ragged tiles) and must equal torch's exactly.
On a GPU the codes themselves are compared bit for bit (the same fp32 division, then the hardware's round to
nearest).
"""
from __future__ import annotations

import pytest
import torch
from triton_kernels import import_kernel_module

from rlhf_mcore.kernels import fp8

CUDA = torch.cuda.is_available()
ft = import_kernel_module("fp8_triton")

SHAPES = [(37, 200), (64, 128), (130, 96), (1, 16)]


def _scaled_clamped(x: torch.Tensor, amax: float, qmax: float) -> torch.Tensor:
    """x / (amax / qmax) clamped, the scale divided in fp32 as the kernel (and fp8._scale) divide it."""
    scale = torch.tensor(amax, dtype=torch.float32) / qmax if amax > 0 else torch.tensor(1.0)
    return (x.float() / scale).clamp(-qmax, qmax)


@pytest.mark.skipif(CUDA, reason="the interpreter's fp32 stand-in; on a GPU the next test compares the codes")
@pytest.mark.parametrize("load_t", [False, True], ids=["trans", "load_t"])
@pytest.mark.parametrize("shape", SHAPES)
def test_cast_kernel_arithmetic_under_the_interpreter(shape, load_t):
    """The kernel with fp32 outputs: values and transposed values equal torch's x / scale clamped to +-QMAX, the
    scale amax / QMAX, for ragged tiles, an amax below the largest value (saturation) and a zero tensor (scale
    1); both ways of writing the transpose (tl.trans of the tile, and the second read as x.T that fp32 inputs take
    on CUDA). With SEEN the tile maxima of |x| fold into `seen` by atomic max (delayed scaling's amax from the
    cast's own read). Mutations: the scale without / QMAX -> all 4 fail; the transposed store's mask not transposed
    -> it stores out of bounds on the ragged shapes (the interpreter's process crashed); the atomic max of only the
    first row of each tile -> the seen check fails."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=g).bfloat16() * 3
    for amax, qmax in ((x.float().abs().max().item(), 448.0), (1.0, 448.0), (2.5, 57344.0)):
        for t in (x, torch.zeros_like(x)):
            a = amax if t is x else 0.0
            m, k = t.shape
            q = torch.full((m, k), float("nan"))
            qt = torch.full((k, m), float("nan"))
            s = torch.empty(1, 1)
            seen = torch.tensor([0.25])  # delayed scaling's running max |x|: folded in, never lowered
            grid = (-(-m // 64), -(-k // 64))
            ft._tensor_cast_kernel[grid](t, torch.tensor(a, dtype=torch.bfloat16), q, qt, s, seen, m, k,
                                         t.stride(0), q.stride(0), qt.stride(0), QMAX=qmax, TRANSPOSE=True,
                                         LOAD_T=load_t, SEEN=True, BM=64, BK=64)
            want = _scaled_clamped(t, a, qmax)
            assert torch.equal(q, want) and torch.equal(qt, want.t())
            assert s.item() == pytest.approx(a / qmax if a > 0 else 1.0, rel=1e-7)
            assert seen.item() == max(0.25, t.float().abs().max().item())


@pytest.mark.skipif(not CUDA, reason="FP8 codes need a GPU (the interpreter's float8 conversion differs)")
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES + [(4096, 1536)])
def test_cast_kernel_codes_on_cuda(shape, src):
    """`fp8.quantize_tensor` on CUDA against the CPU path on the same bf16 or fp32 values and amax, both formats: the
    scale bit for bit (IEEE division in both); the transposed codes exactly the codes transposed; the codes within
    the rounding bound of torch's (both divide IEEE and round to nearest, so they should be equal: the share that is
    is printed; a conversion through fp16 on some GPU would double-round a few); without `transpose` no
    transposed codes."""
    x = (torch.randn(*shape, device="cuda") * 3).to(src)
    for dtype in (fp8.E4M3, fp8.E5M2):
        q, s, qt = fp8.quantize_tensor(x, dtype, transpose=True)
        qc, sc, _ = fp8.quantize_tensor(x.cpu(), dtype, transpose=True)
        assert torch.equal(s.cpu(), sc)
        assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
        d = (fp8.dequantize(q.cpu(), s.cpu()) - fp8.dequantize(qc, sc)).abs()
        assert bool((d <= 2 * fp8.error_bound(x.cpu().float(), sc, dtype) + 1e-12).all())
        same = (q.cpu().view(torch.uint8) == qc.view(torch.uint8)).float().mean().item()
        print(f"{shape} {dtype}: {same:.6f} of the codes equal torch's")
        assert fp8.quantize_tensor(x, dtype)[2] is None
        seen = torch.zeros(1, device="cuda")  # delayed scaling: max |x| from the cast's read, under another amax
        q2, s2, _ = fp8.quantize_tensor(x, dtype, amax=torch.tensor(1.0, device="cuda"), seen=seen)
        want = fp8.quantize_tensor(x.cpu(), dtype, amax=torch.tensor(1.0))  # the scale of amax 1 (fp32), the codes
        assert seen.item() == x.float().abs().max().item() and torch.equal(s2.cpu(), want[1])
        assert (q2.cpu().view(torch.uint8) == want[0].view(torch.uint8)).float().mean().item() > 0.999


@pytest.mark.parametrize("tiles", [(64, 128), (16, 32)], ids=["shipped", "small_tiles"])
@pytest.mark.parametrize("shape", SHAPES)
def test_transpose_codes_kernel_equals_torch(shape, tiles):
    """`transpose_codes_cuda` (the tiled byte copy behind `fp8.transpose_codes`, the weight cache's "forward" mode)
    writes q.T bit for bit, ragged tiles included (under the interpreter on CPU: loading and storing FP8 bytes is
    exact there). Mutation (run): the store's mask not transposed -> the ragged shapes fail or write out of
    bounds."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=g) * 3
    q, _, _ = fp8.quantize_tensor(x, fp8.E4M3)
    q = q.to("cuda" if CUDA else "cpu")
    qt = ft.transpose_codes_cuda(q, *tiles)
    assert qt.shape == (shape[1], shape[0]) and qt.is_contiguous()
    assert torch.equal(qt.view(torch.uint8).cpu(), q.t().contiguous().view(torch.uint8).cpu())
