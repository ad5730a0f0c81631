"""Actor-update MFU through the train engine's real update path: Qwen2.5 0.5B / 1.5B / 7B shapes, 1k and 4k tokens.

    python launch/bench/bench_mfu.py [--shapes 0.5b 1.5b 7b] [--seqs 1024 4096] [--steps 3] [--out FILE.json]
    python launch/bench/bench_mfu.py --tiny                      # CPU smoke run on a tiny shape
    python launch/bench/bench_mfu.py --no-peer --peak-tflops 989.4   # Megatron only; the peak given by hand
    python launch/bench/bench_mfu.py --shapes 0.5b --profile prof/   # + op tables of one more update per case
    python launch/bench/bench_mfu.py --fused-kernels off             # Megatron without the fused layer kernels
    python launch/bench/bench_mfu.py --cuda-graphs off               # Megatron's decoder eager, not CUDA graphs
    python launch/bench/bench_mfu.py --fp8 e4m3                      # FP8 decoder GEMMs (FLOPs at the bf16 peak)
    python launch/bench/bench_mfu.py --fp8 hybrid --fp8-recipe tensorwise   # one scale per tensor (megatron.fp8_recipe)
    python launch/bench/bench_mfu.py --fp8 hybrid --fp8-recipe tensorwise --fp8-weight-cache   # W cast once a step
    python launch/bench/bench_mfu.py --fp8 hybrid --fp8-recipe delayed --fp8-weight-cache   # x, dy cast in one read
    python launch/bench/bench_mfu.py --shapes 7b --recompute-block 8  # recompute 8 of 28 layers, keep the rest
    python launch/bench/bench_mfu.py --shapes 7b --peer-params bf16  # the peer in bf16 (its fp32 run is OOM at 7B)
    python launch/bench/bench_mfu.py --shapes 0.5b --grad-accum-fusion   # weight gradients straight into main_grad
    python launch/bench/bench_mfu.py --shapes 7b --layers 10 --no-peer   # the 7B width in 10 layers (fits 80 GB)

What runs: `rlhf_mcore.models.build_model` (random init, bf16, SDPA/flex attention spec) wrapped in a
`rlhf_mcore.engine.TrainEngine` actor — Megatron DDP (fp32 gradient buffer), the distributed optimizer (Adam,
fp32 master weights), gradient clipping, LR schedule — and `update_policy` on a synthetic PPO batch: every
sequence is `seq` tokens long (a quarter prompt, the rest response; random token ids, random advantages,
old log-probs at the uniform-policy value), packed (THD, `use_remove_padding`, what the trainer runs) into
micro-batches of `micro` sequences, one optimizer step per `update_policy` call (mini-batch = the whole batch).
The decoder runs as CUDA graphs where the engine graphs by default (no recompute, micro-batches of up to 8k tokens;
`--cuda-graphs`).
The loss is the PPO clipped policy loss with its log-probs computed by the engine's log-prob backend.

Each shape runs in its own process (Megatron's global state, and an out-of-memory error stays contained). Per
(shape, seq): median over `--steps` timed updates after `--warmup`, tokens/s, TFLOP/s and MFU from
`rlhf_mcore.engine.flops` (causal attention FLOPs, activation recomputation not counted; the device's dense bf16
peak looked up by its name — `--peak-tflops` overrides, an unlisted GPU reports no MFU), peak memory
(`torch.cuda.max_memory_allocated`).

The peer, measured in the same call (`--no-peer` leaves it out): a plain transformers `Qwen2ForCausalLM` of the
same shape (random init, fp32 weights, AMP bf16 autocast, `torch.compile`, fused AdamW, gradient clipping) on the
same micro-batches (padded: every sequence is `seq` long, so nothing is padding) and the same PPO clipped loss over
the response tokens; the table prints its tokens/s and the ratio Megatron / peer. On a CPU the peer is not compiled
unless `--peer-compile on` (compiling takes minutes there) and runs fp32 without autocast. At 7B the fp32 peer
needs 16 bytes a parameter (122 GB) plus its activations and ran out of memory on an H200 at 139 GiB (session 32);
`--peer-params bf16` keeps its weights, gradients and AdamW state in bf16 (8 bytes a parameter), a lighter optimizer
than the engine's fp32 master weights.

Memory settings per shape (`PLANS`): 0.5B and 1.5B train without activation recomputation; 7B on one GPU holds
16 bytes a parameter before any activation (bf16 params 15.2 GB, fp32 grads 30.5, fp32 master 30.5, Adam 60.9 =
137 GB of the H200's 150 GB; the distributed optimizer shards nothing at DP=1), so it recomputes activations
(full, one layer at a time) and feeds 4k tokens a micro-batch. 0.5B at 4k feeds 32k tokens a micro-batch (8
sequences, 8 micro-batches a step; the GRPO config's size): eager, since the engine graphs only micro-batches of up
to 8k tokens unless `--cuda-graphs on`, and faster than 8k graphed ones (`--micro 2`, the plan until session 33);
the peer gets the same micro-batches, whose fp32 logits alone take ~20 GB.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_shapes import (  # noqa: E402
    ALIASES,
    cell,
    git_commit,  # noqa: E402
    write_config,
    write_report,  # noqa: E402
)
from bench_shapes import shape as get_shape  # noqa: E402

# per shape: recompute?, and per sequence length: (sequences per micro-batch, micro-batches per optimizer step).
# 0.5B / 4k: 32k-token micro-batches (the GRPO config's size), eager (graphs are for <= 8k tokens): 40.6% MFU
# against 36.3% at 2 x 4,096 tokens with graphs, 38.6% at 4 (one H200, session 33; the step holds 8 of them)
PLANS = {
    "qwen2.5-0.5b": {"recompute": False, "seqs": {1024: (4, 16), 4096: (8, 8)}},
    "qwen2.5-1.5b": {"recompute": False, "seqs": {1024: (4, 8), 4096: (1, 16)}},
    "qwen2.5-7b": {"recompute": True, "seqs": {1024: (4, 4), 4096: (1, 4)}, "warmup": 1},
    "tiny": {"recompute": False, "seqs": {32: (2, 2), 64: (1, 2)}},
}


def synthetic_batch(n: int, seq: int, vocab: int, device, seed: int = 0) -> dict:
    """n sequences of `seq` tokens: prompt seq//4, response the rest; what update_policy reads."""
    import torch

    P = max(1, seq // 4)
    R = seq - P
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return {k: v.to(device) for k, v in {
        "input_ids": ids, "attention_mask": torch.ones(n, seq, dtype=torch.long),
        "responses": ids[:, P:], "response_mask": torch.ones(n, R, dtype=torch.long),
        "old_log_probs": torch.full((n, R), -math.log(vocab)) + 0.1 * torch.randn(n, R, generator=g),
        "advantages": torch.randn(n, R, generator=g)}.items()}


def profile_update(step, path: Path, label: str) -> None:
    """One more call of `step` under torch.profiler: tables by device time and by host time written to `path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    avg = prof.key_averages()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    by_device = avg.table(sort_by=sort, row_limit=40, max_name_column_width=70)
    by_host = avg.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70)
    path.write_text(f"# {label}\n## by {sort}\n{by_device}\n## by cpu_time_total\n{by_host}")
    print(f"profile of {label} written to {path}", flush=True)


def run_shape(name: str, seqs: list[int], warmup: int, steps: int, out: Path, micro_override: int | None,
              layout: str, profile_dir: Path | None = None, fused_kernels: str = "auto",
              cuda_graphs: str = "auto", fp8: str | None = None, fp8_recipe: str = "rowwise",
              recompute_block: int | None = None, grad_accum_fusion: bool = False,
              layers: int | None = None, fp8_weight_cache: bool | str = False) -> None:
    """One shape (with `layers` decoder layers when given), in this process: build the actor engine once, then time
    each sequence length."""
    import torch

    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine import EngineConfig, TrainEngine
    from rlhf_mcore.engine.builder import recompute_overrides
    from rlhf_mcore.models import build_model
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    state = init_distributed(tp=1, pp=1, seed=1)
    on_gpu = state.device.type == "cuda"
    s = get_shape(name, **({"num_hidden_layers": layers} if layers else {}))
    plan = PLANS[name]
    result = {"shape": name, "layers": s["num_hidden_layers"],
              "device": torch.cuda.get_device_name(state.device) if on_gpu else "cpu",
              "params": None, "recompute": plan["recompute"], "layout": layout,
              "recompute_block": recompute_block if plan["recompute"] else None,
              "grad_buffer": "fp32", "optimizer": "megatron distributed (Adam, fp32 master)", "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        write_config(s, Path(tmp), dtype="bfloat16" if on_gpu else "float32")
        t0 = time.perf_counter()
        overrides = recompute_overrides(plan["recompute"], recompute_block and "block", recompute_block)
        if grad_accum_fusion:  # override_transformer_config.gradient_accumulation_fusion (as build_engine sets it)
            from rlhf_mcore.models.grad_accum_fusion import install

            install()
            overrides["gradient_accumulation_fusion"] = True
            cuda_graphs = "off"  # graphed layers see parameter aliases without main_grad
        result["grad_accum_fusion"] = grad_accum_fusion
        chunks = build_model(tmp, state, role="actor", load_weights=False, config_overrides=overrides or None,
                             fused_kernels={"auto": None, "on": True, "off": False}[fused_kernels])
        result["fused_kernels"] = chunks[0].config.fused_rope_kernel
        if fp8:  # megatron.fp8: the decoder's linears in FP8 (rlhf_mcore.models.fp8_training); MFU stays at bf16 peak
            from rlhf_mcore.models.fp8_training import enable_fp8_training

            result["fp8"], result["fp8_recipe"], result["fp8_weight_cache"] = fp8, fp8_recipe, fp8_weight_cache
            result["fp8_linears"] = enable_fp8_training(chunks, fp8, "--fp8", fp8_recipe, fp8_weight_cache)
        result["params"] = sum(p.numel() for c in chunks for p in c.parameters())
        micro_sizes = {seq: (micro_override or plan["seqs"].get(seq, (1, 4))[0]) for seq in seqs}
        n_micro = {seq: plan["seqs"].get(seq, (1, 4))[1] for seq in seqs}
        ecfg = EngineConfig(role="actor", micro_batch_size=1, use_remove_padding=layout == "packed",
                            cuda_graphs={"auto": None, "on": True, "off": False}[cuda_graphs])
        engine = TrainEngine(chunks, state, ecfg, OptimConfig(lr=1e-6))
        result["cuda_graphs"] = bool(engine._graphs)
        result["build_s"] = time.perf_counter() - t0
        result["static_mem_gib"] = torch.cuda.memory_allocated() / 2**30 if on_gpu else None
        for seq in seqs:
            mbs, nm = micro_sizes[seq], n_micro[seq]
            n = mbs * nm
            engine.cfg.micro_batch_size = engine.cfg.forward_micro_batch_size = mbs
            engine.cfg.mini_batch_size = n
            batch = synthetic_batch(n, seq, s["vocab_size"], state.device)
            case = {"seq": seq, "micro_batch_seqs": mbs, "micro_batches": nm, "tokens_per_step": n * seq}
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            try:
                rows = []
                warm = min(warmup, plan.get("warmup", warmup))  # 7B: one warm-up step is enough (and costly)
                for i in range(warm + steps):
                    m = engine.update_policy(batch)
                    if i >= warm:
                        rows.append(m)
                    print(f"{name} seq {seq} step {i}: {m['perf/actor/update_s']:.3f} s "
                          f"{m['perf/actor/tokens_per_s']:.0f} tok/s mfu {m.get('perf/actor/mfu', float('nan')):.3f}",
                          flush=True)
                step_s = statistics.median(r["perf/actor/update_s"] for r in rows)
                tflops = statistics.median(r["perf/actor/tflops_per_gpu"] for r in rows)
                case.update(step_s=step_s, tokens_per_s=n * seq / step_s, tflops=tflops,
                            mfu=statistics.median(r["perf/actor/mfu"] for r in rows) if "perf/actor/mfu" in rows[0]
                            else None, loss=rows[-1].get("actor/pg_loss"), grad_norm=rows[-1].get("actor/grad_norm"),
                            graph_captures=engine.graph_captures,
                            step_times=[r["perf/actor/update_s"] for r in rows])
                if profile_dir is not None:
                    profile_update(functools.partial(engine.update_policy, batch), profile_dir / f"{name}_{seq}.txt",
                                   f"megatron {name} seq {seq}")
            except torch.cuda.OutOfMemoryError as e:  # recorded: "what fits" is a result too
                case["error"] = f"out of memory: {str(e).splitlines()[0]}"
                print(f"{name} seq {seq}: {case['error']}", flush=True)
            if on_gpu:
                case["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                case["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            result["cases"][str(seq)] = case
            out.write_text(json.dumps(result, indent=1))  # partial results survive a later crash
            del batch
            if on_gpu:
                torch.cuda.empty_cache()
    destroy_distributed()


def run_peer(name: str, seqs: list[int], warmup: int, steps: int, out: Path, micro_override: int | None,
             compile_mode: str, profile_dir: Path | None = None, params: str = "fp32", layers: int | None = None
             ) -> None:
    """The plain PyTorch peer of `run_shape` for one shape, in this process: same shape, micro-batches and loss.
    `params`: fp32 (weights and AdamW state fp32, AMP bf16: the standard recipe) or bf16 (weights, gradients and AdamW
    state bf16, no master copy: 8 bytes a parameter against 16, the configuration that fits a 7B update with its
    optimizer on one H200, numerically weaker than both the fp32 peer and the engine's fp32 master weights)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    compiled = compile_mode == "on" or (compile_mode == "auto" and on_gpu)
    s = get_shape(name, **({"num_hidden_layers": layers} if layers else {}))
    plan = PLANS[name]
    result = {"shape": name, "layers": s["num_hidden_layers"], "peer": "transformers Qwen2ForCausalLM",
              "compiled": compiled,
              "amp": "bf16" if on_gpu else None, "optimizer": "torch AdamW" + (" (fused)" if on_gpu else ""),
              "cases": {}}
    torch.manual_seed(1)
    cfg = Qwen2Config(**s, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    if params == "bf16":
        model.to(torch.bfloat16)
    result["params_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")  # what the optimizer steps
    if plan["recompute"]:
        model.gradient_checkpointing_enable()
    model.train()
    result["params"] = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=on_gpu)
    step_model = torch.compile(model) if compiled else model

    def loss_fn(batch, P):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu):
            logits = step_model(input_ids=batch["input_ids"]).logits[:, P - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"][..., None]).squeeze(-1)
        ratio = torch.exp(logp - batch["old_log_probs"])
        adv = batch["advantages"]
        return torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()

    def train_step(micro, P, nm):
        for mb in micro:
            (loss_fn(mb, P) / nm).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return grad_norm

    for seq in seqs:
        mbs = micro_override or plan["seqs"].get(seq, (1, 4))[0]
        nm = plan["seqs"].get(seq, (1, 4))[1]
        P = max(1, seq // 4)
        batch = synthetic_batch(mbs * nm, seq, s["vocab_size"], device)
        micro = [{k: v[i * mbs:(i + 1) * mbs] for k, v in batch.items()} for i in range(nm)]
        case = {"seq": seq, "micro_batch_seqs": mbs, "micro_batches": nm, "tokens_per_step": mbs * nm * seq}
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        try:
            times = []
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                grad_norm = train_step(micro, P, nm)
                if on_gpu:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if i >= warmup:
                    times.append(dt)
                print(f"peer {name} seq {seq} step {i}: {dt:.3f} s {mbs * nm * seq / dt:.0f} tok/s", flush=True)
            step_s = statistics.median(times)
            case.update(step_s=step_s, tokens_per_s=mbs * nm * seq / step_s, grad_norm=float(grad_norm),
                        step_times=times)
            if profile_dir is not None:
                profile_update(functools.partial(train_step, micro, P, nm), profile_dir / f"peer_{name}_{seq}.txt",
                               f"peer {name} seq {seq}")
        except torch.cuda.OutOfMemoryError as e:
            case["error"] = f"out of memory: {str(e).splitlines()[0]}"
            print(f"peer {name} seq {seq}: {case['error']}", flush=True)
        if on_gpu:
            case["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["cases"][str(seq)] = case
        out.write_text(json.dumps(result, indent=1))
        del batch, micro
        if on_gpu:
            torch.cuda.empty_cache()


def peer_ratios(megatron: dict, peer: dict) -> dict[str, float | None]:
    """Per sequence length: Megatron tokens/s over the peer's (None where either failed)."""
    out = {}
    for seq, case in megatron.get("cases", {}).items():
        other = peer.get("cases", {}).get(seq, {})
        a, b = case.get("tokens_per_s"), other.get("tokens_per_s")
        out[seq] = a / b if a and b else None
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=None, help="0.5b 1.5b 7b (default all; --tiny: tiny)")
    p.add_argument("--seqs", type=int, nargs="+", default=None, help="tokens a sequence (default 1024 4096)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro", type=int, default=None, help="sequences a micro-batch (default: per shape plan)")
    p.add_argument("--layout", choices=("packed", "padded"), default="packed")
    p.add_argument("--tiny", action="store_true", help="tiny shape (CPU smoke run)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per shape")
    p.add_argument("--no-peer", action="store_true", help="leave the compiled transformers peer out")
    p.add_argument("--peer-compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile the peer (auto: on a GPU only)")
    p.add_argument("--peer-params", choices=("fp32", "bf16"), default="fp32",
                   help="the peer's weights and AdamW state: fp32 with AMP (default) or bf16 (8 bytes a parameter: "
                        "what fits a 7B peer with its optimizer on one H200, where fp32's 16 run out of memory)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense bf16 peak in TFLOP/s (default: looked up by device name)")
    p.add_argument("--out", default=None)
    p.add_argument("--fused-kernels", choices=("auto", "on", "off"), default="auto",
                   help="the train engine's fused SwiGLU/RoPE kernels (auto: on for CUDA with triton)")
    p.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                   help="the decoder as CUDA graphs (auto: where supported: no recompute, TP = PP = 1)")
    p.add_argument("--fp8", choices=("e4m3", "hybrid"), default=None,
                   help="FP8 GEMMs in the decoder's linears (megatron.fp8); FLOPs still counted at the bf16 peak")
    p.add_argument("--fp8-recipe", choices=("rowwise", "tensorwise", "delayed"), default="rowwise",
                   help="how --fp8 scales the GEMM operands (megatron.fp8_recipe; delayed: tensorwise with the "
                        "activations' scales from earlier steps, history of 16 steps)")
    p.add_argument("--fp8-weight-cache", nargs="?", const="true", choices=["true", "forward"], default=None,
                   help="keep each weight's FP8 codes between optimizer steps (megatron.fp8_weight_cache; tensorwise): "
                        "true (bare flag) codes and transposes, forward the codes only")
    p.add_argument("--grad-accum-fusion", action="store_true",
                   help="the weight-gradient GEMMs accumulate into main_grad (megatron.override_transformer_config."
                        "gradient_accumulation_fusion; the decoder then runs eager)")
    p.add_argument("--recompute-block", type=int, default=None, metavar="N",
                   help="where the shape recomputes activations (7B): only the first N layers (Megatron's block "
                        "method, override_transformer_config.recompute_method=block); the others keep theirs")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="decoder layers of each shape (default its own): e.g. the 7B width in 10 layers fits an 80 GB "
                        "card, a stand-in for per-layer comparisons (the LM head's share of the step is larger)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after timing, profile one more update per (shape, seq) and write op tables to DIR")
    p.add_argument("--one-shape", default=None, help=argparse.SUPPRESS)  # internal: the per-shape child
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)  # internal: the child runs the peer
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peak_tflops is not None:
        if args.peak_tflops <= 0:
            p.error(f"--peak-tflops {args.peak_tflops}: give the device's dense bf16 peak, e.g. 989.4")
        from rlhf_mcore.engine.flops import PEAK_ENV

        os.environ[PEAK_ENV] = repr(args.peak_tflops * 1e12)  # the engine in each child reads it

    prof = Path(args.profile).resolve() if args.profile else None
    if args.one_shape:
        if args.peer:
            run_peer(args.one_shape, args.seqs, args.warmup, args.steps, Path(args.child_out), args.micro,
                     args.peer_compile, prof, args.peer_params, args.layers)
        else:
            run_shape(args.one_shape, args.seqs, args.warmup, args.steps, Path(args.child_out), args.micro,
                      args.layout, prof, args.fused_kernels, args.cuda_graphs, args.fp8, args.fp8_recipe,
                      args.recompute_block, args.grad_accum_fusion, args.layers,
                      {None: False, "true": True}.get(args.fp8_weight_cache, args.fp8_weight_cache))
        return {}

    import torch

    shapes = ["tiny"] if args.tiny else [ALIASES.get(x, x) for x in (args.shapes or ["0.5b", "1.5b", "7b"])]
    for name in shapes:
        get_shape(name)  # unknown names fail here, with the choices
    from rlhf_mcore.engine.flops import peak_flops_and_source

    peak, peak_source = peak_flops_and_source(torch.device("cuda", 0) if torch.cuda.is_available() else "cpu")
    report = {"benchmark": "actor_update_mfu", "commit": git_commit(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "peak_tflops": peak / 1e12 if peak else None, "peak_source": peak_source, "results": {}, "peer": {}}
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=os.environ.get("PYTORCH_CUDA_ALLOC_CONF",
                                                                  "expandable_segments:True"))
    with tempfile.TemporaryDirectory() as tmp:
        for name in shapes:
            seqs = args.seqs or list(PLANS[name]["seqs"])
            child_out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, __file__, "--one-shape", name, "--child-out", str(child_out), "--seqs",
                   *map(str, seqs), "--warmup", str(args.warmup), "--steps", str(args.steps), "--layout", args.layout]
            if args.micro:
                cmd += ["--micro", str(args.micro)]
            if args.layers:
                cmd += ["--layers", str(args.layers)]
            if prof is not None:
                cmd += ["--profile", str(prof)]
            megatron_cmd = [*cmd, "--fused-kernels", args.fused_kernels, "--cuda-graphs", args.cuda_graphs,
                            *(["--fp8", args.fp8, "--fp8-recipe", args.fp8_recipe] if args.fp8 else []),
                            *(["--fp8-weight-cache", args.fp8_weight_cache] if args.fp8_weight_cache else []),
                            *(["--recompute-block", str(args.recompute_block)] if args.recompute_block else []),
                            *(["--grad-accum-fusion"] if args.grad_accum_fusion else [])]
            report["results"][name] = _child(megatron_cmd, child_out, name, env, args.timeout)
            if not args.no_peer:
                peer_out = Path(tmp) / f"{name}.peer.json"
                cmd = [*cmd[:5], str(peer_out), *cmd[6:], "--peer", "--peer-compile", args.peer_compile,
                       "--peer-params", args.peer_params]
                report["peer"][name] = peer = _child(cmd, peer_out, name, env, args.timeout)
                peer["ratio_megatron_over_peer"] = peer_ratios(report["results"][name], peer)
    print(f"\n{report['device']}  torch {report['torch']}  commit {report['commit']}")
    print(f"peak {cell(report, 'peak_tflops', '.1f')} TFLOP/s dense bf16 ({peak_source})")
    print(f"{'shape':<14} {'seq':>5} {'micro':>7} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} "
          f"{'peer tok/s':>10} {'ratio':>6}  note")
    for name, res in report["results"].items():
        peer = report["peer"].get(name, {})
        for seq, c in res.get("cases", {}).items():
            pc = {**peer.get("cases", {}).get(seq, {}), "ratio": peer.get("ratio_megatron_over_peer", {}).get(seq)}
            print(f"{name:<14} {seq:>5} {c['micro_batch_seqs']:>3}x{c['micro_batches']:<3} "
                  f"{cell(c, 'tokens_per_s', '>9.0f')} {cell(c, 'tflops', '>8.1f')} {cell(c, 'mfu', '>6.1%')} "
                  f"{cell(c, 'peak_mem_gib', '>9.1f')} {cell(pc, 'tokens_per_s', '>10.0f')} "
                  f"{cell(pc, 'ratio', '>6.2f')}  {c.get('error', '')} {pc.get('error', '')}".rstrip())
        if res.get("returncode") not in (0, None):
            print(f"{name:<14} process ended with {res['returncode']}")
    write_report(report, args.out)
    return report


def _child(cmd: list[str], out: Path, name: str, env: dict, timeout: int) -> dict:
    """Run one per-shape child; its JSON (whatever it wrote before a crash) with its return code and seconds."""
    t0 = time.time()
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    res = json.loads(out.read_text()) if out.is_file() else {"shape": name, "cases": {}}
    res["returncode"], res["seconds"] = rc, time.time() - t0
    return res


if __name__ == "__main__":
    main()
