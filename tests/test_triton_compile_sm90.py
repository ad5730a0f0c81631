"""The native engine's decode kernels compiled for a Hopper GPU (sm_90) on the CPU, without a device.

The interpreter tests (tests/test_rollout_native.py) run the kernels' Python; what only the compiler sees goes
untested there: a branch on a constexpr that does not type-check, values of one variable with two types in the two
arms of a runtime branch, a launch configuration (warps, stages, block sizes) that the MLIR passes, LLVM or ptxas
refuse. Here Triton's own pipeline (front end, TTIR, TTGIR, LLVM IR, PTX, then the ptxas the Triton wheel ships)
compiles them for sm_90 at the configurations the engine launches them with, in CI, which has no GPU. Whether a
compiled kernel is fast or right still needs the GPU (tests/test_rollout_native_gpu.py)."""
from __future__ import annotations

import inspect
import json
import subprocess
import sys
import traceback

import pytest
from subprocess_env import child_env

triton = pytest.importorskip("triton")

try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401  (the NVIDIA backend is in this wheel)
    from triton.compiler import ASTSource
except ImportError as exc:  # pragma: no cover - a Triton build without the NVIDIA backend
    pytest.skip(f"Triton's NVIDIA backend is not importable here ({exc})", allow_module_level=True)

HOPPER = GPUTarget("cuda", 90, 32)
tk = None  # rlhf_mcore.rollout.native.triton_kernels, imported in the child (`_compile_all`)


def compile_sm90(kernel, types: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 3):
    """`kernel` compiled for sm_90: `types` names each runtime argument's Triton type ("*bf16", "i32", "fp32", ...;
    arguments left out are 32-bit integers), `constexprs` each compile-time one's value (a parameter with a default
    that neither names keeps its default). Returns the compiled kernel (its `asm` holds ptx and cubin)."""
    params = inspect.signature(kernel.fn).parameters
    sig, consts = {}, {}
    for i, (name, p) in enumerate(params.items()):
        if name in constexprs:
            sig[name], consts[(i,)] = "constexpr", constexprs[name]
        elif name in types:
            sig[name] = types[name]
        elif p.default is not inspect.Parameter.empty:  # an optional argument left at its default
            sig[name], consts[(i,)] = "constexpr", p.default
        else:
            sig[name] = "i32"
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
    return triton.compile(src, target=HOPPER, options={"num_warps": num_warps, "num_stages": num_stages})


def _assert_compiled(compiled, *, name: str):
    cubin = compiled.asm.get("cubin", b"")
    assert len(cubin) > 1000, f"{name}: no sm_90 binary came out"
    assert ".target sm_90" in compiled.asm["ptx"], f"{name}: the PTX is not for sm_90"


def sampler():
    """Both stages of the fused sampler at a 152k vocabulary's launch (blocks of 2048, 64 chunk slots, the pick on 8
    warps: `sample_fused`)."""
    ptr = {"logits_ptr": "*bf16", "inv_temp_ptr": "*fp32", "greedy_ptr": "*i8", "part_ptr": "*fp32",
           "keys_ptr": "*i64", "steps_ptr": "*i64", "tok_ptr": "*i64", "lp_ptr": "*fp32"}
    chunk = compile_sm90(tk._sample_chunk_kernel, ptr, dict(NCHUNK=64, BLOCK=2048, PDL=False), num_warps=4)
    _assert_compiled(chunk, name="_sample_chunk_kernel")
    pick = compile_sm90(tk._sample_pick_kernel, ptr, dict(NCHUNK=64, BLOCK=2048, PDL=True), num_warps=8)
    _assert_compiled(pick, name="_sample_pick_kernel")


def attention(heads_fastest: bool):
    """The decode attention's split kernel at the 0.5B shape's launch (7 query heads a kv head, 64 dims, 64 keys a
    block, 4 warps, 3 stages) in both program orders, one split (the result written) and four (partials, with
    their merge kernel), and over an FP8 cache."""
    ptr = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "slots_ptr": "*i64", "lens_ptr": "*i64",
           "src_ptr": "*i64", "shared_ptr": "*i64", "po_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32",
           "out_ptr": "*bf16", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "sm_scale": "fp32"}
    for nsplit, kv_fp8 in ((1, False), (4, False), (1, True)):
        types = dict(ptr, **({"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"} if kv_fp8 else {}))
        split = compile_sm90(tk._attn_split_kernel, types,
                             dict(G=7, NSPLIT=nsplit, BLOCK_G=16, BLOCK_N=64, D=64, IEEE=False, HAS_SRC=nsplit == 4,
                                  PDL=False, KV_FP8=kv_fp8, HEADS_FASTEST=heads_fastest))
        _assert_compiled(split, name=f"_attn_split_kernel nsplit={nsplit} fp8={kv_fp8}")
    merge = compile_sm90(tk._attn_combine_kernel, ptr, dict(G=7, NSPLIT=4, BLOCK_G=16, D=64, PDL=False))
    _assert_compiled(merge, name="_attn_combine_kernel")


def layer():
    """The layer's other decode kernels at the 0.5B shape's 256-row launches (`linear_config`, `qkv_rope_cache`):
    o/down as K-split fp32 partials and the add + RMSNorm that sums them, gate_up with silu * up in the epilogue,
    FP8-coded weights (w8a16) and FP8 x FP8 products with the row amax epilogue, the QKV projection with RoPE and the
    cache write (bf16 and FP8 caches), and the separate silu * up."""
    gemm = {"a_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "ws_ptr": "*fp32", "out_ptr": "*fp32"}
    flags = dict(HAS_BIAS=False, SILU_MUL=False, W_SCALED=False, M_FASTEST=False, IEEE=False, PDL=False)
    launches = {  # name: (types, constexprs, warps, stages)
        "down, 4 K splits": (gemm, dict(flags, SPLIT_K=4, EVEN_K=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64), 4, 4),
        "gate_up, silu * up": (dict(gemm, out_ptr="*bf16"), dict(flags, SILU_MUL=True, SPLIT_K=1, EVEN_K=True,
                                                                 BLOCK_M=64, BLOCK_N=64, BLOCK_K=128), 4, 3),
        "w8a16": (dict(gemm, w_ptr="*fp8e4nv", out_ptr="*bf16"), dict(flags, W_SCALED=True, M_FASTEST=True,
                                                                        SPLIT_K=1, EVEN_K=False, BLOCK_M=64,
                                                                        BLOCK_N=32, BLOCK_K=128), 4, 4),
        "w8a8, row amax": (dict(gemm, a_ptr="*fp8e4nv", w_ptr="*fp8e4nv", out_ptr="*bf16", as_ptr="*fp32",
                                amax_ptr="*fp32"),
                           dict(flags, W_SCALED=True, A_SCALED=True, ROW_AMAX=True, SPLIT_K=1, EVEN_K=True,
                                BLOCK_M=128, BLOCK_N=64, BLOCK_K=128), 8, 3),
    }
    for name, (types, consts, warps, stages) in launches.items():
        _assert_compiled(compile_sm90(tk._linear_kernel, types, consts, warps, stages), name=f"_linear_kernel {name}")
    norm = {"x_ptr": "*bf16", "delta_ptr": "*fp32", "w_ptr": "*bf16", "h_ptr": "*bf16", "eps": "fp32"}
    _assert_compiled(compile_sm90(tk._add_rms_norm_kernel, norm, dict(HAS_DELTA=True, NSPLIT=4, BLOCK=1024,
                                                                      PDL=False)), name="_add_rms_norm_kernel")
    _assert_compiled(compile_sm90(tk._silu_mul_kernel, {"gu_ptr": "*bf16", "out_ptr": "*bf16"},
                                  dict(BLOCK=1024, PDL=False)), name="_silu_mul_kernel")
    qkv = {"a_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "ws_ptr": "*fp32", "pos_ptr": "*i64",
           "slot_ptr": "*i64", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "q_out_ptr": "*bf16", "k_cache_ptr": "*bf16",
           "v_cache_ptr": "*bf16", "qn_ptr": "*bf16", "kn_ptr": "*bf16", "eps": "fp32"}
    for kv_fp8 in (False, True):
        types = dict(qkv, **({"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "ks_ptr": "*fp32",
                              "vs_ptr": "*fp32", "stride_ss": "i32", "stride_sl": "i32"} if kv_fp8 else {}))
        consts = dict(HQ=14, HKV=2, HALF=32, BLOCK_H=32, HAS_BIAS=True, W_SCALED=False, QK_NORM=False, BLOCK_M=64,
                      BLOCK_K=128, EVEN_K=True, IEEE=False, PDL=False, KV_FP8=kv_fp8)
        _assert_compiled(compile_sm90(tk._qkv_rope_cache_kernel, types, consts, 4, 4),
                         name=f"_qkv_rope_cache_kernel fp8 cache={kv_fp8}")


GROUPS = {"sampler": sampler, "attention_rows_fastest": lambda: attention(False),
          "attention_heads_fastest": lambda: attention(True), "layer": layer}


def _compile_all() -> dict[str, str]:
    """In a child with TRITON_INTERPRET=0 (the suite's other files set it to 1 in this process before the kernels are
    defined, and interpreted kernels cannot be compiled): each group's failure text, "" where it compiled."""
    global tk
    from rlhf_mcore.rollout.native import triton_kernels

    tk = triton_kernels
    out = {}
    for name, group in GROUPS.items():
        try:
            group()
            out[name] = ""
        except Exception:  # noqa: BLE001 - reported by the test of that group
            out[name] = traceback.format_exc()[-4000:]
    return out


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    proc = subprocess.run([sys.executable, __file__, "--compile"], env=child_env(TRITON_INTERPRET="0"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sampler_kernels_compile_at_the_engine_launch(compiled):
    """`sampler` above. Mutation: the greedy arm of the pick's runtime branch giving `tok` as int64 while the sampled
    arm gives int32 (the interpreter runs it) -> the compiler refuses it and this test fails."""
    assert not compiled["sampler"], compiled["sampler"]


@pytest.mark.parametrize("order", ["rows_fastest", "heads_fastest"])
def test_decode_attention_kernels_compile_in_either_program_order(compiled, order):
    """`attention` above, in each program order."""
    assert not compiled[f"attention_{order}"], compiled[f"attention_{order}"]


def test_decode_layer_kernels_compile_at_the_engine_launch(compiled):
    """`layer` above. Mutation: `_linear_kernel`'s up accumulator started as int32 (a loop-carried value that changes
    type) -> the compiler refuses gate_up and this test fails."""
    assert not compiled["layer"], compiled["layer"]


if __name__ == "__main__" and sys.argv[1:] == ["--compile"]:
    print(json.dumps(_compile_all()))
