"""Worker for tests/test_reward_model.py, run under torchrun: reward-model scores and one Bradley-Terry update on
the train engine at several layouts in one launch.

Usage: torchrun --nproc_per_node=2 tests/scripts/reward_model_cases.py --spec spec.json --out results.json

spec.json: {"models": {arch: rm_dir}, "sequences": [[ids...], ...], "pairs": [[chosen ids, rejected ids], ...],
"layouts": ["1x1", "2x1", "1x2", ...]}. For each layout (TPxPP; the rest of the world is DP) and model, rank 0
records the scores of every sequence (through `RewardModelScorer.score_ids`: DP split and gather, packed, micro-
batches of 3 so the last one is padded), the padded-layout scores, and the Bradley-Terry loss, accuracy and the
scores after one update on the pairs.
"""
import argparse
import json
from types import SimpleNamespace

import torch
from worker_common import write_results


def rm_cfg(micro: int):
    return SimpleNamespace(micro_batch_size_per_gpu=micro, max_length=None, data_sources=[], reward_weight=1.0,
                           rule_weight=0.0, megatron=SimpleNamespace(param_offload=False))


def engine_for(model_dir, state, *, packed: bool, optim=None, micro: int = 3):
    from rlhf_mcore.engine.config import EngineConfig
    from rlhf_mcore.engine.reward_engine import RewardEngine
    from rlhf_mcore.models import build_model

    chunks = build_model(model_dir, state, role="reward")
    cfg = EngineConfig(role="reward", micro_batch_size=micro, use_remove_padding=packed, grad_clip=1e9)
    return RewardEngine(chunks, state, cfg, optim)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from megatron.core import parallel_state as mpu
    from transformers import AutoTokenizer

    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.parallel import destroy_distributed, init_distributed
    from rlhf_mcore.rewards.reward_model import RewardModelScorer
    from rlhf_mcore.trainer.rm_training import pair_batch

    spec = json.loads(open(args.spec).read())
    results = {}
    for layout in spec["layouts"]:
        tp, pp = (int(x) for x in layout.split("x"))
        state = init_distributed(tp=tp, pp=pp, seed=3)
        for arch, model_dir in spec["models"].items():
            tok = AutoTokenizer.from_pretrained(model_dir)
            scorer = RewardModelScorer(engine_for(model_dir, state, packed=True), state, rm_cfg(3), tok)
            packed = scorer.score_ids(spec["sequences"])
            padded = RewardModelScorer(engine_for(model_dir, state, packed=False, micro=2), state, rm_cfg(2), tok
                                       ).score_ids(spec["sequences"])
            # one Bradley-Terry step on all pairs (each DP rank its share), then the scores again; lr 1e-3: Adam's
            # first step moves every weight by ~lr, and at 1e-2 it overshoots (llama's loss 0.38 -> 0.51; 1e-3: 0.10)
            trainer = engine_for(model_dir, state, packed=True, micro=2, optim=OptimConfig(lr=1e-3, weight_decay=0.0))
            pairs = spec["pairs"]
            per = len(pairs) // state.dims.dp
            mine = pairs[state.dp_rank * per:(state.dp_rank + 1) * per]
            metrics = trainer.update(pair_batch([p[0] for p in mine], [p[1] for p in mine], tok.pad_token_id))
            after = RewardModelScorer(trainer, state, rm_cfg(3), tok).score_ids(spec["sequences"])
            results[f"{arch}@{layout}"] = {"packed": packed, "padded": padded, "after": after,
                                           "bt_loss": metrics["reward/bt_loss"],
                                           "accuracy": metrics["reward/accuracy"]}
        mpu.destroy_model_parallel()
    write_results(results, args.out)
    destroy_distributed()


if __name__ == "__main__":
    main()
