"""LoRA weight sync: merged (the default) against adapter-only, into the native rollout engine, one process.

    python launch/bench/bench_lora_sync.py [--hidden 512 --layers 4 --rank 16 --repeats 5] [--out FILE.json]
    python launch/bench/bench_lora_sync.py --shape 7b --device cuda [--model-dir DIR]   # one H200, bf16

A Qwen2-shaped model (random weights; `--shape`: a launch/bench/bench_shapes.py shape, its directory made or reused
in `--model-dir`) with LoRA on every linear, built as the trainer builds the actor; after a first full sync, each
repeat changes the adapters and syncs them once each way into its own native engine:

- merged: `roles.sync_weights` (every weight, adapted ones as `W + (alpha / r) B @ A`, formed on the training side);
- adapter-only: `sync.lora.sync_adapters_to_rollout` (the adapters cross; the receiver forms the merged weights from
  its host copy of the base and reloads only the adapted tensors).

Reports the median seconds and the bytes each moves from the training to the rollout side. On CPU both sides are
the same process, so "moving" is handing over references: the figures compare the work, not a link.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_shapes import git_commit, shape, tokenizer_model_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shape", default=None, help="a bench_shapes.py shape (e.g. 7b) instead of --hidden/--layers")
    ap.add_argument("--model-dir", default=None, help="with --shape: make or reuse the model directory here")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from rlhf_mcore.config import load_config
    from rlhf_mcore.models.lora import adapter_modules, adapter_tensors
    from rlhf_mcore.models.tiny import make_tiny_model
    from rlhf_mcore.parallel import init_distributed
    from rlhf_mcore.rollout import build_rollout_engine
    from rlhf_mcore.sync import sync_actor_to_rollout
    from rlhf_mcore.sync.lora import BaseWeights, base_name, sync_adapters_to_rollout
    from rlhf_mcore.trainer import roles

    state = init_distributed(device=args.device)
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape:
            model_dir = tokenizer_model_dir(shape(args.shape), Path(args.model_dir or Path(tmp) / "m"),
                                            dtype="bfloat16" if state.device.type == "cuda" else "float32")
        else:
            model_dir = make_tiny_model(Path(tmp) / "m", arch="qwen2", layers=args.layers, hidden=args.hidden,
                                        heads=args.hidden // 64, kv_heads=2, vocab=4096)
        cfg = load_config(None, [f"actor_rollout_ref.model.path={model_dir}", f"trainer.device={args.device}",
                                 f"actor_rollout_ref.model.lora_rank={args.rank}",
                                 f"actor_rollout_ref.model.lora_alpha={2 * args.rank}",
                                 "actor_rollout_ref.rollout.lora_sync=adapter_only"])
        actor = roles.build_actor(cfg, state, total_steps=1)
        engines = {m: build_rollout_engine("native", model_dir, max_num_seqs=2, max_model_len=64, device=state.device,
                                           load_weights=False) for m in ("merged", "adapter_only")}
        for e in engines.values():  # the first sync is full either way
            roles.sync_weights(actor, e, state, cfg.actor_rollout_ref.rollout)
        base = BaseWeights(model_dir, {base_name(n) for n in adapter_tensors(actor.chunks, state) if ".lora_A." in n})
        times, nbytes, parts = {"merged": [], "adapter_only": []}, {}, {}
        g = torch.Generator().manual_seed(0)
        for _ in range(args.repeats):
            for _, _, lora in adapter_modules(actor.chunks):  # an "update"
                for t in lora.B:
                    lora.B[t].data.copy_(torch.randn(lora.B[t].shape, generator=g) * 0.01)
            m = sync_actor_to_rollout(actor.export_hf_weights(), engines["merged"], state)
            a = sync_adapters_to_rollout(actor, engines["adapter_only"], state, base)
            times["merged"].append(m["sync/seconds"])
            times["adapter_only"].append(a["sync/seconds"])
            for k in ("gather_seconds", "merge_load_seconds"):
                parts.setdefault(k, []).append(a[f"sync/{k}"])
            nbytes = {"merged": m["sync/bytes"], "adapter_only": a["sync/adapter_bytes"]}
    result = {"device": torch.cuda.get_device_name(0) if state.device.type == "cuda" else "cpu",
              "shape": args.shape, "hidden": actor.chunks[0].hf_shape.hidden_size,
              "layers": actor.chunks[0].hf_shape.num_layers, "rank": args.rank, "commit": git_commit(),
              "params": sum(p.numel() for p in actor.chunks[0].parameters()),
              **{f"{k}_seconds_median": statistics.median(v) for k, v in times.items()},
              **{f"{k}_bytes": v for k, v in nbytes.items()},
              "adapter_only_parts_median_s": {k: statistics.median(v) for k, v in parts.items()},
              "base_copy_bytes": sum(t.numel() * t.element_size() for t in base.tensors.values())}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
