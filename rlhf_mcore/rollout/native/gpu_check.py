"""GPU self-check of the native engine: Triton kernels, CUDA graphs and bf16 against references.

    python -m rlhf_mcore.rollout.native.gpu_check [--out FILE.json]

The CPU test-suite covers the engine's logic in fp32 (torch paths); this script covers what only runs on a
GPU: the Triton decode-attention and fused-sampling kernels, CUDA-graph replay, bf16 numerics and memory
release on sleep. Each check prints one line and the summary is written as JSON; a failing check does not
stop the others.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch


def check_attention_kernel() -> dict:
    from .attention import decode_attention_torch
    from .triton_kernels import decode_attention, num_splits_for

    out = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype, hq, hkv, d in ((torch.bfloat16, 14, 2, 64), (torch.bfloat16, 32, 8, 128), (torch.float32, 4, 2, 16)):
        S, L, B = 64, 700, 37
        k = torch.randn(S, L, hkv, d, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(S, L, hkv, d, device="cuda", dtype=dtype, generator=g)
        q = torch.randn(B, hq, d, device="cuda", dtype=dtype, generator=g)
        slots = torch.randperm(S, device="cuda", generator=g)[:B]
        lens = torch.randint(1, L + 1, (B,), device="cuda", generator=g)
        ref = decode_attention_torch(q.double(), k.double(), v.double(), slots, lens, d ** -0.5, L)
        errs = []
        for ns in (1, num_splits_for(B, hkv, L), 8):
            o = decode_attention(q, k, v, slots, lens, d ** -0.5, ns)
            errs.append(((o.double() - ref).norm() / ref.norm()).item())
        out[f"{str(dtype)[6:]}_hq{hq}_hkv{hkv}_d{d}_relerr"] = max(errs)
    return out


def check_prefill_attention() -> dict:
    """Packed prefill attention in bf16 (varlen flash if this torch has it) against the fp32 padded path."""
    from . import attention as A

    g = torch.Generator(device="cuda").manual_seed(2)
    lengths = [5, 130, 77, 1, 256]
    layout = A.PackedLayout(lengths, "cuda")
    n = sum(lengths)
    q = torch.randn(n, 14, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(n, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(n, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    out = A.prefill_attention(q, k, v, layout, 64 ** -0.5)
    ref = A.prefill_attention(q.float(), k.float(), v.float(), layout, 64 ** -0.5)
    return {"varlen_used": A._VARLEN["fn"] is not None, "varlen_kwargs": str(A._VARLEN["kwargs"]),
            "varlen_gqa": A._VARLEN.get("gqa"),
            "relerr": ((out.float() - ref).norm() / ref.norm()).item()}


def check_sampler_kernel() -> dict:
    from .sampling import sample_torch
    from .triton_kernels import sample_fused

    g = torch.Generator(device="cuda").manual_seed(1)
    B, V = 64, 151936
    logits = (3 * torch.randn(B, V, device="cuda", generator=g)).to(torch.bfloat16)
    keys = torch.randint(0, 2**32, (B,), device="cuda", generator=g)
    steps = torch.randint(0, 500, (B,), device="cuda", generator=g)
    inv_t = torch.full((B,), 1 / 0.8, device="cuda")
    greedy = torch.arange(B, device="cuda") % 4 == 0
    inv_t[greedy] = 1.0
    t1, l1 = sample_fused(logits, keys, steps, inv_t, greedy)
    t2, l2 = sample_torch(logits, keys, steps, inv_t, greedy)
    same = t1 == t2
    return {"token_match": same.float().mean().item(), "greedy_match": same[greedy].all().item(),
            "logprob_maxdiff_where_same": (l1 - l2)[same].abs().max().item()}


def _prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 40, (n,), generator=g)]


def check_engine_vs_hf(model_dir, dtype) -> dict:
    from transformers import AutoModelForCausalLM

    from ..base import SamplingParams
    from .engine import NativeRolloutEngine

    prompts = _prompts(8, 900)
    params = SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=())
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    refs = []
    for p in prompts:
        with torch.inference_mode():
            o = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        refs.append(o[0, len(p):].tolist())
    res = {}
    for name, cfg in (("graphs_triton", {}), ("graphs_torchattn", {"attention": "torch"}),
                      ("eager_triton", {"cuda_graphs": False}), ("graphs_unfused", {"fused_kernels": False})):
        eng = NativeRolloutEngine(model_dir, dtype=dtype, max_num_seqs=4, max_model_len=128, **cfg)
        outs = [o.samples[0].token_ids for o in eng.generate(prompts, params)]
        res[f"{name}_exact_match"] = sum(a == b for a, b in zip(outs, refs)) / len(refs)
        res[f"{name}_token_agreement"] = sum(x == y for a, b in zip(outs, refs) for x, y in zip(a, b)) / (24 * 8)
        res.setdefault("_outs", {})[name] = outs
        eng.shutdown()
    o = res.pop("_outs")
    res["graphs_equal_eager"] = o["graphs_triton"] == o["eager_triton"]
    if dtype == torch.float32:  # log-probs vs teacher forcing at T=0.7
        eng = NativeRolloutEngine(model_dir, dtype=dtype, max_num_seqs=4, max_model_len=128)
        outs = eng.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=16, n=2, seed=5))
        diff = 0.0
        for p, out in zip(prompts, outs):
            for s in out.samples:
                with torch.inference_mode():
                    lg = hf(torch.tensor([p + s.token_ids], device="cuda")).logits[0, len(p) - 1:-1].float() / 0.7
                ref = torch.log_softmax(lg, -1).gather(-1, torch.tensor(s.token_ids, device="cuda")[:, None])
                diff = max(diff, (ref.squeeze(-1).cpu() - torch.tensor(s.logprobs)).abs().max().item())
        res["logprob_maxdiff_T0.7"] = diff
        # seeded sampling does not depend on batching
        a = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=9))
        eng2 = NativeRolloutEngine(model_dir, dtype=dtype, max_num_seqs=16, max_model_len=128)
        b = eng2.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=9))
        res["seeded_batch_invariant"] = sum(x.token_ids == y.token_ids for oa, ob in zip(a, b)
                                            for x, y in zip(oa.samples, ob.samples)) / (3 * len(prompts))
        # sleep / wake
        before = torch.cuda.memory_allocated()
        freed = eng2.sleep(2)
        after = torch.cuda.memory_allocated()
        eng2.wake()
        c = eng2.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=9))
        res["sleep2_reported_freed_MB"] = freed / 2**20
        res["sleep2_allocated_drop_MB"] = (before - after) / 2**20
        res["sleep_wake_unchanged"] = all(x.token_ids == y.token_ids for oa, ob in zip(b, c)
                                          for x, y in zip(oa.samples, ob.samples))
    del hf
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from ...models.tiny import make_tiny_model

    summary = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    checks = [("attention_kernel", check_attention_kernel), ("prefill_attention", check_prefill_attention),
              ("sampler_kernel", check_sampler_kernel)]
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("qwen2", "llama", "qwen3"):
            d = make_tiny_model(Path(tmp) / arch, arch=arch, hidden=128, heads=4, kv_heads=2, vocab=1024)
            checks.append((f"{arch}_fp32", lambda d=d: check_engine_vs_hf(d, torch.float32)))
            checks.append((f"{arch}_bf16", lambda d=d: check_engine_vs_hf(d, torch.bfloat16)))
        for name, fn in checks:
            t0 = time.perf_counter()
            try:
                summary[name] = fn()
            except Exception as e:  # report and continue with the other checks
                summary[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            print(f"{name} ({time.perf_counter() - t0:.1f}s): {json.dumps(summary[name])[:600]}", flush=True)
    out = Path(args.out or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else "gpu_check.json"))
    out.write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
