"""The FP8 weight-gradient GEMM that accumulates into main_grad (`kernels/fp8_wgrad.py`, the gradient-accumulation
fusion of the FP8 training linears) against the fp64 sum of the dequantized codes' products: under the Triton
interpreter on CPU, compiled on a GPU. Loading FP8 codes is exact in both (the interpreter's float8 issue is in the
fp32 -> fp8 cast, which this kernel does not do)."""
from __future__ import annotations

import pytest
import torch
from triton_kernels import import_kernel_module

from rlhf_mcore.kernels.fp8 import E4M3, E5M2, quantize_rows, quantize_tensor

fw = import_kernel_module("fp8_wgrad")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# ragged tiles (N, K not multiples of the blocks), T not a multiple of BLOCK_K, two groups of row tiles; on a GPU
# the shipped config too
CONFIGS = [(16, 32, 32, 2, 4, 1)] + ([fw.CONFIG] if DEVICE == "cuda" else [])
# the interpreter sums in fp32; Hopper's FP8 tensor cores sum with fewer bits between fp32 promotions (cuBLAS's own FP8
# GEMM: 1.5e-4 of the largest entry at 4,096 tokens, session 39; here 0.9-2.2e-4 with T <= 128): a wrong operand,
# scale or a lost main_grad is off by O(1) either way
TOL = 1e-5 if DEVICE == "cpu" else 1e-3


def _codes(rows: int, t: int, dtype, rowwise: bool, g) -> tuple[torch.Tensor, torch.Tensor]:
    x = (torch.randn(rows, t, generator=g) * torch.logspace(-1, 1, rows)[:, None]).to(DEVICE)
    if rowwise:
        return quantize_rows(x, dtype)
    q, s, _ = quantize_tensor(x, dtype)
    return q, s


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "x".join(map(str, c[:3])))
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("t", [96, 80])
def test_wgrad_accumulates_into_main_grad(rowwise, t, config):
    """main_grad (N, K) fp32 += scale_a * scale_b * a (N, T) @ b (K, T).T, twice (two micro-batches onto a main_grad
    that already holds values): e5m2 gradient codes times e4m3 input codes, scales per tensor or per row; within fp32
    accumulation of the exact products. Mutations (run): the epilogue storing the product without loading main_grad
    (a micro-batch overwrites the others) -> fails; the row scales applied to the wrong axis (sa along N) -> the
    rowwise cases fail."""
    g = torch.Generator().manual_seed(t)
    n, k = 70, 50
    main = torch.randn(n, k, generator=g).to(DEVICE)
    want = main.double().cpu()
    for _ in range(2):
        a, sa = _codes(n, t, E5M2, rowwise, g)
        b, sb = _codes(k, t, E4M3, rowwise, g)
        want += (a.double().cpu() * sa.double().cpu()) @ (b.double().cpu() * sb.double().cpu()).t()
        fw.launch(a, sa, b, sb, main, config)
    assert main.dtype == torch.float32
    err = (main.double().cpu() - want).abs().max().item() / want.abs().max().item()
    assert err < TOL, err


@pytest.mark.skipif(DEVICE != "cuda", reason="Hopper's FP8 accumulation needs a GPU (the interpreter sums in fp32)")
def test_wgrad_promotes_like_cublas():
    """The shipped kernel (`PROMOTE`: fp32 promotion of the tensor-core sums every 128 products) is as precise as
    cuBLAS's FP8 GEMM without fast accumulation (what the unfused FP8 training linears use) at 4,096 tokens: error
    against the fp64 sum within 1.5x of cuBLAS's (session 39, H100: both 1.0e-4 in norm; without promotion 1.1e-3).
    Mutation (run): PROMOTE = 0 (Triton's sm_90 default, fast accumulation) -> fails."""
    g = torch.Generator().manual_seed(0)
    n, k, t = 256, 384, 4096
    a, sa, _ = quantize_tensor(torch.randn(n, t, generator=g).to(DEVICE), E5M2)
    b, sb, _ = quantize_tensor(torch.randn(k, t, generator=g).to(DEVICE), E4M3)
    want = (a.double() * sa.double()) @ (b.double() * sb.double()).t()
    ours = torch.zeros(n, k, device=DEVICE)
    fw.wgrad_accumulate(a, sa, b, sb, ours)
    cublas = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    err = [((x.double() - want).norm() / want.norm()).item() for x in (ours, cublas)]
    assert err[0] < 1.5 * err[1], err


def test_wrapper_checks_shapes_and_takes_the_reference_on_cpu():
    """`wgrad_accumulate` refuses mismatched operands and scales; on CPU it adds the dequantized fp32 product."""
    g = torch.Generator().manual_seed(1)
    a, sa = quantize_tensor(torch.randn(6, 32, generator=g), E5M2)[:2]
    b, sb = quantize_tensor(torch.randn(4, 32, generator=g), E4M3)[:2]
    main = torch.ones(6, 4)
    with pytest.raises(AssertionError):
        fw.wgrad_accumulate(a, sa, b[:, :16], sb, main)
    with pytest.raises(AssertionError):
        fw.wgrad_accumulate(a, torch.ones(6, 1), b, sb, main)
    fw.wgrad_accumulate(a, sa, b, sb, main)
    want = 1 + (a.float() * sa) @ (b.float() * sb).t()
    torch.testing.assert_close(main, want)


@pytest.mark.skipif(DEVICE != "cuda", reason="cuBLASLt's FP8 GEMM needs a GPU")
@pytest.mark.parametrize("grad_dtype", [E5M2, E4M3], ids=["e5m2", "e4m3"])
def test_cublaslt_accumulates_into_main_grad(grad_dtype, monkeypatch):
    """The tensorwise recipe's fusion on a GPU is cuBLASLt's FP8 GEMM with beta = 1 (`cublaslt_fp8`, the Triton kernel
    is not called): two micro-batches added onto a main_grad that already holds values, main_grad a view 16 bytes
    past a 256-byte boundary (as Megatron's grad buffer hands out), within 1.5x the error of cuBLAS's own FP8 GEMM
    (`torch._scaled_mm`, fp32 out) + an fp32 add against the fp64 sum. Mutations (run on the device): beta = 0 (a
    micro-batch overwrites main_grad) -> fails; A and B swapped in the layouts (the product transposed) -> fails."""
    cublaslt = pytest.importorskip("rlhf_mcore.kernels.cublaslt_fp8")
    if not cublaslt.available():
        pytest.skip("cuBLASLt's FP8 GEMM is not available on this GPU (compute capability < 8.9)")
    monkeypatch.setattr(fw, "launch", lambda *a, **k: pytest.fail("the Triton kernel ran for per-tensor scales"))
    g = torch.Generator().manual_seed(3)
    n, k, t = 384, 256, 1024
    main = torch.randn(n * k + 4, generator=g).to(DEVICE)[4:].view(n, k)  # 16 bytes past the allocation's start
    ref = main.clone()
    want = main.double()
    for _ in range(2):
        a, sa, _ = quantize_tensor(torch.randn(n, t, generator=g).to(DEVICE), grad_dtype)
        b, sb, _ = quantize_tensor(torch.randn(k, t, generator=g).to(DEVICE), E4M3)
        want += (a.double() * sa.double()) @ (b.double() * sb.double()).t()
        fw.wgrad_accumulate(a, sa, b, sb, main)
        ref += torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    err = [((x.double() - want).norm() / want.norm()).item() for x in (main, ref)]
    assert err[0] < 1.5 * err[1], err


@pytest.mark.skipif(DEVICE != "cuda", reason="the cuBLASLt path needs a GPU")
def test_cublaslt_refusal_falls_back_to_the_triton_kernel(monkeypatch):
    """A shape cuBLASLt refuses before launching (no algorithm for it) accumulates through the Triton kernel with a
    warning naming the reason, not an error in the middle of a run; the sum is the same. Mutation (run): the
    `except` removed -> the CublasLtError propagates."""
    cublaslt = pytest.importorskip("rlhf_mcore.kernels.cublaslt_fp8")

    def refuse(*args, **kwargs):
        raise cublaslt.CublasLtError("no cuBLASLt FP8 algorithm (test)")

    monkeypatch.setattr(cublaslt, "available", lambda: True)
    monkeypatch.setattr(cublaslt, "scaled_mm_accumulate", refuse)
    g = torch.Generator().manual_seed(4)
    a, sa, _ = quantize_tensor(torch.randn(64, 96, generator=g).to(DEVICE), E5M2)
    b, sb, _ = quantize_tensor(torch.randn(48, 96, generator=g).to(DEVICE), E4M3)
    main = torch.zeros(64, 48, device=DEVICE)
    with pytest.warns(UserWarning, match=r"cuBLASLt refused \(no cuBLASLt FP8 algorithm \(test\)\)"):
        fw.wgrad_accumulate(a, sa, b, sb, main)
    want = (a.double() * sa.double()) @ (b.double() * sb.double()).t()
    assert ((main.double() - want).abs().max() / want.abs().max()).item() < TOL


def test_cublaslt_refuses_what_it_cannot_take_before_any_library_call():
    """`cublaslt_fp8.scaled_mm_accumulate` checks its operands before touching cuBLASLt (so these run on CPU): a
    mismatched or non-fp32 main_grad, a non-contiguous operand, per-row scales, and a token count that is not a
    multiple of 16 (cuBLASLt's FP8 alignment) are refused naming the problem; without a GPU `available()` is False.
    Mutation (run): the T % 16 check removed -> the last case reaches the library and fails otherwise."""
    from rlhf_mcore.kernels import cublaslt_fp8

    g = torch.Generator().manual_seed(2)
    a, sa = quantize_tensor(torch.randn(8, 32, generator=g), E5M2)[:2]
    b, sb = quantize_tensor(torch.randn(4, 32, generator=g), E4M3)[:2]
    main = torch.zeros(8, 4)
    cases = {(a, sa, b, sb, torch.zeros(4, 8)): r"want a \(N, T\), b \(K, T\), out \(N, K\) float32",
             (a, sa, b, sb, main.bfloat16()): r"out \(N, K\) float32",
             (a, sa, b.t().contiguous().t(), sb, main): "must be contiguous",
             (a, torch.ones(8, 1), b, sb, main): "per-tensor scales only",
             (a[:, :24].contiguous(), sa, b[:, :24].contiguous(), sb, main): r"T = 24 is not a multiple of 16"}
    for args, msg in cases.items():
        with pytest.raises(ValueError, match=msg):
            cublaslt_fp8.scaled_mm_accumulate(*args)
    if not torch.cuda.is_available():
        assert not cublaslt_fp8.available()
