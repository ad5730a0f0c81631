"""The GPU learning run's short version (launch/learn_gpu.py --quick): the whole bf16 path (varlen attention,
fused log-prob kernel, CUDA-graph rollout, token budgets) raises the training reward while the rollout's
log-probs stay within trainer.max_rollout_logprob_gap of the actor's. Needs CUDA; skipped without it."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_quick_gpu_learning_run(tmp_path):
    sys.path.insert(0, str(ROOT / "launch"))
    import learn_gpu

    from rlhf_mcore.config import load_config

    summary = learn_gpu.main(["--quick", "--out", str(tmp_path / "learn")])
    grpo = summary["grpo"]
    rewards = [r for _, r in grpo["reward"]]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4, rewards
    limit = load_config(None, ["actor_rollout_ref.model.path=x"]).trainer.max_rollout_logprob_gap
    assert grpo["k3_kl_max"] < limit, grpo
