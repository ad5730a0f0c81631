"""Rollout throughput: the native engine against Hugging Face `generate`, measured side by side in one run.

    python launch/bench/bench_rollout.py [--batches 64 256] [--prompt-len 256] [--new-tokens 256] [--out FILE.json]
    python launch/bench/bench_rollout.py --tiny          # CPU smoke run on a tiny shape

The model is Qwen2.5-0.5B-shaped with random weights built from a config in code (hidden 896, 24 layers,
14 heads, 2 kv heads, intermediate 4864, vocab 151936, tied embeddings, rope theta 1e6), saved to a temporary
directory. Prompts are random token ids of one length; EOS is ignored so every sequence generates exactly
`--new-tokens` tokens; sampling at temperature 1. Throughput counts generated tokens per second of wall time,
prefill included. Both engines run in bf16 on GPU (fp32 on CPU).

The peer at its best: Hugging Face `generate` with its dynamic cache and with the static cache (which transformers
compiles), each timed after a full-length warm-up run, as the native engine is; `ratio_<variant>_vs_hf` is against
the faster of the two (`hf_best` names it; `hf_<cache>_s` keeps each).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_shapes import (  # noqa: E402  (shapes: launch/bench_shapes.py)
    QWEN25_05B,
    TINY,
    git_commit,  # noqa: E402
    random_model_dir,
)


def build_model_dir(shape: dict, out: Path, device, dtype) -> Path:
    """Random-weight Qwen2 model (transformers init, seed 0) saved as an HF directory."""
    return random_model_dir(shape, out, device, dtype, seed=0)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


HF_CACHES = ("dynamic", "static")


def load_hf(model_dir, device, dtype):
    """transformers' model of `model_dir` (SDPA attention, its default experts kernel for a MoE), in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()


def bench_hf(model_dir, prompts, new_tokens, device, dtype, cache: str = "dynamic", model=None) -> float:
    """Seconds for HF generate on the whole batch (sampling, eos ignored), timed after one full-length warm-up
    run (steady state, as the native engine is timed: HF's first full-length run is several times slower, and with
    the static cache transformers compiles the decoding step in it). `cache`: "dynamic" (HF's default) or
    "static" (`cache_implementation="static"`). `model`: one `load_hf` loaded already (else loaded here)."""
    from transformers import GenerationConfig

    model = model if model is not None else load_hf(model_dir, device, dtype)
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def run(n_new):
        gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=None, top_p=1.0, max_new_tokens=n_new,
                              min_new_tokens=n_new, eos_token_id=None, pad_token_id=0,
                              cache_implementation=None if cache == "dynamic" else cache)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        assert out.shape[1] == ids.shape[1] + n_new, out.shape
        return out

    run(new_tokens)  # warm-up at full length (allocations, kernel selection, the static cache's compile)
    sync(device)
    t0 = time.perf_counter()
    run(new_tokens)
    sync(device)
    return time.perf_counter() - t0


def bench_native(model_dir, prompts, new_tokens, device, **engine_cfg) -> tuple[float, dict]:
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    engine = NativeRolloutEngine(model_dir, device=device, max_num_seqs=len(prompts),
                                 max_model_len=len(prompts[0]) + new_tokens + 8, **engine_cfg)
    elapsed, _ = time_native(engine, prompts, new_tokens, device)
    stats = dict(engine.last_stats)
    engine.shutdown()
    return elapsed, stats


def time_native(engine, prompts, new_tokens, device, seed: int = 0) -> tuple[float, list]:
    """(seconds, outputs) of `engine.generate` on the whole batch (sampling at T = 1, eos ignored), timed after an
    8-token warm-up generation of the same batch."""
    from rlhf_mcore.rollout import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=seed)
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=1))  # warm-up
    sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync(device)
    elapsed = time.perf_counter() - t0
    assert all(len(s.token_ids) == new_tokens for o in outs for s in o.samples)
    return elapsed, outs


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model shape and lengths (CPU smoke run)")
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--skip-hf", action="store_true", help="native engine only (no ratio)")
    p.add_argument("--hf-caches", nargs="+", choices=HF_CACHES, default=list(HF_CACHES),
                   help="HF generate's KV caches to time (the ratio is against the fastest)")
    p.add_argument("--variants", nargs="+", default=["triton"],
                   help="native variants: triton (default: all kernels), torch-attn (torch attention), "
                        "unfused (no fused element-wise kernels), eager (no CUDA graphs), splits1/2/4 (attention "
                        "splits), steps2/4/8 (decode steps a launch)")
    p.add_argument("--out", default=None, help="JSON output (default $OUT/bench_rollout.json or ./bench_rollout.json)")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if args.tiny else QWEN25_05B
    batches = args.batches or ([4, 8] if args.tiny else [64, 256])
    prompt_len = args.prompt_len or (16 if args.tiny else 256)
    new_tokens = args.new_tokens or (16 if args.tiny else 256)
    variant_cfg = {"triton": {}, "torch-attn": {"attention": "torch"}, "eager": {"cuda_graphs": False},
                   "unfused": {"fused_kernels": False}, "splits1": {"decode_splits": 1},
                   "splits2": {"decode_splits": 2}, "splits4": {"decode_splits": 4},
                   "steps2": {"decode_steps_per_launch": 2}, "steps4": {"decode_steps_per_launch": 4},
                   "steps8": {"decode_steps_per_launch": 8}}
    for v in args.variants:
        if v not in variant_cfg:
            raise SystemExit(f"--variants: unknown {v!r}; choose from {sorted(variant_cfg)}")
    if device.type == "cpu":  # on CPU the engine uses its torch paths whatever the variant
        variant_cfg = {v: {} for v in variant_cfg}

    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "commit": git_commit(), "dtype": str(dtype).replace("torch.", ""),
              "shape": shape, "prompt_len": prompt_len, "new_tokens": new_tokens, "rows": []}
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(shape, Path(tmp) / "model", device, dtype)
        for batch in batches:
            prompts = torch.randint(0, shape["vocab_size"], (batch, prompt_len), generator=g).tolist()
            gen_tokens = batch * new_tokens
            row = {"batch": batch}
            if not args.skip_hf:
                for cache in args.hf_caches:
                    try:
                        t = bench_hf(model_dir, prompts, new_tokens, device, dtype, cache)
                        row[f"hf_{cache}_s"], row[f"hf_{cache}_tok_s"] = t, gen_tokens / t
                    except Exception as e:  # noqa: BLE001 - a peer configuration that fails is reported
                        row[f"hf_{cache}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()  # the HF model is gone; give its memory to the native engine
                timed = {c: row[f"hf_{c}_s"] for c in args.hf_caches if f"hf_{c}_s" in row}
                if timed:  # the ratios are against HF at its best (the fastest cache that ran)
                    row["hf_best"] = min(timed, key=timed.get)
                    row["hf_s"], row["hf_tok_s"] = timed[row["hf_best"]], gen_tokens / timed[row["hf_best"]]
            for v in args.variants:
                t, stats = bench_native(model_dir, prompts, new_tokens, device, **variant_cfg[v])
                row[f"native_{v}_s"], row[f"native_{v}_tok_s"] = t, gen_tokens / t
                row[f"native_{v}_prefill_s"] = stats["prefill_s"]
                row[f"native_{v}_decode_ms_per_step"] = 1e3 * stats["decode_s"] / max(1, stats["decode_steps"])
                if "hf_s" in row:
                    row[f"ratio_{v}_vs_hf"] = row["hf_s"] / t
            result["rows"].append(row)
            print(json.dumps(row), flush=True)

    print(f"\n{result['device']}  torch {result['torch']}  commit {result['commit']}  {result['dtype']}  "
          f"prompt {prompt_len} + new {new_tokens} tokens (generated tokens/s, prefill included)")
    header = (f"{'batch':>6} {'hf dyn tok/s':>12} {'hf static':>10} {'hf best':>8}"
              + "".join(f" {v + ' tok/s':>18} {'x best':>7} {'ms/step':>8}" for v in args.variants))
    print(header)
    for row in result["rows"]:
        line = (f"{row['batch']:>6} {row.get('hf_dynamic_tok_s', float('nan')):>12.0f} "
                f"{row.get('hf_static_tok_s', float('nan')):>10.0f} {row.get('hf_best', '-'):>8}")
        for v in args.variants:
            line += (f" {row[f'native_{v}_tok_s']:>18.0f} {row.get(f'ratio_{v}_vs_hf', float('nan')):>7.1f}"
                     f" {row[f'native_{v}_decode_ms_per_step']:>8.2f}")
        print(line)
    out = Path(args.out or (Path(os.environ["OUT"]) / "bench_rollout.json" if os.environ.get("OUT")
                            else "bench_rollout.json"))
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
