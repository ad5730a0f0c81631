"""Packed (THD) document-causal attention kernels on RL-shaped micro-batches, side by side.

    python launch/bench/bench_packed_attention.py [--reps 20] [--out FILE.json]
    python launch/bench/bench_packed_attention.py --tiny          # CPU smoke run (reference and eager flex only)

What the train engine runs for packed micro-batches (many short documents back to back): the compiled
`flex_attention` with a document-causal block mask, torch's variable-length Flash Attention
(`torch.nn.attention.varlen.varlen_attn`, where this torch has it), and one causal SDPA call per document (the
reference, and the CPU path). Qwen2.5-0.5B's attention shape (14 query heads, 2 KV heads, head_dim 64, bf16) unless
a case names another. Cases: GRPO-like documents (~95-token prompts + up to 256 response tokens) and PPO-like ones
(up to 512 + 512), packed to the token budgets of the 0.5B configs; the MFU benchmark's 4 x 4,096 at the 0.5B and
7B head shapes.

cuDNN's attention, probed on GPU (not used by the engine; torch's own `varlen_attn` keeps its cuDNN path switched
off): `cudnn_ops`, `aten::_cudnn_attention_forward/_backward` over cu_seqlens with the key/value heads repeated
(its ragged path takes no grouped keys); `cudnn_njt`, the same kernel reached through a jagged nested tensor and
SDPA's cuDNN backend (torch's own autograd formula); and where every document has one length, dense SDPA with the
cuDNN and Flash backends on the (documents, heads, length, dim) batch.

Reported per kernel: forward (no grad) and forward + backward milliseconds (CUDA events, median of `--reps`),
block-mask creation for flex separately, and the largest difference from the reference (output and query gradient).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_shapes import cell, git_commit, write_report  # noqa: E402

QWEN05B_HEADS = (14, 2, 64)  # query heads, key/value heads, head_dim
QWEN7B_HEADS = (28, 4, 128)
CASES = {  # name: (tokens in the micro-batch, (min, max) document length, heads)
    "grpo_16k": (16384, (200, 352), QWEN05B_HEADS),
    "grpo_24k": (24576, (200, 352), QWEN05B_HEADS),
    "ppo_16k": (16384, (300, 1024), QWEN05B_HEADS),
    "mfu_4x4k": (16384, (4096, 4096), QWEN05B_HEADS),
    "mfu_4x4k_7b": (16384, (4096, 4096), QWEN7B_HEADS),
}
TINY_CASES = {"tiny": (200, (10, 40), QWEN05B_HEADS)}
KERNELS = ("per_document_sdpa", "flex", "varlen", "cudnn_ops", "cudnn_njt", "dense_cudnn", "dense_flash")


def documents(total: int, lengths: tuple[int, int], seed: int = 0) -> list[int]:
    """Document lengths drawn uniformly in `lengths` until `total` tokens are filled (the last one cut)."""
    import random

    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(rng.randint(*lengths), total - sum(out)))
    return out


def timed(fn, reps: int, device) -> float:
    """Median milliseconds of `fn()` over `reps` calls (after 3 warm-ups); CUDA events on GPU."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@functools.lru_cache(maxsize=1)
def _cudnn_varlen_fn():
    """Causal attention over cu_seqlens through `aten::_cudnn_attention_forward/_backward` (a probe: its ragged
    path takes no grouped keys, so the caller repeats them). Built once: torch is imported lazily here."""
    import torch

    class CudnnVarlen(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu, max_len, scale):
            res = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True,
                                                          False, scale=scale)
            out, lse, seed, offset = res[0], res[1], res[6], res[7]
            ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu)
            ctx.max_len, ctx.scale = max_len, scale
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, out, lse, seed, offset, cu = ctx.saved_tensors
            dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
                grad.contiguous(), q, k, v, out, lse, seed, offset, torch.empty(0, device=q.device), cu, cu,
                ctx.max_len, ctx.max_len, 0.0, True, scale=ctx.scale)
            return dq, dk, dv, None, None, None

    return CudnnVarlen


def _repeat_kv(q, k, v):
    rep = q.size(1) // k.size(1)
    return (k, v) if rep == 1 else (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))


def cudnn_ops(q, k, v, cu, max_len, scale):
    k, v = _repeat_kv(q, k, v)
    return _cudnn_varlen_fn().apply(q, k, v, cu, max_len, scale)


def cudnn_njt(q, k, v, cu, max_len, scale):
    """(T, heads, dim) -> (T, heads, dim) through a jagged nested tensor and SDPA's cuDNN backend."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k, v = _repeat_kv(q, k, v)
    nq, nk, nv = (torch.nested.nested_tensor_from_jagged(x, offsets=cu.long(), max_seqlen=max_len).transpose(1, 2)
                  for x in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(nq, nk, nv, is_causal=True, scale=scale)
    return out.transpose(1, 2).values()


def dense(backend_name: str, docs: int):
    """Equal-length documents as a dense (docs, heads, len, dim) batch through one SDPA backend."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def fn(q, k, v, cu, max_len, scale):
        gqa = q.size(1) != k.size(1)
        if backend_name == "CUDNN_ATTENTION":
            k, v = _repeat_kv(q, k, v)
            gqa = False
        qd, kd, vd = (x.view(docs, -1, x.size(1), x.size(2)).transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(q.shape)

    return fn


def run_case(total: int, lengths: tuple[int, int], heads_shape: tuple[int, int, int], reps: int, device,
             dtype) -> dict:
    import torch

    from rlhf_mcore.models.attention_ops import (
        flex_block_mask,
        packed_attention_flex,
        packed_attention_per_document,
        packed_attention_varlen,
        varlen_available,
    )

    docs = documents(total, lengths)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32, device=device)
    heads, groups, dim = heads_shape
    scale = dim ** -0.5
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(total, n, dim, generator=g).to(device, dtype) for n in (heads, groups, groups))
    grad = torch.randn(total, heads, dim, generator=g).to(device, dtype)
    on_gpu = device.type == "cuda"
    kernels = {"per_document_sdpa": lambda a, b, c: packed_attention_per_document(a, b, c, cu, scale)}
    mask_ms = timed(lambda: flex_block_mask(cu, total), reps, device)
    mask = flex_block_mask(cu, total)
    kernels["flex"] = lambda a, b, c: packed_attention_flex(a, b, c, mask, scale, compiled=on_gpu)
    if on_gpu and varlen_available():
        kernels["varlen"] = lambda a, b, c: packed_attention_varlen(a, b, c, cu, max(docs), scale)
    if on_gpu:
        kernels["cudnn_ops"] = lambda a, b, c: cudnn_ops(a, b, c, cu, max(docs), scale)
        kernels["cudnn_njt"] = lambda a, b, c: cudnn_njt(a, b, c, cu, max(docs), scale)
        if len(set(docs)) == 1:
            kernels["dense_cudnn"] = partial(dense("CUDNN_ATTENTION", len(docs)), cu=cu, max_len=docs[0], scale=scale)
            kernels["dense_flash"] = partial(dense("FLASH_ATTENTION", len(docs)), cu=cu, max_len=docs[0], scale=scale)

    def fwd_bwd(fn):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        fn(*leaves).backward(grad)
        return leaves[0].grad

    want = packed_attention_per_document(q.float(), k.float(), v.float(), cu, scale)
    want_dq = fwd_bwd(lambda a, b, c: packed_attention_per_document(a.float(), b.float(), c.float(), cu, scale))
    out = {"tokens": total, "documents": len(docs), "mean_doc_len": total / len(docs), "heads": list(heads_shape),
           "flex_block_mask_ms": mask_ms}
    for name, fn in kernels.items():
        row = {}
        try:
            with torch.no_grad():
                row["forward_ms"] = timed(partial(fn, q, k, v), reps, device)
                row["max_abs_err"] = float((fn(q, k, v).float() - want).abs().max())
            if on_gpu or name != "flex":  # eager flex has no backward on CPU
                row["fwd_bwd_ms"] = timed(partial(fwd_bwd, fn), reps, device)
                row["max_abs_err_dq"] = float((fwd_bwd(fn).float() - want_dq).abs().max())
        except Exception as e:  # noqa: BLE001 - a kernel that fails is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out[name] = row
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="tiny case on CPU (smoke run)")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=None, help="default: all")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = {"benchmark": "packed_attention", "commit": git_commit(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "cases": {}}
    cases = TINY_CASES if args.tiny else CASES
    for name in args.cases or cases:
        total, lengths, heads_shape = cases[name]
        report["cases"][name] = run_case(total, lengths, heads_shape, args.reps, device, dtype)
    print(f"\n{report['device']}  torch {report['torch']}  commit {report['commit']}")
    print(f"{'case':<12} {'docs':>5} {'kernel':<18} {'fwd ms':>8} {'fwd+bwd ms':>11} {'err':>9} {'err dq':>9}")
    for name, c in report["cases"].items():
        for kernel in KERNELS:
            r = c.get(kernel)
            if r is None:
                continue
            print(f"{name:<12} {c['documents']:>5} {kernel:<18} {cell(r, 'forward_ms', '>8.3f')} "
                  f"{cell(r, 'fwd_bwd_ms', '>11.3f')} {cell(r, 'max_abs_err', '>9.2e')} "
                  f"{cell(r, 'max_abs_err_dq', '>9.2e')} {r.get('error', '')}")
        print(f"{name:<12} {'':>5} {'(flex block mask)':<18} {c['flex_block_mask_ms']:>8.3f}")
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
