"""cuBLASLt's FP8 GEMM with beta = 1, called through ctypes: `out (N, K) fp32 += scale_a * scale_b * a (N, T) @ b (K,
T).T` for per-tensor scales, accumulated by the GEMM's own epilogue (Transformer Engine's FP8 weight-gradient
accumulation into `main_grad`, without Transformer Engine).

`torch._scaled_mm` calls the same cuBLASLt FP8 GEMM but always with beta = 0, so an FP8 weight gradient costs a
temporary and an add (`main_grad += grad`: 12 bytes a parameter read or written per micro-batch, 58 ms of a 646 ms
update at the 7B width in 10 layers, BENCHMARKS.md session 38) and the Triton kernel that fuses the add
(`fp8_wgrad.py`) is slower than cuBLAS at equal precision (session 39). cuBLASLt takes the fp32 `main_grad` as C and D
with beta = 1 (FP8 A and B, fp32 C/D and scale: a combination its documentation lists), so the add rides in the epilogue
of the fastest GEMM there is. Precision as `torch._scaled_mm` without fast accumulation (fp32 promotion:
`FAST_ACCUM`).

No headers or compiler are needed: the library is the one torch loaded (found in the process's mappings), the enum
values are cublasLt.h's (cuBLAS 12 and 13 share them), the heuristic's result is a plain struct. One handle per
process, a 32 MiB workspace per device, the chosen algorithm cached per (shape, dtypes, pointer alignment).

Layout: cuBLASLt is column-major and its FP8 GEMM wants "TN" (both operands K-contiguous). The row-major
out (N, K) is the column-major (K, N) D = op(A) @ op(B) with A := b (its rows of T: column-major (T, K), transposed)
and B := a (column-major (T, N)), so b's scale is A's and a's is B's. T must be a multiple of 16 (the FP8 linears pad
their token rows) and every pointer 16-byte aligned (the alignment actually found is given to the heuristic).
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch

# cudaDataType_t, cublasComputeType_t (library_types.h, cublas_api.h)
_CUDA_TYPE = {torch.float32: 0, torch.bfloat16: 14, torch.float8_e4m3fn: 28, torch.float8_e5m2: 29}
_COMPUTE_32F = 68
# cublasLtMatmulDescAttributes_t, cublasLtMatmulPreferenceAttributes_t, cublasOperation_t (cublasLt.h)
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = {"A": 5, "B": 6, "C": 7, "D": 8}
_OP_N, _OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20
# 0: fp32 promotion of the tensor cores' sums (cuBLAS's precision without fast accumulation, as the FP8 training
# GEMMs in fp8_linear.py run); 1: fast accumulation
FAST_ACCUM = 0


class _Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: the algorithm (cublasLtMatmulAlgo_t, 8 x uint64), its workspace, status."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


def _check(status: int, call: str) -> None:
    if status != 0:
        raise CublasLtError(f"{call} returned cublasStatus {status}")


def _library_path() -> str:
    """The libcublasLt torch mapped into this process (after one cuBLAS call), else the loader's search."""
    torch.cuda.current_blas_handle()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libcublasLt.so"):
                return path
    return "libcublasLt.so"


@lru_cache(maxsize=1)
def _lt():
    """(library, handle) of this process; CublasLtError where the library cannot be loaded."""
    try:
        lib = ctypes.CDLL(_library_path())
    except OSError as e:
        raise CublasLtError(f"libcublasLt could not be loaded: {e}") from e
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    for name, args in (("cublasLtCreate", [ctypes.POINTER(vp)]),
                       ("cublasLtMatmulDescCreate", [ctypes.POINTER(vp), i32, i32]),
                       ("cublasLtMatmulDescSetAttribute", [vp, i32, vp, ctypes.c_size_t]),
                       ("cublasLtMatrixLayoutCreate", [ctypes.POINTER(vp), i32, ctypes.c_uint64, ctypes.c_uint64,
                                                       ctypes.c_int64]),
                       ("cublasLtMatmulPreferenceCreate", [ctypes.POINTER(vp)]),
                       ("cublasLtMatmulPreferenceSetAttribute", [vp, i32, vp, ctypes.c_size_t]),
                       ("cublasLtMatmulAlgoGetHeuristic", [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_Heuristic),
                                                           ctypes.POINTER(i32)]),
                       ("cublasLtMatmul", [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.c_size_t,
                                           vp])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i32
    handle = vp()
    _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return lib, handle


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether cuBLASLt's FP8 GEMM can be called here (CUDA, compute capability >= 8.9, the library loads); decided
    once per process (a failed load is not retried at every GEMM)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        return False
    try:
        _lt()
    except CublasLtError:
        return False
    return True


@lru_cache(maxsize=None)
def _workspace(device_index: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", device_index))


def _alignment(ptr: int) -> int:
    """The largest power of two <= 256 dividing the address (what the heuristic may assume)."""
    return min(256, ptr & -ptr) if ptr else 256


def _set(set_attr, obj, attr: int, value) -> None:
    _check(set_attr(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"set attribute {attr}")


@lru_cache(maxsize=None)
def _plan(t: int, n: int, k: int, a_dtype: torch.dtype, b_dtype: torch.dtype, aligns: tuple[int, int, int]):
    """The descriptors and the heuristic's first algorithm for one shape (kept for the process: a handful of shapes
    per model)."""
    lib, handle = _lt()
    vp = ctypes.c_void_p
    desc = vp()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _CUDA_TYPE[torch.float32]),
           "cublasLtMatmulDescCreate")
    _set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
    _set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
    _set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_FAST_ACCUM, ctypes.c_int8(FAST_ACCUM))

    def layout(dtype, rows, cols, ld):
        lay = vp()
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), _CUDA_TYPE[dtype], rows, cols, ld),
               "cublasLtMatrixLayoutCreate")
        return lay

    a_lay = layout(b_dtype, t, k, t)  # cuBLASLt's A: b's codes
    b_lay = layout(a_dtype, t, n, t)  # cuBLASLt's B: a's codes
    d_lay = layout(torch.float32, k, n, k)
    pref = vp()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
    _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(WORKSPACE_BYTES))
    for name, align in zip(("A", "B", "C"), aligns):
        _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MIN_ALIGNMENT[name], ctypes.c_uint32(align))
    _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MIN_ALIGNMENT["D"], ctypes.c_uint32(aligns[2]))
    result, count = _Heuristic(), ctypes.c_int(0)
    _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, a_lay, b_lay, d_lay, d_lay, pref, 1, ctypes.byref(result),
                                              ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
    if count.value < 1:
        raise CublasLtError(f"no cuBLASLt FP8 algorithm for ({n} x {t}) @ ({k} x {t}).T in {a_dtype} x {b_dtype} "
                            f"accumulating into fp32 (alignments {aligns})")
    return desc, a_lay, b_lay, d_lay, result


def scaled_mm_accumulate(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
                         out: torch.Tensor) -> None:
    """out (N, K) fp32 += scale_a * scale_b * a (N, T) @ b (K, T).T in one cuBLASLt GEMM (beta = 1), on the current
    stream. a, b: FP8 codes, row-major (T contiguous), T a multiple of 16; scales fp32 one element each (device)."""
    n, t = a.shape
    k = b.shape[0]
    if b.shape[1] != t or out.shape != (n, k) or out.dtype != torch.float32:
        raise ValueError(f"scaled_mm_accumulate: a {tuple(a.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)} "
                         f"{out.dtype}: want a (N, T), b (K, T), out (N, K) float32")
    if a.stride(1) != 1 or b.stride(1) != 1 or out.stride(1) != 1 or a.stride(0) != t or b.stride(0) != t \
            or out.stride(0) != k:
        raise ValueError("scaled_mm_accumulate: a, b and out must be contiguous")
    if scale_a.numel() != 1 or scale_b.numel() != 1:
        raise ValueError("scaled_mm_accumulate takes per-tensor scales only")
    if t % 16:
        raise ValueError(f"scaled_mm_accumulate: T = {t} is not a multiple of 16 (pad the token rows)")
    sa, sb = scale_a.reshape(1).float().contiguous(), scale_b.reshape(1).float().contiguous()
    lib, handle = _lt()
    aligns = (_alignment(b.data_ptr()), _alignment(a.data_ptr()), _alignment(out.data_ptr()))
    desc, a_lay, b_lay, d_lay, plan = _plan(t, n, k, a.dtype, b.dtype, aligns)
    vp = ctypes.c_void_p
    # the scale pointers are per call (a descriptor attribute): set on the cached descriptor before each launch,
    # which is safe because the launch reads them when it is enqueued
    _set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_A_SCALE_POINTER, vp(sb.data_ptr()))
    _set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_B_SCALE_POINTER, vp(sa.data_ptr()))
    one = ctypes.c_float(1.0)
    ws = _workspace(out.device.index if out.device.index is not None else torch.cuda.current_device())
    _check(lib.cublasLtMatmul(handle, desc, ctypes.byref(one), vp(b.data_ptr()), a_lay, vp(a.data_ptr()), b_lay,
                              ctypes.byref(one), vp(out.data_ptr()), d_lay, vp(out.data_ptr()), d_lay,
                              ctypes.byref(plan.algo), vp(ws.data_ptr()), WORKSPACE_BYTES,
                              vp(torch.cuda.current_stream(out.device).cuda_stream)), "cublasLtMatmul")
