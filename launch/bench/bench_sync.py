"""Weight-sync time, colocated: a Megatron actor -> the native rollout engine on the same GPU, per sync.

    python launch/bench/bench_sync.py [--bucket-mb 128 512 2048] [--iters 10] [--out FILE.json]
    torchrun --nproc_per_node=2 launch/bench/bench_sync.py --tp 2 [--rollout-tp 1]   # other layouts
    python launch/bench/bench_sync.py --tiny                                         # CPU smoke run

The model is Qwen2.5-0.5B-shaped (hidden 896, 24 layers, 14 heads, 2 kv heads, ffn 4864, vocab 151936, tied
embeddings) in bf16 with Megatron's random initialisation: only config.json is written (to a temporary
directory); neither side loads weights from disk. One timed sync is what the trainer does after an update:
`sync_actor_to_rollout(export_hf_weights(chunks, state), engine, state, bucket_mb=...)` — the export
(TP all-gathers and PP broadcasts when the layout has them, QKV / gate-up splitting) plus the engine's copies
into its fused, sharded weights. Two warm-up syncs per bucket size, then `--iters` timed ones; afterwards one
verified sync (checksums of the engine's weights read back) must pass. For scale, `copy_floor_s` is the time
of one device copy of the same number of bytes. Prints one JSON object (rank 0).
"""
from __future__ import annotations

import argparse
import json
import statistics
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
)


def write_config(shape: dict, out: Path, dtype: torch.dtype) -> Path:
    """config.json of a Qwen2 model (no weights: both sides start from random / uninitialised tensors)."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(**shape, bos_token_id=0, eos_token_id=1, pad_token_id=0,
                      torch_dtype=str(dtype).removeprefix("torch."), architectures=["Qwen2ForCausalLM"])
    cfg.save_pretrained(out)
    return out


def copy_floor_seconds(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Median time of one copy of `nbytes` on `device` (the bandwidth floor of any sync)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def rollout_group(state, size: int):
    import torch.distributed as dist

    if size == 1:
        return None
    mine = None
    for start in range(0, state.world_size, size):
        g = dist.new_group(list(range(start, start + size)))
        if start <= state.rank < start + size:
            mine = g
    return mine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tp", type=int, default=1, help="training tensor parallel size")
    ap.add_argument("--pp", type=int, default=1, help="training pipeline parallel size")
    ap.add_argument("--rollout-tp", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (CPU smoke run)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()

    from rlhf_mcore.models import build_model, export_hf_weights
    from rlhf_mcore.parallel import destroy_distributed, init_distributed
    from rlhf_mcore.rollout import build_rollout_engine
    from rlhf_mcore.sync import sync_actor_to_rollout

    state = init_distributed(tp=args.tp, pp=args.pp, seed=0)
    dtype = torch.bfloat16 if state.device.type == "cuda" else torch.float32
    shape = TINY if args.tiny else QWEN25_05B
    with tempfile.TemporaryDirectory(prefix="bench_sync_") as tmp:
        model_dir = Path(tmp) / "model"
        if state.rank == 0:
            write_config(shape, model_dir, dtype)
        if state.world_size > 1:
            torch.distributed.barrier()
        chunks = build_model(model_dir, state, role="actor", dtype=dtype, load_weights=False)
        engine = build_rollout_engine("native", model_dir, max_num_seqs=8, max_model_len=256, device=state.device,
                                      dtype=dtype, cuda_graphs=False, load_weights=False,
                                      tp_group=rollout_group(state, args.rollout_tp))
        results = []
        for bucket_mb in args.bucket_mb:
            runs = []
            for i in range(2 + args.iters):
                m = sync_actor_to_rollout(export_hf_weights(chunks, state), engine, state, bucket_mb=bucket_mb)
                if i >= 2:
                    runs.append(m)
            secs = [m["sync/seconds"] for m in runs]
            last = runs[-1]
            results.append({
                "bucket_mb": bucket_mb, "seconds_median": statistics.median(secs), "seconds_min": min(secs),
                "seconds_max": max(secs), "bytes": last["sync/bytes"], "buckets": last["sync/buckets"],
                "tensors": last["sync/tensors"], "gbytes_per_s": last["sync/bytes"] / statistics.median(secs) / 1e9,
                "peak_extra_bytes": last["sync/peak_extra_bytes"],
                "cuda_peak_delta_bytes": last.get("sync/cuda_peak_delta_bytes")})
        verified = sync_actor_to_rollout(export_hf_weights(chunks, state), engine, state,
                                         bucket_mb=args.bucket_mb[0], verify=True)
        total_bytes = int(results[0]["bytes"])
        report = {
            "benchmark": "weight_sync_colocated", "shape": "tiny" if args.tiny else "qwen2.5-0.5b",
            "dtype": str(dtype).removeprefix("torch."), "train_tp": args.tp, "train_pp": args.pp,
            "rollout_tp": args.rollout_tp, "world_size": state.world_size,
            "device": torch.cuda.get_device_name() if state.device.type == "cuda" else "cpu",
            "torch": torch.__version__, "commit": git_commit(), "iters": args.iters,
            "copy_floor_s": copy_floor_seconds(total_bytes, state.device),
            "verified": True, "verify_seconds": verified.get("sync/verify_seconds"),
            "results": results,
            "best_seconds": min(r["seconds_median"] for r in results),
        }
    if state.rank == 0:
        text = json.dumps(report, indent=1)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
    destroy_distributed()


if __name__ == "__main__":
    main()
