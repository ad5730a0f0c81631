"""Mixture-of-experts on one GPU (issue 34 item 4, BENCHMARKS.md "MoE"): a Qwen3-30B-A3B-shaped model with 4 of its 48
layers -- its update throughput and MFU on active parameters, its rollout throughput against transformers' `generate`,
and the rollout / trainer k3 KL in bf16 with routing replay R3 on and off.

    python launch/bench/bench_moe.py --shape qwen3_30b_a3b_4l --out $OUT/bench_moe.json      # one H200
    python launch/bench/bench_moe.py --shape tiny --device cpu --out bench_moe.json          # CPU smoke run
    python launch/bench/bench_moe.py --sections train --train-experts grouped sequential     # experts side by side

The model (`bench_shapes.MOE_SHAPES["qwen3_30b_a3b_4l"]`): Qwen/Qwen3-30B-A3B's config.json with num_hidden_layers 4
-- hidden 2048, 32 heads / 4 KV heads of head_dim 128 (QK-norm), 128 experts of width 768, top-8 renormalised, every
layer sparse, vocab 151936, untied -- with transformers' random init (std `--init-std`, its default 0.02; seed 0),
written once as an HF directory that every engine below loads: 3.11 B parameters, 0.85 B active a token (the output
projection, 0.31 B, is most of that at 4 layers). bf16 on a GPU, fp32 on a CPU.

Sections (the JSON is rewritten after each, so a later failure or a timeout keeps the earlier numbers; a section that
raises records its error and the rest still run), run in the order rollout, hf with the dynamic cache, kl, train, hf
with the static cache (its compilation is the slowest and least predictable part):

- rollout: the native engine (`NativeRolloutEngine`: its MoE layers as two grouped GEMMs on CUDA, decode steps eager:
  no CUDA graphs for MoE) at batch 64, 256-token random prompts + 256 new tokens (sampling at T = 1, eos ignored),
  generated tokens per second of wall time, prefill included, after an 8-token warm-up of the same batch; once
  without and once with `record_routes` (what R3 costs the rollout: the routes of every fed token kept);
- kl: the recorded rollout's samples as the trainer's batch (`build_batch`, routes under `routed_experts`), scored by
  the train engine (the actor as the trainer builds it for a MoE model: routers with a `RouterReplay`) with
  router_replay R3 (the rollout's routes replayed) and disabled (the trainer's own routing); per mode the mean and
  max k3 KL(rollout || trainer) and mean |log-prob diff| on response tokens (`trainer.stats.rollout_gap_metrics`,
  the trainer's `rollout/k3_kl`), and the fraction of fed tokens (prompt and response but its last) whose top-k
  expert set differs between the rollout and the trainer's own routing, per MoE layer, mean and max;
- train: `TrainEngine.update_policy` (Megatron DDP, distributed Adam with fp32 master weights, gradient clipping) on
  a synthetic PPO batch of 32 x 2048 tokens (`--train-seqs`; a quarter prompt; packed, micro-batches of `--micro`
  sequences, default 8; one optimizer step: 64k tokens, an RL mini-batch's share of one GPU; the step's fixed
  cost, Adam over all 3.11 B parameters, is ~0.026 s, so MFU falls with fewer tokens a step: BENCHMARKS.md),
  median over `--steps` after `--warmup`: tokens/s, TFLOP/s and MFU from `rlhf_mcore.engine.flops`
  counted on ACTIVE parameters (each token's attention, router and top-8 experts, the output projection; causal
  attention) against the dense bf16 peak of the device (H200: 989.4 TFLOP/s, `flops.PEAK_BF16_FLOPS`; `--peak-tflops`
  overrides), routing replay disabled (the batch has no routes). The experts: `--train-experts`, by default
  `grouped` (`rlhf_mcore.models.grouped_experts.GroupedExperts`: one `torch._grouped_mm` per projection over the
  local experts, what the trainer builds); `grouped sequential` times Megatron's `SequentialMLP` too (one GEMM pair
  per expert: the baseline) on a second actor built after the first is freed, into "train_sequential", with
  `train.speedup_vs_sequential` (the step-time ratio);
- hf: transformers' `Qwen3MoeForCausalLM.generate` on the same weights and prompts, its default experts kernel
  (transformers 5: `grouped_mm`), SDPA, timed after a full-length warm-up run with each of `--hf-caches` (dynamic;
  static, which transformers compiles in the warm-up); `ratio_native_vs_hf` is against the faster.

Random weights: routing on a random router is nearly uniform, so top-8 sets flip on small numeric differences more
often than a trained model's would; read the mismatch and the no-replay KL as an upper side of what a real checkpoint
gives, and R3's KL (which is left to the attention and expert GEMMs' numerics) as what replay keeps.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_mfu import synthetic_batch  # noqa: E402
from bench_rollout import HF_CACHES, bench_hf, load_hf, time_native  # noqa: E402
from bench_shapes import cell, git_commit, moe_param_counts, moe_shape, random_model_dir, write_report  # noqa: E402

# per shape: rollout (batch, prompt tokens, new tokens); train (sequences, tokens each, sequences a micro-batch);
# the forward passes' micro-batch (sequences); warm-up and timed update steps
PLANS = {
    "qwen3_30b_a3b_4l": dict(rollout=(64, 256, 256), train=(32, 2048, 8), forward_micro=8, warmup=2, steps=4),
    "tiny": dict(rollout=(4, 16, 16), train=(2, 64, 1), forward_micro=4, warmup=1, steps=1),
}
SECTIONS = ("rollout", "kl", "train", "hf")
TRAIN_EXPERTS = ("grouped", "sequential")


def section(report: dict, name: str, out, fn, *args):
    """`report[name] = fn(*args)` with its seconds; an exception is recorded as the section's error (and printed),
    not raised. The report is written to `out` after it."""
    t0 = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as e:  # noqa: BLE001 - a section that fails is reported; the others still run
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"}
    report[name] = result
    times = report.setdefault("section_s", {})
    times[name] = times.get(name, 0.0) + time.perf_counter() - t0  # a section run in parts: their sum
    write_report(report, out)
    print(f"{name}: {json.dumps(result, default=str)[:1500]}", flush=True)
    return result


def prompts_for(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, length), generator=g).tolist()


# ------------------------------------------------------------------------------------------------ rollout
def native_engine(model_dir, batch: int, max_len: int, device, record_routes: bool, experts: str):
    from rlhf_mcore.rollout.native import moe
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    if experts == "looped":  # the CPU path on the GPU too (one GEMM pair per active expert)
        moe.use_grouped = lambda h: False
    return NativeRolloutEngine(model_dir, device=device, max_num_seqs=batch, max_model_len=max_len,
                               record_routes=record_routes)


def bench_native_rollout(model_dir, prompts, new_tokens, device, experts: str, keep: dict) -> dict:
    """The native engine without and with route recording; the recorded outputs go to keep["outputs"]."""
    from rlhf_mcore.rollout.native import moe

    out = {"batch": len(prompts), "prompt_len": len(prompts[0]), "new_tokens": new_tokens,
           "experts": experts if experts != "auto" else ("grouped_mm" if device.type == "cuda" else "looped")}
    grouped = moe.use_grouped
    try:
        for record in (False, True):
            key = "native_routes" if record else "native"
            engine = native_engine(model_dir, len(prompts), len(prompts[0]) + new_tokens + 8, device, record, experts)
            out["cuda_graphs"] = engine.use_graphs
            seconds, outs = time_native(engine, prompts, new_tokens, device)
            stats = engine.last_stats
            out[f"{key}_s"], out[f"{key}_tok_s"] = seconds, len(prompts) * new_tokens / seconds
            out[f"{key}_prefill_s"] = stats["prefill_s"]
            out[f"{key}_decode_ms_per_step"] = 1e3 * stats["decode_s"] / max(1, stats["decode_steps"])
            if record:
                keep["outputs"] = outs
            engine.shutdown()
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        moe.use_grouped = grouped
    out["record_routes_cost"] = out["native_routes_s"] / out["native_s"] - 1
    return out


def hf_peer(keep: dict, model_dir, prompts, new_tokens, device, dtype, caches, native: dict, hf: dict) -> dict:
    """transformers' generate timed with each of `caches` into `hf` (the report's "hf" section so far), its model
    loaded into keep["hf_model"] on the first call; HF's best so far against the native engine."""
    if "hf_model" not in keep:
        keep["hf_model"] = load_hf(model_dir, device, dtype)
        hf["experts_implementation"] = getattr(keep["hf_model"].config, "_experts_implementation", None)
    for cache in caches:
        try:
            t = bench_hf(model_dir, prompts, new_tokens, device, dtype, cache, model=keep["hf_model"])
            hf[f"hf_{cache}_s"], hf[f"hf_{cache}_tok_s"] = t, len(prompts) * new_tokens / t
        except Exception as e:  # noqa: BLE001 - a peer configuration that fails is reported
            hf[f"hf_{cache}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    timed = {c: hf[f"hf_{c}_s"] for c in HF_CACHES if f"hf_{c}_s" in hf}
    if timed:
        hf["hf_best"] = min(timed, key=timed.get)
        hf["hf_s"] = timed[hf["hf_best"]]
        hf["hf_tok_s"] = len(prompts) * new_tokens / hf["hf_s"]
        if native.get("native_s"):
            hf["ratio_native_vs_hf"] = hf["hf_s"] / native["native_s"]
            hf["ratio_native_routes_vs_hf"] = hf["hf_s"] / native["native_routes_s"]
    return hf


# ------------------------------------------------------------------------------------------------ trainer
def build_actor(model_dir, state, plan: dict, experts: str = "grouped"):
    """The actor as the trainer builds it for a MoE model (routers with a RouterReplay), weights from `model_dir`;
    experts: "grouped" (the trainer's) or "sequential" (Megatron's SequentialMLP, `moe.TRAIN_EXPERTS`)."""
    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine import EngineConfig, TrainEngine
    from rlhf_mcore.models import build_model, moe
    from rlhf_mcore.models.routing_replay import replay_config_overrides

    saved, moe.TRAIN_EXPERTS = moe.TRAIN_EXPERTS, experts
    try:
        chunks = build_model(model_dir, state, role="actor", load_weights=True,
                             config_overrides=replay_config_overrides())
    finally:
        moe.TRAIN_EXPERTS = saved
    n, _, micro = plan["train"]
    ecfg = EngineConfig(role="actor", micro_batch_size=micro, forward_micro_batch_size=plan["forward_micro"],
                        use_remove_padding=True, router_replay="R3")
    return TrainEngine(chunks, state, ecfg, OptimConfig(lr=1e-6), hf_dir=str(model_dir))


def bench_kl(engine, prompts, outputs, state) -> dict:
    """k3 KL(rollout || trainer) with R3 and without replay, and the routing mismatch (see the module docstring)."""
    from rlhf_mcore.data.batch import build_batch
    from rlhf_mcore.engine.routes import ROLLOUT_ROUTES
    from rlhf_mcore.models.routing_replay import fed_tokens, mismatch_counts
    from rlhf_mcore.trainer.stats import rollout_gap_metrics

    samples = [(p, s) for p, o in zip(prompts, outputs) for s in o.samples]
    batch = build_batch([p for p, _ in samples], [s.token_ids for _, s in samples], [s.logprobs for _, s in samples],
                        [s.finish_reason for _, s in samples], list(range(len(samples))), {}, pad_token_id=0,
                        routes=[s.routes for _, s in samples])
    batch = {k: v.to(state.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    mask, rollout_lp = batch["response_mask"], batch["rollout_log_probs"]
    out = {"sequences": len(samples), "response_tokens": int(mask.sum()),
           "dtype": str(engine.model_config.params_dtype).replace("torch.", "")}
    saved = engine.cfg
    try:
        engine.cfg = replace(saved, router_replay="R3")
        lp_r3, _ = engine.compute_log_probs(batch, with_entropy=False)
        engine.cfg = replace(saved, router_replay="disabled")
        lp_plain, _, trainer_routes = engine.compute_log_probs(batch, with_entropy=False, record_routes=True)
    finally:
        engine.cfg = saved
    for name, lp in (("r3", lp_r3), ("no_replay", lp_plain)):
        gap = rollout_gap_metrics(rollout_lp, lp, mask)
        out[name] = {"k3_kl": gap["rollout/k3_kl"], "k3_kl_max": gap["rollout/k3_kl/max"],
                     "logprob_diff_abs": gap["rollout/logprob_diff_abs"]}
    fed = fed_tokens(batch["attention_mask"]).cpu()  # the tokens the rollout routed (as Learner.routing_metrics)
    counts = mismatch_counts(trainer_routes.cpu(), batch[ROLLOUT_ROUTES].cpu(), fed)  # (n, 2)
    frac = (counts[:, 0].double() / counts[:, 1].clamp(min=1).double()).tolist()
    out["routing_mismatch"] = {"per_layer": frac, "mean": statistics.fmean(frac), "max": max(frac),
                               "tokens": int(counts[0, 1])}
    out["k3_kl_ratio_no_replay_over_r3"] = (out["no_replay"]["k3_kl"] / out["r3"]["k3_kl"]
                                            if out["r3"]["k3_kl"] > 0 else None)
    return out


def bench_train(engine, s: dict, plan: dict, state, warmup: int, steps: int, profile_out: Path | None = None) -> dict:
    """Timed `update_policy` calls on a synthetic batch (module docstring, "train")."""
    from rlhf_mcore.engine.flops import train_flops

    n, seq, micro = plan["train"]
    engine.cfg = replace(engine.cfg, router_replay="disabled", micro_batch_size=micro, mini_batch_size=n)
    batch = synthetic_batch(n, seq, s["vocab_size"], state.device)
    on_gpu = state.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    fs = engine.flop_shape
    counts = moe_param_counts(s)
    out = {"sequences": n, "seq": seq, "micro_batch_seqs": micro, "micro_batches": n // micro,
           "tokens_per_step": n * seq, "params": sum(p.numel() for c in engine.chunks for p in c.parameters()),
           "active_params": counts["active"], "total_params": counts["total"],
           "flop_matmul_params": fs.matmul_params, "flops_per_step": train_flops(fs, [seq] * n),
           "flops_counting": "6 x active matmul params (attention, router, top-k experts) + causal attention + "
                             "6 x hidden x vocab per token; recomputation not counted",
           "peak_tflops": engine.peak_flops / 1e12 if engine.peak_flops else None,
           "megatron_experts": next((type(m.experts).__name__ for m in engine.chunks[0].modules()
                                     if hasattr(m, "experts") and hasattr(m, "router")), None)}
    rows = []
    for i in range(warmup + steps):
        m = engine.update_policy(batch)
        if i >= warmup:
            rows.append(m)
        print(f"update {i}: {m['perf/actor/update_s']:.3f} s {m['perf/actor/tokens_per_s']:.0f} tok/s "
              f"mfu {m.get('perf/actor/mfu', float('nan')):.3f}", flush=True)
    out["step_s"] = statistics.median(r["perf/actor/update_s"] for r in rows)
    out["tokens_per_s"] = n * seq / out["step_s"]
    out["tflops"] = statistics.median(r["perf/actor/tflops_per_gpu"] for r in rows)
    out["mfu"] = statistics.median(r["perf/actor/mfu"] for r in rows) if "perf/actor/mfu" in rows[0] else None
    out["step_times"] = [r["perf/actor/update_s"] for r in rows]
    out["grad_norm"] = rows[-1].get("actor/grad_norm")
    if on_gpu:
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if profile_out is not None:
        out["profile"] = profile_update(engine, batch, profile_out)
    return out


def profile_update(engine, batch, path: Path) -> dict:
    """One more update under torch.profiler: the kernel table (bench_ppo_step.kernel_table) to `path`; its summary."""
    from bench_ppo_step import kernel_table
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        engine.update_policy(batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    text, summary = kernel_table(prof, wall, top=40)
    path.write_text(text + "\n")
    print(text, flush=True)
    return {**summary, "table": str(path)}


def train_other(report: dict, out, experts: str, model_dir, s: dict, plan: dict, state, warmup: int, steps: int):
    """The train section on an actor with other experts, into report[f"train_{experts}"]; the first run's step
    time over its: report["train"][f"speedup_vs_{experts}"]."""
    name = f"train_{experts}"
    engine = None
    try:
        engine = build_actor(model_dir, state, plan, experts)
        section(report, name, out, bench_train, engine, s, plan, state, warmup, steps)
    except Exception as e:  # noqa: BLE001 - as a section's error
        report[name] = {"error": f"actor build: {type(e).__name__}: {str(e)[:400]}"}
    finally:
        del engine
        gc.collect()
        if state.device.type == "cuda":
            torch.cuda.empty_cache()
    first, other = report.get("train", {}), report[name]
    if first.get("step_s") and other.get("step_s"):
        first[f"speedup_vs_{experts}"] = other["step_s"] / first["step_s"]
    write_report(report, out)


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(PLANS), default="qwen3_30b_a3b_4l")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help="what to run (kl needs rollout's recorded samples)")
    p.add_argument("--hf-caches", nargs="+", choices=HF_CACHES, default=list(HF_CACHES),
                   help="HF generate's KV caches to time (the ratio is against the faster)")
    p.add_argument("--native-experts", choices=("auto", "looped"), default="auto",
                   help="the native engine's expert path: auto (grouped GEMMs on CUDA bf16) or looped")
    p.add_argument("--train-experts", nargs="+", choices=TRAIN_EXPERTS, default=["grouped"],
                   help="the train section's experts: grouped (the trainer's), sequential (Megatron's SequentialMLP) "
                        "or both, the first into 'train' (and kl), the second into 'train_<name>'")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--micro", type=int, default=None, help="sequences a training micro-batch (default: per shape)")
    p.add_argument("--train-seqs", type=int, default=None,
                   help="sequences an update (one optimizer step; default: per shape); a multiple of --micro")
    p.add_argument("--profile", action="store_true",
                   help="train: one more update under torch.profiler, its kernel table next to --out (.profile.txt)")
    p.add_argument("--init-std", type=float, default=0.02, help="the random weights' std (initializer_range)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense bf16 peak in TFLOP/s (default: looked up by name; H200 989.4)")
    p.add_argument("--model-dir", default=None, help="where to write the random model (default: a temporary one)")
    p.add_argument("--out", default=None, help="JSON output (default $OUT/bench_moe.json or ./bench_moe.json)")
    args = p.parse_args(argv)
    if args.peak_tflops is not None:
        if args.peak_tflops <= 0:
            p.error(f"--peak-tflops {args.peak_tflops}: give the device's dense bf16 peak, e.g. 989.4")
        from rlhf_mcore.engine.flops import PEAK_ENV

        os.environ[PEAK_ENV] = repr(args.peak_tflops * 1e12)
    if "kl" in args.sections and "rollout" not in args.sections:
        p.error("--sections kl needs rollout (it scores the rollout's recorded samples)")
    out_path = Path(args.out or (Path(os.environ["OUT"]) / "bench_moe.json" if os.environ.get("OUT")
                                 else "bench_moe.json"))

    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    t_start = time.perf_counter()
    state = init_distributed(tp=1, pp=1, seed=1, device=args.device)  # device=cpu hides the GPUs (cpu_compat)
    device = state.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    s = moe_shape(args.shape, initializer_range=args.init_std)
    plan = dict(PLANS[args.shape])
    if args.micro or args.train_seqs:
        n, seq, micro = plan["train"]
        plan["train"] = (args.train_seqs or n, seq, args.micro or micro)
        if plan["train"][0] % plan["train"][2]:
            p.error(f"--train-seqs {plan['train'][0]} is not a multiple of the micro-batch {plan['train'][2]}")
    warmup = plan["warmup"] if args.warmup is None else args.warmup
    steps = plan["steps"] if args.steps is None else args.steps
    from rlhf_mcore.engine.flops import peak_flops_and_source

    peak, peak_source = peak_flops_and_source(device)
    report = {"benchmark": "moe", "shape_name": args.shape, "shape": s, "commit": git_commit(),
              "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "dtype": str(dtype).replace("torch.", ""), "params": moe_param_counts(s),
              "peak_tflops": peak / 1e12 if peak else None, "peak_source": peak_source,
              "call": "python launch/bench/bench_moe.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    try:
        import transformers

        report["transformers"] = transformers.__version__
    except ImportError:
        pass
    batch, prompt_len, new_tokens = plan["rollout"]
    prompts = prompts_for(batch, prompt_len, s["vocab_size"])
    keep: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir or Path(tmp) / "model")
        t0 = time.perf_counter()
        random_model_dir(s, model_dir, device, dtype, seed=0)
        report["model_dir_s"] = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if "rollout" in args.sections:
            ro = section(report, "rollout", out_path, bench_native_rollout, model_dir, prompts, new_tokens, device,
                         args.native_experts, keep)
            if "error" in ro and args.native_experts == "auto" and device.type == "cuda":
                grouped_error = ro["error"]  # the grouped GEMMs failed: the looped experts still give kl its rollout
                ro = section(report, "rollout", out_path, bench_native_rollout, model_dir, prompts, new_tokens,
                             device, "looped", keep)
                ro["grouped_mm_error"] = grouped_error
                write_report(report, out_path)
        # HF's dynamic cache now, its static one (compiled in its warm-up: the slowest part) last, one model for both
        caches = [c for c in HF_CACHES if c in args.hf_caches]
        early, late = [c for c in caches if c != "static"], [c for c in caches if c == "static"]
        hf_args = (keep, model_dir, prompts, new_tokens, device, dtype)
        if "hf" in args.sections and early:
            section(report, "hf", out_path, hf_peer, *hf_args, early, report.get("rollout", {}), {})
        if {"kl", "train"} & set(args.sections):
            t0 = time.perf_counter()
            try:
                engine = build_actor(model_dir, state, plan, args.train_experts[0])
            except Exception as e:  # noqa: BLE001 - its error stands for the sections that need the actor
                import traceback

                traceback.print_exc()
                engine = None
                for name in {"kl", "train"} & set(args.sections):
                    report[name] = {"error": f"actor build: {type(e).__name__}: {str(e)[:400]}"}
            report["actor_build_s"] = time.perf_counter() - t0
            if "kl" in args.sections and engine is not None:
                if "outputs" in keep:
                    section(report, "kl", out_path, bench_kl, engine, prompts, keep.pop("outputs"), state)
                else:
                    report["kl"] = {"error": "no recorded rollout (the rollout section failed)"}
            if "train" in args.sections and engine is not None:
                section(report, "train", out_path, bench_train, engine, s, plan, state, warmup, steps,
                        Path(out_path).with_suffix(".profile.txt") if args.profile else None)
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if "train" in args.sections:
                others = [e for e in dict.fromkeys(args.train_experts) if e != args.train_experts[0]]
                for experts in others:  # the baseline, on its own actor
                    train_other(report, out_path, experts, model_dir, s, plan, state, warmup, steps)
        if "hf" in args.sections and late:
            section(report, "hf", out_path, hf_peer, *hf_args, late, report.get("rollout", {}), report.get("hf", {}))
        keep.pop("hf_model", None)
    destroy_distributed()
    report["total_s"] = time.perf_counter() - t_start
    write_report(report, out_path)
    print_summary(report)
    print(f"wrote {out_path}")
    return report


def print_summary(r: dict) -> None:
    print(f"\n{r['device']}  torch {r['torch']}  transformers {r.get('transformers')}  commit {r['commit']}  "
          f"{r['dtype']}  {r['shape_name']}: {r['params']['total'] / 1e9:.2f} B params, "
          f"{r['params']['active'] / 1e9:.2f} B active")
    t, ro, hf, kl = (r.get(k, {}) for k in ("train", "rollout", "hf", "kl"))
    for key in ["train"] + [k for k in r if k.startswith("train_")]:
        t = r.get(key, {})
        print(f"update  {t.get('megatron_experts', key):>14}  {cell(t, 'tokens_per_step', '>7')} tokens/step  "
              f"{cell(t, 'tokens_per_s', '>9.0f')} tok/s  {cell(t, 'tflops', '>7.1f')} TFLOP/s  MFU "
              f"{cell(t, 'mfu', '>6.1%')} (active params, peak {cell(r, 'peak_tflops', '.1f')} TFLOP/s)  "
              f"{t.get('error', '')}")
    for key, x in r.get("train", {}).items():
        if key.startswith("speedup_vs_"):
            print(f"update  {r['train'].get('megatron_experts')} x{x:.2f} faster than "
                  f"{r.get('train_' + key.removeprefix('speedup_vs_'), {}).get('megatron_experts')} (step time)")
    t = r.get("train", {})
    print(f"rollout native {cell(ro, 'native_tok_s', '>8.0f')} tok/s, with routes "
          f"{cell(ro, 'native_routes_tok_s', '>8.0f')}  HF best {cell(hf, 'hf_tok_s', '>8.0f')} "
          f"({hf.get('hf_best', '-')})  x{cell(hf, 'ratio_native_vs_hf', '.2f')}  {ro.get('error', '')} "
          f"{hf.get('error', '')}")
    if "r3" in kl:
        print(f"k3 KL   R3 {kl['r3']['k3_kl']:.3g}  no replay {kl['no_replay']['k3_kl']:.3g}  routing mismatch "
              f"mean {kl['routing_mismatch']['mean']:.3f} max {kl['routing_mismatch']['max']:.3f}")
    elif kl:
        print(f"k3 KL   {kl.get('error', '')}")


if __name__ == "__main__":
    main()
