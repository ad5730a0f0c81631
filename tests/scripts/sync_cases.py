"""Worker for tests/test_sync.py, run under torchrun with 4 processes (gloo, CPU): weight sync from Megatron
layouts into native rollout engines of other TP sizes, after a PPO update, and the broadcast transport.

Usage: torchrun --nproc_per_node=4 tests/scripts/sync_cases.py --model DIR --model3 DIR --out DIR

Cases (one launch, start-up dominates on 2 cores); rank 0 writes <out>/results.json with, per case, every
rank's report (lists indexed by rank):
- export@2x2: train TP=2×PP=2 (weights from the HF dir) -> rollout TP=1 and TP=2 engines, verify on: every
  tensor the engine received vs the HF safetensors (bitwise), sync metrics, greedy generations vs a fresh
  TP=1 engine loaded from the HF dir.
- update@2x2: two PPO updates of a TrainEngine actor (lr 0.05, so generations change), a sync into both
  engines, `save_hf_checkpoint`; received tensors vs the saved safetensors (bitwise); generations of both
  engines vs a fresh engine built from the saved directory, and vs the generations before the update.
- export@4x1: train TP=4 -> rollout TP=2 (bitwise, verified).
- uneven@2x2, uneven@1x2: a 3-layer model (--model3) on uneven PP stages (2 layers, then 1) -> rollout TP=1
  (bitwise, verified; generations vs a fresh engine).
- broadcast: synthetic mixed-dtype tensors from rank 0 to all ranks and from rank 3 to ranks {1, 3}, with
  checksums; every receiver compares what it got with the regenerated tensors (bitwise).
- staged: rank 0 broadcasts 16 MB of synthetic tensors while ranks 1-3 each take it with a `StagedReceive`
  and their main threads wait, before loading, for the store key rank 0 sets once its send returned: the send
  completes while the receivers are busy (a receive that ran only at `load_into` would leave every main thread
  waiting for a key that never comes); then each loads what it staged and compares it (bitwise).
- collectives: `rlhf_mcore.parallel.collectives` — a sum over the world, a max over ranks {1, 3}, an object from
  rank 2, and the no-group call returning its tensor untouched.
"""
import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

BUCKET_MB = 0.05  # ~52 KB: several buckets for the tiny model, and the 256 KB embedding travels alone
PROMPTS = [[5, 17, 42, 8], [100, 3, 77], [250, 251, 9, 10, 11, 12], [1, 2]]


class Recorder:
    """Wraps a rollout engine: keeps a copy of every tensor `update_weights` receives, then forwards it."""

    def __init__(self, engine):
        self.engine = engine
        self.received: dict[str, torch.Tensor] = {}
        self.calls = 0

    def update_weights(self, named_tensors):
        group = list(named_tensors)
        self.calls += 1
        for name, t in group:
            self.received[name] = t.detach().clone()
        self.engine.update_weights(group)

    def hf_weight_shards(self):  # the proposed protocol method: the verifier reads the inner engine
        from rlhf_mcore.sync import engine_hf_shards

        return engine_hf_shards(self.engine).values()


def native(model_dir, tp_group=None, load=False):
    from rlhf_mcore.rollout import build_rollout_engine

    return build_rollout_engine("native", model_dir, max_num_seqs=4, max_model_len=32, tp_group=tp_group,
                                load_weights=load)


def greedy(engine) -> list:
    from rlhf_mcore.rollout import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    return [o.samples[0].token_ids for o in engine.generate(PROMPTS, params)]


def read_safetensors(model_dir) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def compare(received: dict, reference: dict) -> dict:
    """Names missing / extra / not bitwise equal (dtype, shape and bytes)."""
    differ = [n for n in received if n in reference and not (
        received[n].dtype == reference[n].dtype and received[n].shape == reference[n].shape
        and torch.equal(received[n], reference[n]))]
    return {"missing": sorted(set(reference) - set(received)), "extra": sorted(set(received) - set(reference)),
            "differ": differ, "count": len(received)}


def sync_into(engine, named, state) -> tuple[dict, dict]:
    from rlhf_mcore.sync import sync_actor_to_rollout

    rec = Recorder(engine)
    metrics = sync_actor_to_rollout(named, rec, state, bucket_mb=BUCKET_MB, verify=True)
    return rec.received, {**metrics, "update_calls": rec.calls}


def rollout_tp2_group():
    """Rollout TP groups {0, 1} and {2, 3} (every rank creates both, in order); returns this rank's."""
    mine = None
    for ranks in ([0, 1], [2, 3]):
        g = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = g
    return mine


# ----------------------------------------------------------------------------------------------- cases

def case_export_2x2(model_dir, engines, state, tmp):
    from rlhf_mcore.models import build_model, export_hf_weights

    chunks = build_model(model_dir, state, role="actor")
    reference = read_safetensors(model_dir)
    fresh = greedy(native(model_dir, load=True))
    out = {"reference_generations": fresh}
    for key, engine in engines.items():
        received, metrics = sync_into(engine, export_hf_weights(chunks, state), state)
        out[key] = {"compare": compare(received, reference), "metrics": metrics, "generations": greedy(engine)}
    return out, chunks


def ppo_batch(vocab: int) -> dict:
    """Four left-padded prompts with right-padded responses, veRL's layout."""
    P, R = 4, 6
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (4, P + R), generator=g)
    mask = torch.ones(4, P + R, dtype=torch.long)
    mask[0, :2] = 0
    mask[1, P + 3:] = 0
    mask[2, P + 1:] = 0
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, P:].clone(), "response_mask": mask[:, P:].clone()}


def case_update_2x2(model_dir, engines, state, tmp, chunks, before):
    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine import EngineConfig, TrainEngine
    from rlhf_mcore.models import save_hf_checkpoint

    actor = TrainEngine(chunks, state, EngineConfig(role="actor", micro_batch_size=2, mini_batch_size=4),
                        OptimConfig(lr=0.05, weight_decay=0.0))
    batch = ppo_batch(vocab=900)
    log_probs, _ = actor.compute_log_probs(batch)
    g = torch.Generator().manual_seed(9)
    adv = torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"]
    ppo = {**batch, "old_log_probs": log_probs, "advantages": adv}
    ppo_metrics = [actor.update_policy(ppo) for _ in range(2)]
    saved = Path(tmp) / "after_update"
    save_hf_checkpoint(actor.chunks, state, saved, model_dir)
    reference = read_safetensors(saved)
    fresh = greedy(native(saved, load=True))
    out = {"reference_generations": fresh, "ppo_loss": [m.get("actor/loss") for m in ppo_metrics]}
    for key, engine in engines.items():
        received, metrics = sync_into(engine, actor.export_hf_weights(), state)
        gens = greedy(engine)
        out[key] = {"compare": compare(received, reference), "metrics": metrics, "generations": gens,
                    "generations_before": before[key]}
    return out


def case_export_4x1(model_dir, engine, state):
    from rlhf_mcore.models import build_model, export_hf_weights

    chunks = build_model(model_dir, state, role="actor")
    received, metrics = sync_into(engine, export_hf_weights(chunks, state), state)
    return {"compare": compare(received, read_safetensors(model_dir)), "metrics": metrics,
            "generations": greedy(engine), "reference_generations": greedy(native(model_dir, load=True))}


def case_export_uneven(model_dir, state):
    from rlhf_mcore.models import build_model, export_hf_weights

    chunks = build_model(model_dir, state, role="actor")
    engine = native(model_dir)
    received, metrics = sync_into(engine, export_hf_weights(chunks, state), state)
    return {"compare": compare(received, read_safetensors(model_dir)), "metrics": metrics,
            "layers": [layer.layer_number - 1 for c in chunks for layer in c.decoder.layers],
            "pp_rank": state.pp_rank, "generations": greedy(engine),
            "reference_generations": greedy(native(model_dir, load=True))}


def synthetic(seed: int) -> list:
    """Mixed dtypes and shapes, one tensor (64 KB) larger than the bucket, a 0-d tensor."""
    g = torch.Generator().manual_seed(seed)
    return [("a.weight", torch.randn(40, 33, generator=g)),
            ("b.bf16", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
            ("c.ids", torch.randint(-1000, 1000, (123,), generator=g)),
            ("d.mask", torch.rand(17, generator=g) > 0.5),
            ("e.big", torch.randn(128, 128, generator=g)),
            ("f.scalar", torch.tensor(3.5)),
            ("g.half", torch.randn(300, generator=g).to(torch.float16))]


def case_broadcast(state) -> dict:
    from rlhf_mcore.sync import BroadcastReceiver, BroadcastSender, GroupComm, bucket_bytes_from_mb

    out = {}
    rank = dist.get_rank()
    sub = dist.new_group([1, 3])
    for label, group, src, members in (("world_from_0", dist.group.WORLD, 0, [0, 1, 2, 3]),
                                       ("sub_from_3", sub, 3, [1, 3])):
        if rank not in members:
            continue
        want = synthetic(seed=len(label))
        if rank == src:
            sender = BroadcastSender(GroupComm(group, "cpu"), src, bucket_bytes_from_mb(BUCKET_MB / 2), "cpu",
                                     checksums=True)
            stats = sender.send(iter(want))
            out[label] = {"role": "sender", "buckets": stats.buckets, "bytes": stats.bytes,
                          "peak_extra_bytes": stats.peak_extra_bytes,
                          "largest_tensor_bytes": stats.largest_tensor_bytes}
        else:
            receiver = BroadcastReceiver(GroupComm(group, "cpu"), src, "cpu", verify=True)
            got = {name: t.clone() for name, t in receiver.receive()}
            out[label] = {"role": "receiver", "compare": compare(got, dict(want)),
                          "order": list(got) == [n for n, _ in want], "buckets": receiver.stats.buckets,
                          "peak_extra_bytes": receiver.stats.peak_extra_bytes}
    return out


class Sink:
    """A stand-in engine for the staged case: keeps what `update_weights` gets."""

    def __init__(self):
        self.received: dict[str, torch.Tensor] = {}

    def update_weights(self, group):
        self.received.update((name, t.clone()) for name, t in group)


def case_staged() -> dict:
    import datetime

    from rlhf_mcore.sync import BroadcastSender, GroupComm, StagedReceive, bucket_bytes_from_mb

    rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
    group = dist.new_group([0, 1, 2, 3])  # the receive thread's own group: the main thread never touches it
    g = torch.Generator().manual_seed(11)
    want = [(f"w{i}", torch.randn(1024, 1024, generator=g)) for i in range(4)]  # 16 MB: no socket buffers it
    if rank == 0:
        sender = BroadcastSender(GroupComm(group, "cpu"), 0, bucket_bytes_from_mb(1), "cpu", checksums=True)
        stats = sender.send(iter(want))
        store.set("staged/sent", "1")  # the send returned: every receiver took the whole stream
        return {"role": "sender", "buckets": stats.buckets}
    staged = StagedReceive(GroupComm(group, "cpu"), 0, device="cpu", verify=True)
    t0 = time.perf_counter()
    store.wait(["staged/sent"], datetime.timedelta(seconds=60))  # "busy": the main thread is elsewhere
    sink = Sink()
    metrics = staged.load_into(sink)
    return {"role": "receiver", "waited_s": time.perf_counter() - t0, "compare": compare(sink.received, dict(want)),
            "order": list(sink.received) == [n for n, _ in want], "metrics": metrics}


def case_collectives() -> dict:
    from rlhf_mcore.parallel.collectives import broadcast_object, group_all_reduce

    rank = dist.get_rank()
    sub = dist.new_group([1, 3])
    mine = torch.tensor([rank + 1.0, -float(rank)])
    out = {"sum": group_all_reduce(mine.clone(), dist.group.WORLD).tolist(),
           "alone": group_all_reduce(mine, None) is mine and mine.tolist() == [rank + 1.0, -float(rank)],
           "object": broadcast_object({"from": rank, "items": [rank] * rank}, src=2)}
    if rank in (1, 3):
        out["max_sub"] = group_all_reduce(mine.clone(), sub, dist.ReduceOp.MAX).tolist()
    return out


def main():
    from rlhf_mcore.startup import pause_gc

    pause_gc()  # the worker's start-up without the cyclic collector, as the launch scripts' (rlhf_mcore/startup.py)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--model3", required=True, help="a 3-layer model: uneven stages at PP=2")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    tmp = Path(args.out)
    state = init_distributed(tp=2, pp=2, seed=3)
    engines = {"rollout_tp1": native(args.model), "rollout_tp2": native(args.model, rollout_tp2_group())}
    report, clock = {}, {}
    t0 = time.perf_counter()
    report["export@2x2"], chunks = case_export_2x2(args.model, engines, state, tmp)
    clock["export@2x2"], t0 = time.perf_counter() - t0, time.perf_counter()
    before = {k: report["export@2x2"][k]["generations"] for k in engines}
    report["update@2x2"] = case_update_2x2(args.model, engines, state, tmp, chunks, before)
    clock["update@2x2"], t0 = time.perf_counter() - t0, time.perf_counter()
    del chunks
    report["broadcast"] = case_broadcast(state)
    clock["broadcast"], t0 = time.perf_counter() - t0, time.perf_counter()
    report["staged"] = case_staged()
    report["collectives"] = case_collectives()
    state = init_distributed(tp=4, pp=1, seed=3)
    report["export@4x1"] = case_export_4x1(args.model, engines["rollout_tp2"], state)
    clock["export@4x1"], t0 = time.perf_counter() - t0, time.perf_counter()
    for tp in (2, 1):
        state = init_distributed(tp=tp, pp=2, seed=3)
        report[f"uneven@{tp}x2"] = case_export_uneven(args.model3, state)
        clock[f"uneven@{tp}x2"], t0 = time.perf_counter() - t0, time.perf_counter()
    report["seconds"] = clock

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, report)
    if dist.get_rank() == 0:
        merged = {case: [r[case] for r in everyone] for case in report}
        (tmp / "results.json").write_text(json.dumps(merged, indent=1))
    destroy_distributed()


if __name__ == "__main__":
    main()
