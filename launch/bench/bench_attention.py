"""Training throughput of Megatron's local layer spec against the same spec with SDPA core attention.

    python launch/bench/bench_attention.py [--backends local sdpa] [--steps 10] [--out FILE.json]
    python launch/bench/bench_attention.py --tiny --steps 2      # CPU smoke run on a tiny shape

Side by side in one run, on one GPU: a Qwen2.5-0.5B-shaped GPTModel (hidden 896, 24 layers, 14 heads, 2 KV
heads, ffn 4864, vocab 151936, tied embeddings; random weights) in bf16 with fp32 master weights, Megatron
DDP and its distributed optimizer (Adam), trained on random tokens through `get_forward_backward_func`:

- workload A: 4 sequences × 1024 tokens a micro-batch, 4 micro-batches a step;
- workload B: 2 sequences × 4096 tokens a micro-batch, 2 micro-batches a step.

Every backend builds its model through `rlhf_mcore.models.build_model` (so the SDPA path measured is the one
training uses); attention masks are None (causal): the local spec then builds Megatron's default causal mask,
the SDPA spec takes the `is_causal=True` fast path. Reported per backend and workload: median step time over
`--steps` timed steps (after `--warmup` steps), tokens/s and MFU from `rlhf_mcore.engine.flops` (causal
attention FLOPs; dense bf16 datasheet peak). The hardware, software versions and git commit are recorded.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_shapes import QWEN25_05B, TINY, write_config, write_report  # noqa: E402

WORKLOADS = {"4x1024x4": (4, 1024, 4), "2x4096x2": (2, 4096, 2)}
TINY_WORKLOADS = {"2x32x2": (2, 32, 2), "1x64x2": (1, 64, 2)}


def environment() -> dict:
    import torch

    info = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import megatron.core
        info["megatron_core"] = megatron.core.__version__
    except Exception:  # noqa: BLE001 - recorded, not fatal
        info["megatron_core"] = "unknown"
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    else:
        info["device"] = "cpu"
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                        cwd=Path(__file__).resolve().parents[2]).stdout.strip() or "unknown"
    except OSError:
        info["commit"] = "unknown"
    return info


def build(model_dir: Path, state, backend: str):
    """Chunks wrapped in DDP with the distributed optimizer, as the train engine does."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from rlhf_mcore.models import build_model

    (chunk,) = build_model(model_dir, state, load_weights=False, attention_backend=backend)
    cfg = chunk.config
    ddp = DistributedDataParallel(config=cfg, module=chunk, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False))
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = ddp.no_sync
    opt_cfg = OptimizerConfig(optimizer="adam", lr=1e-5, bf16=cfg.bf16, params_dtype=cfg.params_dtype,
                              use_distributed_optimizer=True, clip_grad=1.0)
    opt = get_megatron_optimizer(opt_cfg, [ddp])
    return chunk, ddp, opt


def train_step(ddp, opt, batches, seq: int, mbs: int, mask) -> None:
    """One optimizer step over the micro-batches (B, S + 1) of random tokens; mask None = causal."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    positions = torch.arange(seq, device=batches[0].device)[None].expand(mbs, seq)

    def forward_step(data_iter, model):
        tokens = next(data_iter)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        per_token = model(inputs, positions, mask, labels=labels)  # (B, S) cross-entropy

        def loss_func(out):
            loss = out.float().mean()
            return loss, {"loss": loss.detach().clone()}
        return per_token, loss_func

    ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=ddp,
                                num_microbatches=len(batches), seq_length=seq, micro_batch_size=mbs,
                                forward_only=False)
    opt.step()


def bench(model_dir: Path, state, backend: str, workloads: dict, warmup: int, steps: int, vocab: int) -> dict:
    import torch

    from rlhf_mcore.engine.flops import FlopShape, mfu, peak_flops, train_flops

    chunk, ddp, opt = build(model_dir, state, backend)
    flop_shape = FlopShape.from_transformer_config(chunk.config, vocab)
    peak = peak_flops(state.device)
    out = {}
    for name, (mbs, seq, n_micro) in workloads.items():
        g = torch.Generator(device="cpu").manual_seed(0)
        batches = [torch.randint(0, vocab, (mbs, seq + 1), generator=g).to(state.device) for _ in range(n_micro)]
        # on GPU no mask (causal); on CPU an explicit one: megatron's default causal mask hard-codes CUDA
        on_gpu = state.device.type == "cuda"
        mask = None if on_gpu else torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
        times = []
        for i in range(warmup + steps):
            if state.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            train_step(ddp, opt, batches, seq, mbs, mask)
            if state.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        step_s = statistics.median(times)
        tokens = mbs * seq * n_micro
        flops = train_flops(flop_shape, [seq] * (mbs * n_micro))
        util = mfu(flops, step_s, 1, peak)
        out[name] = {"step_s": step_s, "tokens_per_s": tokens / step_s, "mfu": util,
                     "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None}
        print(f"{backend:>6} {name:>9}: {step_s * 1e3:8.1f} ms/step  {tokens / step_s:10.0f} tok/s  "
              f"MFU {'n/a' if util is None else f'{util:.1%}'}", flush=True)
        if state.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
    del chunk, ddp, opt
    if state.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["local", "sdpa"], choices=["local", "sdpa", "te"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="tiny shape (CPU smoke run)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)

    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    state = init_distributed(tp=1, pp=1, seed=1)
    if state.world_size != 1:
        raise SystemExit("bench_attention measures one GPU: run it as a single process.")
    shape = TINY if args.tiny else QWEN25_05B
    workloads = TINY_WORKLOADS if args.tiny else WORKLOADS
    report = {"env": environment(), "shape": shape, "workloads": {k: list(v) for k, v in workloads.items()},
              "results": {}}
    print(json.dumps(report["env"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        write_config(shape, model_dir)
        for backend in args.backends:
            report["results"][backend] = bench(model_dir, state, backend, workloads, args.warmup, args.steps,
                                               shape["vocab_size"])
    base = report["results"].get("local")
    for backend, res in report["results"].items():
        if base is not None and backend != "local":
            for name in res:
                res[name]["speedup_vs_local"] = res[name]["tokens_per_s"] / base[name]["tokens_per_s"]
    write_report(report, args.out)
    destroy_distributed()
    return report


if __name__ == "__main__":
    main()
