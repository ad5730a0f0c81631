"""Where a native-engine decode step's time goes: wall time per step against the GPU kernels inside it.

    python launch/bench/profile_decode.py [--batch 256] [--prompt-len 256] [--new-tokens 256] [--vocab N]
                                          [--out FILE.json]
    python launch/bench/profile_decode.py --batch 512 --prompt-len 128 --vocab 8192   # TRL's GRPO workload's decode
    python launch/bench/profile_decode.py --batch 512 --samples 8 --prompt-len 128 --vocab 8192 [--own-slot-reads]
                                          # the same with GRPO's 8 samples a prompt (64 prompts), each group's rows
                                          # reading the prompt from one slot (engine.SHARE_PROMPT_READS) or not
    python launch/bench/profile_decode.py --shape 7b --batch 64 [--quantization fp8 [--fp8-decode w8a16 |
                                          --fp8-triton-decode]]
                                          [--model-dir DIR]   # another shape, FP8 weights; DIR keeps the random
                                          # model between runs (written there once)
    python launch/bench/profile_decode.py --shape 7b --cublas-gemms   # o, gate_up and down on cuBLAS at every
                                          # batch (model.TRITON_OUT_PROJ_MAX_ROWS, FUSED_SILU_MAX_ROWS = 0)
    python launch/bench/profile_decode.py --tiny          # CPU smoke run (no CUDA: wall times only)

Builds the Qwen2.5-0.5B-shaped (or `--shape`) random model of bench_rollout.py, warms the engine up at full length
(every CUDA graph captured), then
  1. times one generate at full length: decode ms per step = (wall - prefill) / decode steps;
  2. profiles `--profile-tokens` more decode steps with torch.profiler (CUDA activity; kernels replayed inside a CUDA
     graph are recorded one by one) and reports, per decode step: kernel count, summed kernel time, the gap between the
     step's wall time and its kernels (host work, launch, the done-flag sync), the GPU's idle time in the profiled run
     (between kernels, and in gaps > 10 us: the GPU waiting for the host), and the kernels grouped by kind (GEMM,
     attention, sampling, element-wise/norm, copies) and by name;
  3. profiles a one-token generate: the batch's prefill (and its first sample), its kernels by kind and by name,
     and where its tensor copies are called from (`prefill` in the JSON).
Under programmatic dependent launch (Hopper; the engine's default) a Triton kernel starts before its predecessor
ends and waits for it, so the recorded kernel times overlap and can sum to more than the wall (7B, batch 64: 10.6 ms
of kernels in a 6.8 ms step, BENCHMARKS.md session 34); run with RLHF_MCORE_DECODE_PDL=0 for kernel times that add
up (the step itself then runs without the overlap).
The bound it compares with: the bytes a step must read once (weights + the average KV cache) at the ~4.3 TB/s a device
copy reaches on an H200.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_shapes import TINY, git_commit, num_params, random_model_dir  # noqa: E402
from bench_shapes import shape as shape_of  # noqa: E402

COPY_BW = 4.3e12  # bytes/s, a device-to-device copy on one H200 (BENCHMARKS.md, "Targets and reference figures")


def kind_of(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "splitk", "_linear_kernel",
                            "_qkv_rope_cache")):
        return "gemm"
    if "attn" in n or "attention" in n or "flash" in n or "decode_kernel" in n or "_reduce_splits" in n:
        return "attention"
    if "sample" in n or "gumbel" in n or "argmax" in n:
        return "sampling"
    if "memcpy" in n or "memset" in n or "copy" in n:
        return "copy"
    return "elementwise/norm/other"


def kernel_totals(prof) -> dict[str, list[float]]:
    """name -> [count, microseconds] of the GPU kernels (and copies) a torch.profiler run recorded."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name][0] += 1
            totals[ev.name][1] += getattr(ev, "device_time_total", None) or ev.cuda_time_total
    return totals


def gpu_idle(intervals: list[tuple[float, float]], min_gap_us: float = 10.0, top: int = 5) -> dict:
    """Where the GPU ran no kernel between the first kernel's start and the last one's end: `intervals` (start, end)
    in microseconds, one per kernel, in any order; overlapping ones (programmatic dependent launch, several streams)
    are merged. Returns span_us, busy_us, idle_us, the gaps longer than `min_gap_us` (count, us: the GPU waiting for
    the host, e.g. between decode steps, rather than a kernel boundary) and the `top` longest gaps."""
    if not intervals:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "long_gaps": 0, "long_gap_us": 0.0, "longest": []}
    ivs = sorted(intervals)
    busy, gaps = 0.0, []
    cur_s, cur_e = ivs[0]
    for s, e in ivs[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e in ivs) - ivs[0][0]
    long = [g for g in gaps if g > min_gap_us]
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy, "long_gaps": len(long),
            "long_gap_us": sum(long), "longest": sorted(gaps, reverse=True)[:top]}


def kernel_intervals(prof) -> list[tuple[float, float]]:
    """(start, end) us of each GPU kernel or copy a torch.profiler run recorded."""
    return [(ev.time_range.start, ev.time_range.end) for ev in prof.events()
            if ev.device_type == torch.autograd.DeviceType.CUDA]


def mid_generate_rows(engine, generate, at: int) -> list[torch.Tensor]:
    """Runs `generate()` and returns copies of the engine's row buffers as its decode launch number `at` found them
    (empty if it makes fewer): the state `graph_replay_ms` replays from (each row's own slot, position, source slot
    and shared prompt length, as a generate has them). One copy, at that launch: the timed generate is not slowed."""
    launch, calls, snap = engine._launch, [0], []

    def snapshot(b):
        calls[0] += 1
        if calls[0] == at:
            snap[:] = [buf.clone() for buf in engine._row_buffers]
        return launch(b)
    engine._launch = snapshot
    try:
        generate()
    finally:
        engine._launch = launch
    return snap


def graph_replay_ms(engine, batch: int, rows: list[torch.Tensor], n: int = 50) -> tuple[float, float]:
    """Milliseconds per decode step of the engine's captured decode graph for `batch` rows (the one of the most
    steps a launch), replayed back to back with no host work between, from the row buffers `rows` (a generate's own,
    `mid_generate_rows`; no row reaches its cap), and the host's microseconds per `graph.replay()` call in that loop
    (the launch: if it is near the replay's time, a decode step is bound by launching its graph plus the engine's
    host work, not by the GPU). Session 48: replays from rows set by hand (positions and steps only) ran 0.2 ms
    faster than the same graph inside a generate on one H100 and not on another; from a generate's own rows they
    match it (1.91-1.92 against 1.93 ms)."""
    key = max((k for k in engine.graphs.graphs if k[0] == batch), key=lambda k: k[-1])
    graph, steps = engine.graphs.graphs[key], key[-1]
    for buf, saved in zip(engine._row_buffers, rows):
        buf.copy_(saved)
    engine.r_limit[:batch] = 1 << 30
    n = max(1, n // steps)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        graph.replay()
    launch_us = (time.perf_counter() - t0) / n * 1e6
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (n * steps), launch_us


def decode_bound_s(shape: dict, batch: int, prompt_len: int, new_tokens: int, bytes_per: int) -> float:
    """Seconds to read the weights and the average KV cache once."""
    hd = shape["hidden_size"] // shape["num_attention_heads"]
    kv_per_tok = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * hd * bytes_per
    avg_len = prompt_len + new_tokens / 2
    return (num_params(shape) * bytes_per + batch * avg_len * kv_per_tok) / COPY_BW


def _prefill_report(pre: dict[str, list[float]], top: int) -> dict:
    """The kernels of one generate of a single token (the batch's prefill and its first sample), by kind and name."""
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, (c, us) in pre.items():
        kinds[kind_of(name)][0] += c
        kinds[kind_of(name)][1] += us
    rep = {"kernels": sum(c for c, _ in pre.values()), "kernel_ms": sum(us for _, us in pre.values()) / 1e3,
           "kinds": {k: {"kernels": int(c), "ms": round(us / 1e3, 3)} for k, (c, us) in
                     sorted(kinds.items(), key=lambda kv: -kv[1][1])},
           "top": [{"name": n[:140], "count": int(c), "ms": round(us / 1e3, 3)} for n, (c, us) in
                   sorted(pre.items(), key=lambda kv: -kv[1][1])[:top]]}
    print(f"prefill (one-token generate): {rep['kernels']:.0f} kernels, {rep['kernel_ms']:.1f} ms of kernels",
          flush=True)
    for k, v in rep["kinds"].items():
        print(f"  {k:24s} {v['kernels']:7d} kernels {v['ms']:9.3f} ms", flush=True)
    for t in rep["top"]:
        print(f"  {t['ms']:9.3f} ms x{t['count']:5d}  {t['name']}", flush=True)
    return rep


def _verbose_stacks() -> dict:
    """torch.profiler's option that records Python frames on each op (a private knob; none where it is missing)."""
    try:
        return {"experimental_config": torch._C._profiler._ExperimentalConfig(verbose=True)}
    except AttributeError:
        return {}


def _copy_sources(prof, frames: int = 3) -> list[dict]:
    """Where a profiled run's tensor copies (aten::copy_: .contiguous(), .to(), clones) were called from: the innermost
    `frames` Python frames of this repository's code (or of any code, when none is ours), with their counts."""
    counts: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.name != "aten::copy_" or ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        stack = [re.sub(r" of .* at 0x[0-9a-f]+>", ">", f) for f in getattr(ev, "stack", None) or []]
        ours = [f for f in stack if "rlhf_mcore" in f or "launch/" in f]
        head = stack[:1] if stack and stack[0].startswith("<built-in") and ours else []  # the op: .contiguous() ...
        counts[" <- ".join(head + (ours or stack)[:frames]) or "(no stack recorded)"] += 1
    rep = [{"count": c, "from": k[:300]} for k, c in sorted(counts.items(), key=lambda kv: -kv[1])[:12]]
    for r in rep:
        print(f"  copy x{r['count']:5d}  {r['from']}", flush=True)
    return rep


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--samples", type=int, default=1, help="samples a prompt (GRPO's n): batch / samples prompts")
    p.add_argument("--own-slot-reads", action="store_true",
                   help="every row reads its prompt from its own slot (engine.SHARE_PROMPT_READS off)")
    p.add_argument("--shape", default="0.5b", help="bench_shapes name: 0.5b (default), 1.5b, 7b")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size (default the shape's, 151,936 at 0.5B; TRL's GRPO workload uses 8,192)")
    p.add_argument("--quantization", choices=("fp8",), default=None, help="the engine's FP8 weights (rollout "
                   "quantization=fp8, per-channel scales)")
    p.add_argument("--fp8-decode", choices=("w8a8", "w8a16"), default="w8a8",
                   help="with --quantization fp8: the engine's fp8_decode")
    p.add_argument("--fp8-triton-decode", action="store_true", help="with --quantization fp8 (w8a8): gate_up and "
                   "down as Triton FP8 x FP8 GEMMs in the decode step (model.FP8_TRITON_DECODE)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                   help="the engine's KV cache: the model's dtype, or e4m3 codes with a scale per token and head")
    p.add_argument("--cublas-gemms", action="store_true",
                   help="o_proj, gate_up and down on cuBLAS at every batch (bf16 weights), QKV still fused")
    p.add_argument("--decode-steps", type=int, default=None,
                   help="decode steps a launch (engine.DECODE_STEPS_PER_LAUNCH; default: the engine's)")
    p.add_argument("--model-dir", default=None, help="keep the random model here (reused when it has config.json)")
    p.add_argument("--profile-tokens", type=int, default=32, help="tokens generated under the profiler")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (kernel names when graph tracing fails)")
    p.add_argument("--top", type=int, default=25, help="kernel names listed")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native import engine as engine_mod
    from rlhf_mcore.rollout.native import model as model_mod
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    if args.fp8_triton_decode and (args.quantization != "fp8" or args.fp8_decode != "w8a8"):
        raise SystemExit("--fp8-triton-decode routes the w8a8 decode GEMMs: pass --quantization fp8 (w8a8)")
    names = ("TRITON_OUT_PROJ_MAX_ROWS", "FUSED_SILU_MAX_ROWS", "FP8_TRITON_DECODE")
    saved = (engine_mod.SHARE_PROMPT_READS, {n: getattr(model_mod, n) for n in names},
             engine_mod.DECODE_STEPS_PER_LAUNCH)
    engine_mod.SHARE_PROMPT_READS = not args.own_slot_reads
    if args.decode_steps is not None:
        engine_mod.DECODE_STEPS_PER_LAUNCH = args.decode_steps
    if args.cublas_gemms:
        model_mod.TRITON_OUT_PROJ_MAX_ROWS = model_mod.FUSED_SILU_MAX_ROWS = 0
    model_mod.FP8_TRITON_DECODE = args.fp8_triton_decode or model_mod.FP8_TRITON_DECODE
    try:  # the module settings go back afterwards (a caller's process keeps running)
        return _profile(args, NativeRolloutEngine, SamplingParams, engine_mod)
    finally:
        engine_mod.SHARE_PROMPT_READS, engine_mod.DECODE_STEPS_PER_LAUNCH = saved[0], saved[2]
        for n, v in saved[1].items():
            setattr(model_mod, n, v)


def _profile(args, NativeRolloutEngine, SamplingParams, engine_mod) -> dict:
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = TINY if args.tiny else shape_of(args.shape)
    if args.vocab is not None:
        if args.vocab < 64:
            raise SystemExit(f"--vocab {args.vocab}: the prompts draw token ids from [10, vocab - 10); give >= 64")
        shape = {**shape, "vocab_size": args.vocab}
    if args.tiny:
        args.batch, args.prompt_len, args.new_tokens, args.profile_tokens = 4, 16, 8, 4
    if args.batch % args.samples:
        raise SystemExit(f"--batch {args.batch} is not a multiple of --samples {args.samples}")
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, shape["vocab_size"] - 10, (args.batch // args.samples, args.prompt_len),
                            generator=gen).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir or Path(tmp) / "model")
        if not (model_dir / "config.json").is_file():
            random_model_dir(shape, model_dir, device, dtype, seed=0)
        engine = NativeRolloutEngine(model_dir, device=device, max_num_seqs=args.batch,
                                     max_model_len=args.prompt_len + args.new_tokens + 8,
                                     cuda_graphs=False if args.eager else None, quantization=args.quantization,
                                     fp8_decode=args.fp8_decode, kv_cache_dtype=args.kv_cache_dtype)

        def run(n_new: int, seed: int):
            params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=n_new, ignore_eos=True, seed=seed)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t0, dict(engine.last_stats)

        run(args.new_tokens, 1)  # warm-up: every graph of the full length captured
        timed = []
        rows = mid_generate_rows(engine, lambda: timed.append(run(args.new_tokens, 2)),
                                 at=max(1, args.new_tokens // 2 // engine.decode_steps_per_launch))
        wall, stats = timed[0]
        steps = max(1, stats["decode_steps"])
        step_ms = (wall - stats["prefill_s"]) / steps * 1e3
        out = {"commit": git_commit(), "device": torch.cuda.get_device_name() if cuda else "cpu",
               "torch": torch.__version__, "shape": "tiny" if args.tiny else args.shape, "batch": args.batch,
               "samples": args.samples, "quantization": args.quantization,
               "fp8_decode": args.fp8_decode if args.quantization else None, "cublas_gemms": args.cublas_gemms,
               "fp8_triton_decode": args.fp8_triton_decode,
               "shared_prompt_reads": engine_mod.SHARE_PROMPT_READS,
               "decode_steps_per_launch": engine.decode_steps_per_launch, "prompt_len": args.prompt_len,
               "new_tokens": args.new_tokens,
               "vocab_size": json.loads((model_dir / "config.json").read_text())["vocab_size"],
               "cuda_graphs": engine.use_graphs, "wall_s": wall,
               "prefill_s": stats["prefill_s"],
               "decode_steps": steps, "decode_step_ms": step_ms,
               "bound_ms": decode_bound_s(shape, args.batch, args.prompt_len, args.new_tokens, 2 if cuda else 4) * 1e3}
        print(f"decode step {step_ms:.3f} ms wall (bound {out['bound_ms']:.3f} ms), prefill {stats['prefill_s']:.3f} s",
              flush=True)
        if cuda:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                pwall, pstats = run(args.profile_tokens, 3)
            psteps = max(1, pstats["decode_steps"])
            by_name = kernel_totals(prof)
            # the prefill's kernels (to subtract), and the Python stacks of its tensor copies
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                         **_verbose_stacks()) as prof1:
                run(1, 4)
            pre = kernel_totals(prof1)
            out["prefill"] = _prefill_report(pre, args.top)
            out["prefill"]["copies"] = _copy_sources(prof1)
            per_step = {}
            for name, (c, us) in by_name.items():
                c0, us0 = pre.get(name, (0, 0.0))
                dc, dus = (c - c0) / psteps, (us - us0) / psteps  # a 1-token generate has no decode step
                if dc > 0 or dus > 0:
                    per_step[name] = (dc, dus)
            kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
            for name, (c, us) in per_step.items():
                kinds[kind_of(name)][0] += c
                kinds[kind_of(name)][1] += us
            kernel_us = sum(us for _, us in per_step.values())
            out.update(profiled_steps=psteps, profiled_wall_s=pwall,
                       kernels_per_step=sum(c for c, _ in per_step.values()), kernel_ms_per_step=kernel_us / 1e3,
                       host_gap_ms_per_step=step_ms - kernel_us / 1e3,
                       kinds={k: {"kernels": round(c, 1), "ms": round(us / 1e3, 4)} for k, (c, us) in
                              sorted(kinds.items(), key=lambda kv: -kv[1][1])},
                       top=[{"name": n[:140], "per_step": round(c, 2), "us_per_step": round(us, 2)} for n, (c, us) in
                            sorted(per_step.items(), key=lambda kv: -kv[1][1])[:args.top]])
            idle = gpu_idle(kernel_intervals(prof))
            out["gpu_idle"] = {**idle, "idle_ms_per_step": idle["idle_us"] / psteps / 1e3,
                               "long_gap_ms_per_step": idle["long_gap_us"] / psteps / 1e3}
            print(f"kernels per step {out['kernels_per_step']:.0f}, kernel time {out['kernel_ms_per_step']:.3f} ms, "
                  f"gap {out['host_gap_ms_per_step']:.3f} ms; profiled run: GPU idle "
                  f"{out['gpu_idle']['idle_ms_per_step']:.3f} ms a step, {idle['long_gaps']} gaps > 10 us "
                  f"({out['gpu_idle']['long_gap_ms_per_step']:.3f} ms a step; longest "
                  f"{', '.join(f'{g:.0f}' for g in idle['longest'])} us)", flush=True)
            for k, v in out["kinds"].items():
                print(f"  {k:24s} {v['kernels']:7.1f} kernels {v['ms']:.4f} ms", flush=True)
            for t in out["top"]:
                print(f"  {t['us_per_step']:9.2f} us x{t['per_step']:6.2f}  {t['name']}", flush=True)
            if engine.use_graphs and rows:
                out["graph_replay_ms"], out["graph_launch_us"] = graph_replay_ms(engine, args.batch, rows)
                print(f"back-to-back replays of the batch-{args.batch} graph: {out['graph_replay_ms']:.3f} ms a "
                      "decode step (kernels + the graph's own gaps between them; wall - this = the host's share); "
                      f"the host's graph.replay() call {out['graph_launch_us']:.1f} us", flush=True)
        engine.shutdown()
    path = args.out or os.path.join(os.environ.get("OUT", "."), "profile_decode.json")
    Path(path).write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
