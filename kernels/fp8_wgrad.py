"""The FP8 weight-gradient GEMM that accumulates into the parameter's fp32 `main_grad`: the gradient-accumulation
fusion (`override_transformer_config.gradient_accumulation_fusion`) for the FP8 training linears.

Without it an FP8 linear's weight gradient is a bf16 tensor per micro-batch (`torch._scaled_mm`), which Megatron's
DDP hook then adds into the fp32 `main_grad`: one more kernel per parameter and micro-batch reading both. That add was
58 ms of a 646 ms FP8 update at the 7B width in 10 layers (an H100, BENCHMARKS.md session 38), and the bf16 update
removes it with cuBLAS accumulating into `main_grad` (`rlhf_mcore.models.grad_accum_fusion`). `torch._scaled_mm` has
no accumulating form, so

    main_grad (N, K) fp32 += scale_a * scale_b * (a (N, T) @ b (K, T).T)

runs as cuBLASLt's FP8 GEMM with beta = 1 for per-tensor scales (the tensorwise recipe: `cublaslt_fp8.py`), and as the
Triton GEMM below, whose epilogue adds into `main_grad`, for per-row scales (the rowwise recipe; cuBLASLt's per-tensor
scale pointers cannot carry them).

a, b: FP8 codes, row-major with the token dim T contiguous (the transposed codes the FP8 linears keep for their
backward); scales one per tensor ((1, 1)) or one per row of each ((N, 1) and (K, 1)). On a CPU the same sum from
`fp8.reference_mm` (tests).

Measured on an H100 at the 7B wgrad shapes (4,096 tokens; the four GEMMs of a layer, all at cuBLAS's precision: 1.0e-4
relative error against the fp64 sum): cuBLASLt with beta = 1 1.72 ms, cuBLAS + the add 2.38 ms, this Triton kernel 2.74
ms (session 40; with fp32 promotion every 128 products, `PROMOTE`; without it 2.16 ms at ten times the error, session
39). In the update (the 7B width in 10 layers, one call, session 40) FP8 with the fusion on cuBLASLt 26,870 tokens/s
against 25,571 without it (1.05x); with the Triton kernel the fusion had been no faster (session 39).
"""
from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl

from . import cublaslt_fp8
from .fp8 import reference_mm

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): the fastest of session 39's sweep with PROMOTE = 128
# (H100, the 7B shapes; 128 x 128 within 1%, 128 x 256 tiles 2x slower with promotion)
CONFIG = (256, 128, 128, 8, 8, 4)
# fp32 promotion of the FP8 tensor-core sums every PROMOTE products along T (Triton's max_num_imprecise_acc, at most
# BLOCK_K); 0: Triton's sm_90 default, no promotion (fast accumulation, ten times the error). The training GEMMs keep
# cuBLAS's promotion (fp8.py), so this one does too.
PROMOTE = 128
# per-tensor scales (the tensorwise recipe) go to cuBLASLt's FP8 GEMM with beta = 1 (`cublaslt_fp8`) where it loads;
# False: this kernel for both recipes
CUBLASLT = True


@triton.jit
def _wgrad_accum_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                        ROW_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PROMOTE: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of c += sa * sb * a @ b.T over the whole K; tiles ordered in groups of GROUP_M
    row tiles so that a group's programs share their b tiles in L2."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
    pid_n = (pid % (GROUP_M * tiles_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask, nmask = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs + k0, mask=mmask[:, None], other=0.0)
            b = tl.load(b_ptrs + k0, mask=nmask[:, None], other=0.0)
        else:
            kmask = (k0 + offs_k) < K
            a = tl.load(a_ptrs + k0, mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs + k0, mask=nmask[:, None] & kmask[None, :], other=0.0)
        if PROMOTE > 0:
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=PROMOTE)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if ROW_SCALES:
        acc *= tl.load(sa_ptr + offs_m, mask=mmask, other=0.0)[:, None]
        acc *= tl.load(sb_ptr + offs_n, mask=nmask, other=0.0)[None, :]
    else:
        acc *= tl.load(sa_ptr) * tl.load(sb_ptr)
    cmask = mmask[:, None] & nmask[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, tl.load(c_ptrs, mask=cmask, other=0.0) + acc, mask=cmask)


def wgrad_accumulate(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
                     main_grad: torch.Tensor) -> None:
    """main_grad (N, K) fp32 += scale_a * scale_b * a (N, T) @ b (K, T).T, in place: FP8 codes a, b (T contiguous);
    scales both (1, 1) (per tensor) or (N, 1) and (K, 1) (per row)."""
    n, t = a.shape
    k = b.shape[0]
    assert b.shape[1] == t and main_grad.shape == (n, k) and main_grad.dtype == torch.float32, (
        a.shape, b.shape, main_grad.shape, main_grad.dtype)
    rows = scale_a.numel() != 1
    assert (scale_a.numel(), scale_b.numel()) == ((n, k) if rows else (1, 1)), (scale_a.shape, scale_b.shape)
    if not a.is_cuda:
        main_grad += reference_mm(a, scale_a.reshape(-1, 1), b, scale_b.reshape(-1, 1))
        return
    if not rows and CUBLASLT and cublaslt_fp8.available():
        try:
            cublaslt_fp8.scaled_mm_accumulate(a, scale_a, b, scale_b, main_grad)
            return
        except cublaslt_fp8.CublasLtError as e:  # refused before launch (no algorithm for a shape or alignment)
            _warn_fallback(str(e))
    launch(a, scale_a, b, scale_b, main_grad)


@functools.lru_cache(maxsize=None)
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"FP8 weight gradient: cuBLASLt refused ({reason}); this shape accumulates through the Triton "
                  "kernel instead (same sums, slower)", stacklevel=3)


def launch(a, scale_a, b, scale_b, main_grad, config: tuple | None = None, promote: int | None = None) -> None:
    """The kernel itself (`wgrad_accumulate` without its CPU path: the interpreter tests call this)."""
    n, t = a.shape
    k = b.shape[0]
    assert a.stride(1) == 1 and b.stride(1) == 1 and main_grad.stride(1) == 1
    bm, bn, bk, group, warps, stages = config or CONFIG
    promote = min(bk, PROMOTE if promote is None else promote)
    grid = (triton.cdiv(n, bm) * triton.cdiv(k, bn),)
    _wgrad_accum_kernel[grid](a, b, main_grad, scale_a.reshape(-1).float(), scale_b.reshape(-1).float(), n, k, t,
                              a.stride(0), b.stride(0), main_grad.stride(0), ROW_SCALES=scale_a.numel() != 1,
                              BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, EVEN_K=t % bk == 0,
                              PROMOTE=promote, num_warps=warps, num_stages=stages)
