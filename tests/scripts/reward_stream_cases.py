"""Worker for tests/test_reward_stream.py, run under torchrun on 2 CPU processes: a reward model scoring the native
rollout engine's samples as they finish (`generate_and_score(..., reward_model=...)`), against scoring the same
rows after generation (`RewardModelScorer.score_rows`).

Usage: torchrun --nproc_per_node=2 tests/scripts/reward_stream_cases.py --policy DIR --rm DIR --out results.json

Layouts (TPxPP of the reward model; the rollout has TP 1, so each rank is a rollout replica):
- "1x1" (DP 2): each rank's reward-model replica is its rollout replica, so it streams. Recorded: the streamed
  scores, the scores of the same rows scored after generation, the reward model's forward calls and how many came
  while the rollout still had requests pending.
- "2x1": the reward model's TP group spans two rollout replicas; `streaming_blocker` says why it cannot stream and
  the rows are scored after generation (all ranks together, no hang).
"""
import argparse
from types import SimpleNamespace

import torch
from worker_common import write_results


def rule(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)


def count_forwards(engine, rollout) -> list[int]:
    """The requests the rollout still has pending at each of the reward engine's forward calls, appended to the
    list returned."""
    calls, forward = [], engine.compute_scores

    def counted(batch):
        calls.append(rollout.num_pending)
        return forward(batch)

    engine.compute_scores = counted
    return calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", required=True)
    ap.add_argument("--rm", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from megatron.core import parallel_state as mpu
    from transformers import AutoTokenizer

    from rlhf_mcore.engine.config import EngineConfig
    from rlhf_mcore.engine.reward_engine import RewardEngine
    from rlhf_mcore.models import build_model
    from rlhf_mcore.parallel import destroy_distributed, init_distributed
    from rlhf_mcore.rewards import RewardScorer
    from rlhf_mcore.rewards.reward_model import RewardModelScorer, streaming_blocker
    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine
    from rlhf_mcore.trainer.rollout_phase import generate_and_score

    tok = AutoTokenizer.from_pretrained(args.rm)
    prompts = [[5 + i, 17, 33 + i, 2] for i in range(8)]
    meta = [{"data_source": "s" if i % 4 else "other", "ground_truth": "x",  # "other": not covered by the RM
             "extra_info": {"max_response_length": 4 + 3 * (i % 5)}} for i in range(8)]  # finish at different steps
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=16, stop_token_ids=(), seed=11)
    rm_cfg = SimpleNamespace(micro_batch_size_per_gpu=2, max_length=12, data_sources=["s"], reward_weight=2.0,
                             rule_weight=0.5, megatron=SimpleNamespace(param_offload=False))
    results = {}
    for layout in ("1x1", "2x1"):
        tp, pp = (int(x) for x in layout.split("x"))
        state = init_distributed(tp=tp, pp=pp, seed=3)
        engine = RewardEngine(build_model(args.rm, state, role="reward"), state,
                              EngineConfig(role="reward", micro_batch_size=2, use_remove_padding=True))
        rollout = NativeRolloutEngine(args.policy, device="cpu", max_num_seqs=8, max_model_len=32)
        calls = count_forwards(engine, rollout)
        blocker = streaming_blocker(state, rollout_tp=1, offload=False)
        scorer = RewardModelScorer(engine, state, rm_cfg, tok, streaming_blocker=blocker)
        with RewardScorer(rule, num_workers=0, timeout_s=10) as rules:
            rows, stats = generate_and_score(rollout, rules, prompts, meta, params, tok, rollout_tp=1,
                                             group=state.cpu_group,
                                             reward_model=scorer if blocker is None else None)
        during = list(calls)
        metrics = scorer.score_rows(rows, meta)
        streamed = [r.score for r in rows]
        for r in rows:  # the same rows, scored after generation
            r.score = r.reward_extra["acc"]
            r.reward_extra.clear()
        after_metrics = scorer.score_rows(rows, meta)
        results[layout] = {"streamed": streamed, "after": [r.score for r in rows], "calls_during": during,
                           "calls_during_pending": [c for c in during if c > 0], "blocker": blocker,
                           "stats": {k: v for k, v in stats.items() if isinstance(v, float)}, "metrics": metrics,
                           "after_metrics": after_metrics, "covered": sum(m["data_source"] == "s" for m in meta) * 3,
                           "num_truncated": after_metrics["reward_model/num_truncated"]}
        mpu.destroy_model_parallel()
    write_results(results, args.out)
    destroy_distributed()


if __name__ == "__main__":
    main()
