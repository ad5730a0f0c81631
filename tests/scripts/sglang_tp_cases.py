"""Worker for tests/test_rollout_sglang.py, run under torchrun with 4 processes (gloo, CPU), rollout TP=2, with
the fake `sglang` module (tests/scripts/fake_sglang.py): one engine per rollout TP group, prompts fed to it by
the other rank, results handed back, weight syncs and failures.

Usage: torchrun --nproc_per_node=4 tests/scripts/sglang_tp_cases.py --model DIR --out DIR
Rank 0 writes <out>/results.json: per key, a list indexed by rank (None where a rank has no engine).
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import fake_sglang  # noqa: E402

from rlhf_mcore.rollout import SamplingParams, build_rollout_engine  # noqa: E402
from rlhf_mcore.rollout.sglang_colocation import rollout_cpu_group  # noqa: E402


def main():
    from rlhf_mcore.startup import pause_gc

    pause_gc()  # the worker's start-up without the cyclic collector, as the launch scripts' (rlhf_mcore/startup.py)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sys.modules["sglang"] = fake_sglang.make_module("0.5.23")
    group = rollout_cpu_group(dist.get_world_size(), rank, 2)
    engine = build_rollout_engine("sglang", args.model, tp_size=2, tp_group=group,
                                  engine_kwargs={"mem_fraction_static": 0.3})
    fake = fake_sglang.FakeEngine.instances[-1] if fake_sglang.FakeEngine.instances else None
    report = {"engines": len(fake_sglang.FakeEngine.instances),
              "ports": [fake.kwargs["port"], fake.kwargs["nccl_port"]] if fake else None,
              "tp_size": fake.kwargs["tp_size"] if fake else None}

    # group (0, 1): the same prompts (as the trainer sends); group (2, 3): different prompts per rank
    prompts = [[5, 6], [7]] if rank in (0, 1) else ([[1], [2], [3]] if rank == 2 else [[9, 9, 9]])
    outs = engine.generate(prompts, SamplingParams(temperature=0.9, max_new_tokens=3, seed=4))
    report["outputs"] = [[(s.token_ids, s.logprobs, s.finish_reason) for s in o.samples] for o in outs]
    report["first_tokens"] = [o.samples[0].token_ids[0] for o in outs]
    report["generate_calls"] = [len(c[1]) for c in fake.calls if c[0] == "generate"] if fake else None

    if fake:
        fake.calls.clear()
    for bucket in ([("model.norm.weight", torch.ones(4))], [("lm_head.weight", torch.ones(2))]):
        engine.update_weights(bucket)
    engine.wake()
    report["update_calls"] = fake.names() if fake else None

    if fake:
        fake.fail_next_update = "boom: tensor model.norm.weight has the wrong shape"
    try:
        engine.update_weights([("model.norm.weight", torch.ones(4))])
        report["failure"] = None
    except RuntimeError as e:
        report["failure"] = str(e)

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if rank == 0:
        out = {k: [g[k] for g in gathered] for k in report}
        out["first_tokens"] = [g["first_tokens"] for g in gathered]
        Path(args.out, "results.json").write_text(json.dumps(out))
    if fake:
        fake.loop.close()
        engine.processes.pids.clear()  # the fake starts no processes
    engine.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
