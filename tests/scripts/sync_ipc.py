"""Worker for tests/test_sync.py: the shared-memory (CPU stand-in for CUDA IPC) transport between two processes.

Usage: python tests/scripts/sync_ipc.py --model DIR --out FILE

This process plays the trainer (sender); a spawned process plays an out-of-process rollout server (receiver).
Three syncs over one `IpcChannel`:
  1. synthetic mixed-dtype tensors (one larger than the bucket): the receiver reports the fingerprint of every
     tensor it got, in order; the sender's checksums are verified on the receiving side;
  2. the HF model's safetensors into a native engine (`load_weights=False`) in the receiver, verified against
     the engine's read-back weights; the receiver reports its greedy generations;
  3. one bucket as bytes (`serialize_bucket`) through a plain queue, rebuilt with `deserialize_bucket`.
The sender writes JSON: its stats, the fingerprints it sent, reference generations of a native engine loaded
from the directory here, and everything the receiver reported.
"""
import argparse
import json

import torch
import torch.multiprocessing as mp

BUCKET_BYTES = 16 * 1024
PROMPTS = [[5, 17, 42, 8], [100, 3, 77]]


def synthetic() -> list:
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(40, 33, generator=g)),
            ("b.bf16", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
            ("c.ids", torch.randint(-1000, 1000, (123,), generator=g)),
            ("d.mask", torch.rand(17, generator=g) > 0.5),
            ("e.big", torch.randn(96, 96, generator=g)),  # 36 KB > the bucket
            ("f.scalar", torch.tensor(3.5)),
            ("g.transposed", torch.randn(30, 20, generator=g).t())]  # not contiguous


def greedy(engine) -> list:
    from rlhf_mcore.rollout import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    return [o.samples[0].token_ids for o in engine.generate(PROMPTS, params)]


def native(model_dir, load: bool):
    from rlhf_mcore.rollout import build_rollout_engine

    # the CPU, on a GPU machine too: this is the shared-memory stand-in for CUDA IPC, with CPU tensors
    return build_rollout_engine("native", model_dir, max_num_seqs=2, max_model_len=16, load_weights=load,
                                device="cpu")


def rollout_process(channel, model_dir, results, raw):
    """The receiving side (runs in the spawned process)."""
    torch.set_num_threads(1)
    from rlhf_mcore.sync import EngineVerifier, deserialize_bucket, load_buckets_into
    from rlhf_mcore.sync.verify import fingerprint

    report = {}
    receiver = channel.receiver(verify=True)
    report["synthetic"] = [[name, *fingerprint(t)] for name, t in receiver.receive()]
    report["synthetic_buckets"] = receiver.stats.buckets

    engine = native(model_dir, load=False)
    verifier = EngineVerifier(engine)
    receiver = channel.receiver(verify=True)
    load_buckets_into(engine, ([*verifier.wrap(group)] for group in receiver.receive_buckets()))
    verifier.verify()
    report["engine_generations"] = greedy(engine)
    report["engine_buckets"] = receiver.stats.buckets

    bucket = deserialize_bucket(raw.get(timeout=120))
    report["serialized"] = [[name, *fingerprint(t)] for name, t in bucket.unpack()]
    del bucket
    raw.put("done")
    results.put(report)


def main():
    from rlhf_mcore.startup import pause_gc

    pause_gc()  # the worker's start-up without the cyclic collector, as the launch scripts' (rlhf_mcore/startup.py)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from rlhf_mcore.rollout.native.weights import iter_safetensors
    from rlhf_mcore.sync import FlatBucket, IpcChannel, serialize_bucket
    from rlhf_mcore.sync.verify import fingerprint

    ctx = mp.get_context("spawn")
    channel = IpcChannel(ctx, timeout_s=300)
    results, raw = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=rollout_process, args=(channel, args.model, results, raw), daemon=True)
    proc.start()
    out = {}
    want = synthetic()
    stats = channel.sender(BUCKET_BYTES, device="cpu", checksums=True).send(iter(want))
    out["sent"] = [[name, *fingerprint(t)] for name, t in want]
    out["synthetic_stats"] = {"buckets": stats.buckets, "bytes": stats.bytes, "tensors": stats.tensors,
                              "peak_extra_bytes": stats.peak_extra_bytes,
                              "largest_tensor_bytes": stats.largest_tensor_bytes}
    stats = channel.sender(BUCKET_BYTES, device="cpu", checksums=True).send(iter_safetensors(args.model))
    out["engine_stats"] = {"buckets": stats.buckets, "peak_extra_bytes": stats.peak_extra_bytes,
                           "largest_tensor_bytes": stats.largest_tensor_bytes}
    out["reference_generations"] = greedy(native(args.model, load=True))

    shared = FlatBucket.pack(want[:3], device="cpu")
    shared.buffer.share_memory_()
    raw.put(serialize_bucket(shared))
    out["serialized_sent"] = [[name, *fingerprint(t)] for name, t in want[:3]]
    out["receiver"] = results.get(timeout=300)
    assert raw.get(timeout=60) == "done"
    proc.join(timeout=60)
    out["receiver_exitcode"] = proc.exitcode
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
