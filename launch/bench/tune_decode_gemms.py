"""Tile configurations of the native engine's decode-step GEMMs, timed at given batch sizes on one GPU.

    python launch/bench/tune_decode_gemms.py [--rows 256 512] [--vocab 8192] [--e2e-batch 512] [--out FILE.json]
    python launch/bench/tune_decode_gemms.py --shape 7b --rows 64 256 [--fp8-weights] [--gemms down gate_up]
                                             [--tp 2] --e2e-batch 0   # another shape; FP8 candidates; some GEMMs
                                             # only; one TP rank's share of the weights
    python launch/bench/tune_decode_gemms.py --tiny     # CPU smoke run of the plumbing (no timing)

For each layer GEMM of the Qwen2.5-0.5B (or `--shape`) decode step, with what consumes it, and its attention:
  - qkv: `qkv_rope_cache` (the projection, RoPE and the cache write in one kernel);
  - o_proj and down_proj: `linear` (K-split fp32 partials allowed) + the `add_rms_norm` that sums them, against
    cuBLAS (`F.linear`) + the same norm on its bf16 output;
  - gate_up: `linear(silu_mul=True)` against cuBLAS + `silu_mul`;
  - attention: `decode_attention` over contexts of 128-384 tokens, by keys a block, warps, stages, splits and
    program order (rows or kv heads fastest);
with `--fp8-weights` the Triton candidates read e4m3 codes with per-row scales (the engine's `fp8_decode="w8a16"`),
the "a8" candidates quantize the activation per row first and multiply FP8 x FP8 in the same Triton GEMM, and
"cublas" is cuBLAS's row-wise FP8 GEMM after the per-token activation quantization ("w8a8"); the bf16 cuBLAS
product is timed beside them as "cublas_bf16". It times a grid of tile sizes, K splits, warps and stages (CUDA-graph
replays, `triton.testing.do_bench_cudagraph`; programmatic dependent launch off, so each kernel is timed alone),
checks every candidate against the fp32 product (a wrong configuration is reported and never chosen), and prints the
fastest per shape and row count.

Then, end to end: one generate at `--e2e-batch` rows (prompt 128, 256 new tokens, TRL's GRPO decode) with the
engine's own choices and with the fastest found patched in (`triton_kernels.linear_config`, `qkv_rope_cache`'s
tiles, the attention's `attention_config` and splits, and cuBLAS for o/down or gate_up where it won), each in a
fresh engine, decode ms per step of both. What wins goes into `linear_config`, `attention_config` / the row
thresholds of `model.py` by hand, with the figures in BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_shapes import TINY, git_commit, random_model_dir  # noqa: E402
from bench_shapes import shape as shape_of  # noqa: E402

TOL = 2e-2  # max |candidate - fp32 product| / max |fp32 product| a bf16 GEMM must stay inside
TOL_W8A8 = 0.1  # the same for cuBLAS's FP8 GEMM, whose activations are quantized too (e4m3 per token)


def _time_ms(fn, cuda: bool) -> float:
    if not cuda:
        fn()
        return float("nan")
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=20))


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def linear_grid(silu: bool, split_ok: bool, tiny: bool, rows: int = 256, k: int = 896, fp8: bool = False):
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) candidates for `rows` x `k` activations. Row
    tiles above `rows` are left out; K of 2,048 and more (1.5B and up) also try 4 and 8 splits, FP8 codes K
    blocks of 128 and 256 (one byte a value), and without silu 3 and 4 stages at K blocks of 128 (4 won the FP8 down
    at 256 rows, session 36)."""
    if tiny:
        return [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=split, num_warps=4, num_stages=2)
                for split in ((1, 2) if split_ok else (1,))]
    out = []
    bks = (128, 256) if fp8 else (64, 128) if silu else (64,)
    splits = (1, 2, 4, 8) if k >= 2048 else (1, 2)
    for bm, bn, bk, warps in itertools.product((64, 128), (32, 64, 128), bks, (4, 8)):
        if bm * bn >= 128 * 128 and warps == 4 or silu and bn == 128 and bm == 128:
            continue  # register-starved or (silu: two accumulators) over the shared-memory budget
        if bm > max(64, rows) or fp8 and bk == 256 and bm * bn > 64 * 64:
            continue  # no rows for the tile; over the shared-memory budget
        stages = (3, 4) if fp8 and bk == 128 and not silu else (3,) if silu or bk == 128 else (4,)
        for split, st in itertools.product(splits if split_ok else (1,), stages):
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=st))
    return out


def tune_shapes(shape: dict, rows_list: list[int], device, dtype, tiny: bool, fp8: bool = False,
                skip_attention: bool = False, gemms: tuple[str, ...] = ("o_proj", "down", "gate_up", "qkv"),
                families: tuple[str, ...] = ("w8a16", "a8"), tp: int = 1, kv_fp8: bool = False) -> dict:
    from rlhf_mcore.kernels.fp8 import Fp8Weight, fp8_linear
    from rlhf_mcore.rollout.native import triton_kernels as tk
    from rlhf_mcore.rollout.native.model import FUSED_SILU_MAX_ROWS
    from rlhf_mcore.rollout.native.rope import rope_tables

    cuda = device.type == "cuda"
    D, inter = shape["hidden_size"], shape["intermediate_size"]
    H, Hkv = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = D // H
    if any(v % tp for v in (H, Hkv, inter)):
        raise SystemExit(f"--tp {tp}: the heads ({H}, {Hkv} KV) and the MLP width ({inter}) must divide by it")
    H, Hkv, inter = H // tp, Hkv // tp, inter // tp  # one TP rank's share, as the engine shards them (weights.py)
    split_ok = tp == 1  # under TP the engine's o_proj / down sum whole products (the all-reduce wants the sum)
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype)

    w_o, w_down = rnd(D, H * hd, scale=0.02), rnd(D, inter, scale=0.02)
    w_gu, w_qkv, b_qkv = rnd(2 * inter, D, scale=0.02), rnd((H + 2 * Hkv) * hd, D, scale=0.02), rnd((H + 2 * Hkv) * hd)
    norm_w = rnd(D, scale=0.1) + 1
    q8 = {}  # FP8 copies (codes, per-row scales, the cuBLAS w8a8 weight) and their dequantized values
    if fp8:
        for name, w in (("o_proj", w_o), ("down", w_down), ("gate_up", w_gu), ("qkv", w_qkv)):
            fw = Fp8Weight.empty_like(w, "channel")
            fw.update_(w)
            q8[name] = (fw.q, fw.scale.reshape(-1), fw, fw.dequantize().to(dtype))
    results: dict = {}
    for rows in rows_list:
        res = results[rows] = {}
        resid = rnd(rows, D)
        for name, w, k in (("o_proj", w_o, H * hd), ("down", w_down, inter)):
            if name not in gemms:
                continue
            x = rnd(rows, k)
            wq, ws, fw, wd = q8.get(name, (w, None, None, w))
            ref = x.float() @ wd.float().T
            cands = {}
            for cfg in linear_grid(False, split_ok, tiny, rows, k, fp8) if not fp8 or "w8a16" in families else ():
                label = "triton " + ",".join(f"{v}" for v in cfg.values())
                try:
                    out = tk.linear(x, wq, allow_split=split_ok, config=cfg, w_scale=ws)
                    got = out.sum(0) if out.dim() == 3 else out
                    err = _rel_err(got, ref)

                    gemm = functools.partial(tk.linear, x, wq, allow_split=split_ok, config=cfg, w_scale=ws)
                    cands[label] = {"ms": _time_ms(_then_norm(gemm, resid, norm_w), cuda), "err": err, "cfg": cfg}
                except Exception as e:  # a tile the compiler refuses (shared memory, registers)
                    cands[label] = {"ms": float("inf"), "err": None, "error": f"{type(e).__name__}"}

            for cfg in linear_grid(False, split_ok, tiny, rows, k, fp8) if fp8 and "a8" in families else ():
                label = "a8 " + ",".join(f"{v}" for v in cfg.values())
                gemm = functools.partial(_a8_linear, x, wq, ws, cfg, allow_split=split_ok)
                try:
                    out = gemm()
                    err = _rel_err(out.sum(0) if out.dim() == 3 else out, ref)
                    cands[label] = {"ms": _time_ms(_then_norm(gemm, resid, norm_w), cuda), "err": err, "cfg": cfg,
                                    "tol": TOL_W8A8}
                except Exception as e:
                    cands[label] = {"ms": float("inf"), "err": None, "error": f"{type(e).__name__}"}
            cublas = functools.partial(fp8_linear, x, fw) if fp8 else functools.partial(F.linear, x, w)
            cands["cublas"] = {"ms": _time_ms(_then_norm(cublas, resid, norm_w), cuda), "err": _rel_err(cublas(), ref),
                               "cfg": None, **({"tol": TOL_W8A8} if fp8 else {})}
            if fp8:
                cands["cublas_bf16"] = {"ms": _time_ms(_then_norm(functools.partial(F.linear, x, w), resid, norm_w),
                                                       cuda), "err": None, "cfg": None}
            default = functools.partial(tk.linear, x, wq, allow_split=split_ok, w_scale=ws)
            cands["default"] = {"ms": _time_ms(_then_norm(default, resid, norm_w), cuda), "err": None,
                                "cfg": tk.linear_config(rows, D, k, allow_split=split_ok, fp8_weight=fp8)}
            res[name] = cands
            _report(rows, name, cands)
        x = rnd(rows, D)
        if "gate_up" in gemms:
            wq, ws, fw, wd = q8.get("gate_up", (w_gu, None, None, w_gu))
            ref = x.float() @ wd.float().T
            ref = F.silu(ref[:, :inter]) * ref[:, inter:]
            cands = {}
            for cfg in linear_grid(True, False, tiny, rows, D, fp8) if not fp8 or "w8a16" in families else ():
                label = "triton " + ",".join(f"{v}" for v in cfg.values())
                try:
                    err = _rel_err(tk.linear(x, wq, silu_mul=True, config=cfg, w_scale=ws), ref)
                    cands[label] = {"ms": _time_ms(functools.partial(tk.linear, x, wq, silu_mul=True, config=cfg,
                                                                     w_scale=ws), cuda), "err": err, "cfg": cfg}
                except Exception as e:
                    cands[label] = {"ms": float("inf"), "err": None, "error": f"{type(e).__name__}"}
            for cfg in linear_grid(True, False, tiny, rows, D, fp8) if fp8 and "a8" in families else ():  # FP8 x FP8
                label = "a8 " + ",".join(f"{v}" for v in cfg.values())
                gemm = functools.partial(_a8_linear, x, wq, ws, cfg, silu_mul=True)
                try:
                    cands[label] = {"ms": _time_ms(gemm, cuda), "err": _rel_err(gemm(), ref), "cfg": cfg,
                                    "tol": TOL_W8A8}
                except Exception as e:
                    cands[label] = {"ms": float("inf"), "err": None, "error": f"{type(e).__name__}"}
            if fp8:
                w8a8 = functools.partial(_w8a8_silu, x, fw)
                cands["cublas"] = {"ms": _time_ms(w8a8, cuda), "err": _rel_err(w8a8(), ref), "cfg": None,
                                   "tol": TOL_W8A8}
                cands["cublas_bf16"] = {"ms": _time_ms(functools.partial(_cublas_silu, x, w_gu), cuda), "err": None,
                                        "cfg": None}
            else:
                cands["cublas"] = {"ms": _time_ms(functools.partial(_cublas_silu, x, w_gu), cuda),
                                   "err": _rel_err(tk.silu_mul(F.linear(x, w_gu)), ref), "cfg": None}
            if fp8 or rows <= FUSED_SILU_MAX_ROWS:  # what the engine runs: the fused Triton GEMM, else cuBLAS + silu
                fused = functools.partial(tk.linear, x, wq, silu_mul=True, w_scale=ws)
                cands["default"] = {"ms": _time_ms(fused, cuda), "err": None,
                                    "cfg": tk.linear_config(rows, inter, D, True, fp8_weight=fp8)}
            else:
                cands["default"] = {**cands["cublas"], "err": None}
            res["gate_up"] = cands
            _report(rows, "gate_up", cands)
        if "qkv" in gemms:
            # qkv + rope + cache write
            max_len = 512
            cos, sin = rope_tables(torch.full((hd // 2,), 1e-2), max_len, device, dtype)
            k_cache = torch.zeros(rows + 1, max_len, Hkv, hd, device=device, dtype=dtype)
            v_cache = torch.zeros_like(k_cache)
            positions = torch.randint(0, max_len, (rows,), generator=g).to(device)
            slots = torch.arange(rows, device=device)
            cands = {}
            ref_q = None
            wq, ws, fw, wd = q8.get("qkv", (w_qkv, None, None, w_qkv))
            bks = (128, 256) if fp8 else (64, 128)
            head_splits = [hs for hs in (1, 2, 4) if hd // 2 // hs >= 16]
            for bm, bk, warps, hs in itertools.product(*(((16,), (32,), (4,), (1,)) if tiny else
                                                         ((32, 64, 128), bks, (4, 8), head_splits))):
                if bm > max(32, rows):
                    continue
                label = f"triton {bm},{bk},{warps},{hs}"
                kw = dict(block_m=bm, block_k=bk, num_warps=warps, num_stages=3 if bk >= 128 else 4, w_scale=ws,
                          head_split=hs)
                try:
                    q = tk.qkv_rope_cache(x, wq, b_qkv, positions, slots, cos, sin, k_cache, v_cache, H, Hkv, **kw)
                    ref_q = q if ref_q is None else ref_q
                    err = _rel_err(q, ref_q.float())
                    cands[label] = {"ms": _time_ms(functools.partial(
                        tk.qkv_rope_cache, x, wq, b_qkv, positions, slots, cos, sin, k_cache, v_cache, H, Hkv, **kw),
                        cuda), "err": err, "cfg": {k: v for k, v in kw.items() if k != "w_scale"}}
                except Exception as e:
                    cands[label] = {"ms": float("inf"), "err": None, "error": f"{type(e).__name__}"}
            default = functools.partial(tk.qkv_rope_cache, x, wq, b_qkv, positions, slots, cos, sin, k_cache,
                                        v_cache, H, Hkv, w_scale=ws)
            cands["default"] = {"ms": _time_ms(default, cuda), "err": None, "cfg": None}
            cands["cublas_bf16"] = {"ms": _time_ms(functools.partial(F.linear, x, w_qkv, b_qkv), cuda), "err": None,
                                    "cfg": None}  # the projection alone (no RoPE, no cache write): a yardstick
            res["qkv"] = cands
            _report(rows, "qkv", cands)
        if not skip_attention:
            res["attention"] = tune_attention(rows, H, Hkv, hd, rnd, device, tiny, kv_fp8)
            _report(rows, "attention", res["attention"])
    return results


def attention_grid(tiny: bool):
    """(BLOCK_N, num_warps, num_stages, splits, heads_fastest) candidates of the decode attention; heads_fastest:
    the split kernel's program order (`_attn_split_kernel`'s HEADS_FASTEST: a row's kv heads, whose keys and values
    interleave in the cache, read by neighbouring programs), both orders timed."""
    if tiny:
        return [(16, 4, 2, 1, False), (16, 4, 2, 2, False), (16, 4, 2, 2, True)]
    return list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), (1, 2), (False, True)))


def tune_attention(rows: int, H: int, Hkv: int, hd: int, rnd, device, tiny: bool, kv_fp8: bool = False) -> dict:
    """`decode_attention` over a cache like TRL's GRPO decode (contexts of 128 + 0..256 tokens, one slot a row),
    each candidate checked against the fp32 reference. kv_fp8: the cache holds e4m3 codes and a scale per token and
    head (the engine's kv_cache_dtype="fp8_e4m3"); the reference reads them dequantized."""
    from rlhf_mcore.rollout.native import triton_kernels as tk
    from rlhf_mcore.rollout.native.attention import decode_attention_torch

    cuda = device.type == "cuda"
    max_len = 24 if tiny else 392
    k_cache, v_cache = rnd(rows + 1, max_len, Hkv, hd), rnd(rows + 1, max_len, Hkv, hd)
    fp8 = {}
    if kv_fp8:
        from rlhf_mcore.rollout.native.kv_cache import dequantize_kv, quantize_kv

        (k_cache, ks), (v_cache, vs) = quantize_kv(k_cache), quantize_kv(v_cache)
        fp8 = {"k_scale": ks, "v_scale": vs}
    q = rnd(rows, H, hd)
    g = torch.Generator().manual_seed(1)
    lo = max_len // 3
    lens = torch.randint(lo, max_len + 1, (rows,), generator=g).to(device)
    slots = torch.randperm(rows, generator=g).to(device)
    scale = hd ** -0.5
    kd, vd = ((dequantize_kv(k_cache, ks, torch.float32), dequantize_kv(v_cache, vs, torch.float32)) if kv_fp8 else
              (k_cache.float(), v_cache.float()))
    ref = decode_attention_torch(q.float(), kd, vd, slots, lens, scale, max_len)
    cands = {}
    for bn, warps, stages, splits, heads_fastest in attention_grid(tiny):
        cfg = dict(BLOCK_N=bn, num_warps=warps, num_stages=stages, HEADS_FASTEST=heads_fastest)
        label = f"triton {bn},{warps},{stages},{splits}" + (",heads" if heads_fastest else "")
        try:
            err = _rel_err(tk.decode_attention(q, k_cache, v_cache, slots, lens, scale, splits, config=cfg, **fp8),
                           ref)
            cands[label] = {"ms": _time_ms(functools.partial(tk.decode_attention, q, k_cache, v_cache, slots, lens,
                                                             scale, splits, config=cfg, **fp8), cuda),
                            "err": err, "cfg": {**cfg, "splits": splits}}
        except Exception as e:  # a tile the compiler refuses
            cands[label] = {"ms": float("inf"), "err": None, "error": f"{type(e).__name__}"}
    splits = tk.num_splits_for(rows, Hkv, max_len, hd)
    cands["default"] = {"ms": _time_ms(functools.partial(tk.decode_attention, q, k_cache, v_cache, slots, lens, scale,
                                                         splits, **fp8), cuda),
                        "err": None, "cfg": {**tk.attention_config(rows, hd, kv_fp8), "splits": splits}}
    return cands


def _report(rows: int, name: str, cands: dict) -> None:
    label, best = best_of(cands)
    print(f"[tune] rows {rows} {name}: best {best['ms'] * 1e3:.2f} us ({label}); default "
          f"{cands.get('default', {}).get('ms', float('nan')) * 1e3:.2f} us; cublas "
          f"{cands.get('cublas', {}).get('ms', float('nan')) * 1e3:.2f} us; {len(cands)} candidates", flush=True)


def _then_norm(gemm, resid: torch.Tensor, norm_w: torch.Tensor):
    """The GEMM and the add+norm that consumes its output (partials summed there), on a copy of `resid`."""
    from rlhf_mcore.rollout.native import triton_kernels as tk

    r = resid.clone()
    return lambda: tk.add_rms_norm(r, gemm(), norm_w, 1e-6)


def _cublas_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from rlhf_mcore.rollout.native import triton_kernels as tk

    return tk.silu_mul(F.linear(x, w))


def _a8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, cfg: dict, **kw) -> torch.Tensor:
    """The activation quantized per row (one Triton kernel), then the Triton GEMM on FP8 x FP8 products."""
    from rlhf_mcore.kernels.fp8 import quantize_rows
    from rlhf_mcore.rollout.native import triton_kernels as tk

    xq, xs = quantize_rows(x)
    return tk.linear(xq, wq, config=cfg, w_scale=ws, x_scale=xs, **kw)


def _w8a8_silu(x: torch.Tensor, fw) -> torch.Tensor:
    from rlhf_mcore.kernels.fp8 import fp8_linear
    from rlhf_mcore.rollout.native import triton_kernels as tk

    return tk.silu_mul(fp8_linear(x, fw))


def best_of(cands: dict) -> tuple[str, dict]:
    ok = {k: v for k, v in cands.items()
          if k != "default" and v.get("err") is not None and v["err"] <= v.get("tol", TOL)}
    return min(ok.items(), key=lambda kv: kv[1]["ms"])


def e2e(shape: dict, batch: int, choice: dict | None, device, dtype, tmp: Path, tiny: bool) -> dict:
    """One timed generate (after a warm-up one) in a fresh engine; `choice` (per GEMM: the best candidate at
    this batch) patched in for its duration."""
    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native import model as nm
    from rlhf_mcore.rollout.native import triton_kernels as tk
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    prompt_len, new = (16, 8) if tiny else (128, 256)
    saved = (tk.linear_config, tk.qkv_rope_cache, nm.FUSED_SILU_MAX_ROWS, nm.NativeModel._out_proj,
             tk.attention_config, tk.num_splits_for)
    if choice:
        by_nk = {}
        D, inter, H = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"]
        hd = D // H
        for name, n, k, silu in (("o_proj", D, H * hd, False), ("down", D, inter, False), ("gate_up", inter, D, True)):
            label, c = choice[name]
            if c["cfg"] is not None:
                by_nk[(n, k, silu)] = c["cfg"]
        orig_cfg, orig_qkv = tk.linear_config, tk.qkv_rope_cache

        def linear_config(m, n, k, silu_mul=False, allow_split=False, dtype=torch.bfloat16, fp8_weight=False):
            cfg = by_nk.get((n, k, silu_mul))
            if cfg is None or m <= 64 or fp8_weight:
                return orig_cfg(m, n, k, silu_mul, allow_split, dtype, fp8_weight)
            return dict(cfg) if allow_split or cfg["SPLIT_K"] == 1 else {**cfg, "SPLIT_K": 1}
        tk.linear_config = linear_config
        qcfg = choice["qkv"][1]["cfg"]
        if qcfg is not None:
            tk.qkv_rope_cache = _qkv_with(orig_qkv, qcfg)
        if choice["gate_up"][0] != "cublas":
            nm.FUSED_SILU_MAX_ROWS = 1 << 30
        if choice["o_proj"][0] == "cublas" and choice["down"][0] == "cublas":
            orig_out = nm.NativeModel._out_proj

            def out_proj(self, x, w, triton_gemms, i=0, name="o_proj"):
                return orig_out(self, x, w, triton_gemms and x.shape[0] <= 64, i, name)
            nm.NativeModel._out_proj = out_proj
        acfg = choice.get("attention", (None, {"cfg": None}))[1]["cfg"]
        if acfg is not None:
            orig_attn, orig_splits = tk.attention_config, tk.num_splits_for
            tk.attention_config = lambda rows, hd, kv_fp8=False: (orig_attn(rows, hd, kv_fp8) if rows <= 64 else
                                                                   {k: v for k, v in acfg.items() if k != "splits"})
            tk.num_splits_for = lambda b, *a, **kw: orig_splits(b, *a, **kw) if b <= 64 else acfg["splits"]
    try:
        model_dir = tmp / "model"
        if not (model_dir / "config.json").exists():
            random_model_dir(shape, model_dir, device, dtype, seed=0)
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(10, shape["vocab_size"] - 10, (batch, prompt_len), generator=gen).tolist()
        engine = NativeRolloutEngine(model_dir, device=device, max_num_seqs=batch, max_model_len=prompt_len + new + 8)
        times = []
        for seed in (1, 2, 3):
            params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=seed)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall, st = time.perf_counter() - t0, engine.last_stats
            times.append((wall - st["prefill_s"]) / max(1, st["decode_steps"]) * 1e3)
        engine.shutdown()
        return {"decode_step_ms": times[1:], "warmup_ms": times[0]}
    finally:
        (tk.linear_config, tk.qkv_rope_cache, nm.FUSED_SILU_MAX_ROWS, nm.NativeModel._out_proj, tk.attention_config,
         tk.num_splits_for) = saved


def _qkv_with(orig, cfg):
    def qkv_rope_cache(*a, **kw):
        if a[0].shape[0] > 64:
            kw = {**cfg, **kw}
        return orig(*a, **kw)
    return qkv_rope_cache


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--rows", type=int, nargs="+", default=[256, 512])
    p.add_argument("--shape", default="0.5b", help="bench_shapes name: 0.5b (default), 1.5b, 7b")
    p.add_argument("--fp8-weights", action="store_true", help="weight-only FP8 Triton candidates against cuBLAS "
                   "w8a8 (the e2e generate is bf16: pass --e2e-batch 0)")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--kv-fp8", action="store_true", help="the attention reads an FP8 cache (kv_cache_dtype=fp8_e4m3)")
    p.add_argument("--tp", type=int, default=1, help="time one tensor-parallel rank's shares of the weights (its "
                   "heads and MLP columns; no K splits in o_proj / down, as the engine runs them under TP)")
    p.add_argument("--fp8-families", nargs="+", default=["w8a16", "a8"], choices=["w8a16", "a8"],
                   help="with --fp8-weights: which Triton candidates (weight-only, FP8 x FP8)")
    p.add_argument("--gemms", nargs="+", default=["o_proj", "down", "gate_up", "qkv"],
                   choices=["o_proj", "down", "gate_up", "qkv"], help="which layer GEMMs to tune")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--e2e-batch", type=int, default=512, help="0: skip the end-to-end generate")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["RLHF_MCORE_DECODE_PDL"] = "0"  # each kernel alone in the grid; the end-to-end runs drop it
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.tp > 1 and args.e2e_batch and not args.tiny:
        raise SystemExit("--tp: the end-to-end generate runs one unsharded engine; pass --e2e-batch 0")
    if args.fp8_weights and args.e2e_batch and not args.tiny:
        raise SystemExit("--fp8-weights: the end-to-end generate patches bf16 choices only; pass --e2e-batch 0")
    shape = {**(TINY if args.tiny else shape_of(args.shape)), "vocab_size": args.vocab}
    rows = [4] if args.tiny else args.rows
    t0 = time.perf_counter()
    if args.e2e_batch and set(args.gemms) != {"o_proj", "down", "gate_up", "qkv"} and not args.tiny:
        raise SystemExit("--gemms: the end-to-end generate patches every GEMM's choice; pass --e2e-batch 0")
    if args.kv_fp8 and args.e2e_batch and not args.tiny:
        raise SystemExit("--kv-fp8: the end-to-end generate patches the bf16 cache's choices only; pass --e2e-batch 0")
    res = tune_shapes(shape, rows, device, dtype, args.tiny, args.fp8_weights, args.skip_attention,
                      tuple(args.gemms), tuple(args.fp8_families), args.tp, args.kv_fp8)
    out = {"commit": git_commit(), "device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "shape": "tiny" if args.tiny else args.shape, "tp": args.tp,
           "fp8_weights": args.fp8_weights, "kv_fp8": args.kv_fp8,
           "tune_s": round(time.perf_counter() - t0, 1), "rows": {}}
    for r, per in res.items():
        out["rows"][r] = {}
        for name, cands in per.items():
            label, best = best_of(cands)
            d = cands.get("default", {}).get("ms")
            cub = cands.get("cublas", {}).get("ms")
            bad = [k for k, v in cands.items() if v.get("err") is not None and v["err"] > v.get("tol", TOL)]
            out["rows"][r][name] = {"best": label, "best_ms": best["ms"], "best_cfg": best["cfg"], "default_ms": d,
                                    "cublas_ms": cub, "wrong": bad,
                                    "all": {k: (v["ms"], v.get("err")) for k, v in cands.items()}}
            print(f"rows {r:4d} {name:8s} best {best['ms'] * 1e3:8.2f} us ({label})  default "
                  f"{(d or float('nan')) * 1e3:8.2f} us  cublas {(cub or float('nan')) * 1e3:8.2f} us"
                  + (f"  WRONG: {bad}" if bad else ""), flush=True)
    if args.e2e_batch:
        b = 4 if args.tiny else args.e2e_batch
        r = min(out["rows"], key=lambda x: abs(int(x) - b))
        choice = {name: (v["best"], {"cfg": v["best_cfg"]}) for name, v in out["rows"][r].items()}
        del os.environ["RLHF_MCORE_DECODE_PDL"]  # the engine's own choice (triton_kernels.PDL_OFF_ROWS)
        with tempfile.TemporaryDirectory() as tmp:
            base = e2e(shape, b, None, device, dtype, Path(tmp), args.tiny)
            tuned = e2e(shape, b, choice, device, dtype, Path(tmp), args.tiny)
            base2 = e2e(shape, b, None, device, dtype, Path(tmp), args.tiny)
        out["e2e"] = {"batch": b, "tuned_at_rows": r, "default": base, "tuned": tuned, "default_again": base2}
        print(f"end to end, batch {b}: decode step default {base['decode_step_ms']} ms, tuned {tuned['decode_step_ms']}"
              f" ms, default again {base2['decode_step_ms']} ms", flush=True)
    path = args.out or os.path.join(os.environ.get("OUT", "."), "tune_decode_gemms.json")
    Path(path).write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
