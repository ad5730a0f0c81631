"""GPU check of the weight-sync engine without Megatron (run by hand on a CUDA machine; the CPU suite covers the
logic): Qwen2.5-0.5B-shaped HF tensors (bf16, random) into the native rollout engine.

Usage: python tests/scripts/sync_gpu_check.py --out DIR [--iters 10]

1. colocated (`sync_actor_to_rollout`): tensors streamed from a dict of "parameters" (what the exporter yields at
   TP = PP = 1: views, no new memory) and as fresh copies (what it yields when it gathers shards), seconds per
   sync at several bucket sizes, the allocator's peak during a sync, one verified sync;
2. CUDA IPC (`IpcChannel`) to a spawned process that owns its own native engine on the same GPU: the receiver
   verifies every tensor against the sender's checksums and its engine's weights against the stream; seconds
   per sync on both sides.
Writes DIR/sync_gpu_check.json and prints it.
"""
import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

CONFIG = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
              tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-6,
              eos_token_id=1, bos_token_id=0, torch_dtype="bfloat16")


def hf_shapes(cfg: dict) -> dict:
    d, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "self_attn.q_proj.weight": (q, d),
                       p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.v_proj.weight": (kv, d),
                       p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.weight": (d, q),
                       p + "post_attention_layernorm.weight": (d,), p + "mlp.gate_proj.weight": (inter, d),
                       p + "mlp.up_proj.weight": (inter, d), p + "mlp.down_proj.weight": (d, inter)})
    shapes["model.norm.weight"] = (d,)
    return shapes


def make_params(seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {n: (0.02 * torch.randn(s, generator=g, device="cuda")).to(torch.bfloat16)
            for n, s in hf_shapes(CONFIG).items()}


def native(model_dir):
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    return NativeRolloutEngine(model_dir, max_num_seqs=8, max_model_len=256, device="cuda", dtype=torch.bfloat16,
                               cuda_graphs=False, load_weights=False)


def colocated(model_dir, params, iters) -> dict:
    from rlhf_mcore.sync import engine_hf_shards, sync_actor_to_rollout

    engine = native(model_dir)
    out = {}
    for label, stream in (("views", lambda: iter(params.items())),
                          ("fresh", lambda: ((n, p.clone()) for n, p in params.items()))):
        for bucket_mb in (128, 512, 2048):
            runs = [sync_actor_to_rollout(stream(), engine, None, bucket_mb=bucket_mb) for _ in range(2 + iters)][2:]
            secs = [m["sync/seconds"] for m in runs]
            out[f"{label}/bucket{bucket_mb}"] = {
                "seconds_median": statistics.median(secs), "seconds_min": min(secs),
                "buckets": runs[-1]["sync/buckets"], "bytes": runs[-1]["sync/bytes"],
                "peak_extra_bytes": runs[-1]["sync/peak_extra_bytes"]}
    state = SimpleNamespace(device=torch.device("cuda", 0))  # a device: the allocator's peak gets measured
    m = sync_actor_to_rollout(((n, p.clone()) for n, p in params.items()), engine, state, bucket_mb=512, verify=True)
    out["verified_fresh_bucket512"] = m
    out["engine_equals_params"] = all(torch.equal(h.tensor, params[n]) for n, h in engine_hf_shards(engine).items())
    return out


def receiver_main(channel, model_dir, iters, results):
    from rlhf_mcore.sync import EngineVerifier, load_buckets_into

    torch.cuda.set_device(0)
    engine = native(model_dir)
    report = {"seconds": []}
    for i in range(iters):
        verify = i == 0
        receiver = channel.receiver(verify=verify)
        verifier = EngineVerifier(engine) if verify else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        buckets = receiver.receive_buckets()
        if verifier is not None:
            buckets = ([*verifier.wrap(g)] for g in buckets)
        load_buckets_into(engine, buckets)
        torch.cuda.synchronize()
        report["seconds"].append(time.perf_counter() - t0)
        if verifier is not None:
            verifier.verify()
            report["verified"] = True
        report["buckets"] = receiver.stats.buckets
    results.put(report)


def ipc(model_dir, params, iters) -> dict:
    from rlhf_mcore.sync import IpcChannel

    ctx = mp.get_context("spawn")
    channel = IpcChannel(ctx, timeout_s=300)
    results = ctx.Queue()
    proc = ctx.Process(target=receiver_main, args=(channel, model_dir, iters, results))
    proc.start()
    sender_secs, stats = [], None
    for i in range(iters):
        sender = channel.sender(128 * 1024 * 1024, device="cuda", checksums=i == 0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = sender.send(iter(params.items()))
        sender_secs.append(time.perf_counter() - t0)
    rx = results.get(timeout=600)
    proc.join(timeout=60)
    return {"sender_seconds": sender_secs, "receiver": rx, "buckets": stats.buckets, "bytes": stats.bytes,
            "sender_peak_extra_bytes": stats.peak_extra_bytes, "exitcode": proc.exitcode}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(CONFIG))
        params = make_params(0)
        report["param_bytes"] = sum(p.numel() * p.element_size() for p in params.values())
        report["colocated"] = colocated(tmp, params, args.iters)
        try:
            report["ipc"] = ipc(tmp, params, max(3, args.iters // 2))
        except Exception as e:  # report it; the colocated numbers still count
            report["ipc"] = {"error": f"{type(e).__name__}: {e}"}
    text = json.dumps(report, indent=1)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sync_gpu_check.json").write_text(text)


if __name__ == "__main__":
    main()
