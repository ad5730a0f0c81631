"""The KL-in-reward penalty's metrics (veRL's `actor/reward_kl_penalty` and `actor/reward_kl_penalty_coeff`)
through the learner's own `compute_advantages` and the run's step record, as every mode (synchronous,
one_step_off, fully_async) runs them, against a naive loop; tests/test_trainer.py checks them in a launched run."""
import math
from types import SimpleNamespace

import pytest
import torch

from rlhf_mcore.config import load_config
from rlhf_mcore.trainer.hooks import PhaseTimer
from rlhf_mcore.trainer.learner import Learner
from rlhf_mcore.trainer.run import step_record

MODEL = ["actor_rollout_ref.model.path=/models/m", "algorithm.adv_estimator=grpo", "trainer.test_freq=-1",
         "trainer.save_freq=-1"]


def _learner(*overrides):
    """A learner without models: `compute_advantages` reads none."""
    cfg = load_config(None, MODEL + ["algorithm.use_kl_in_reward=true", *overrides])
    return Learner(cfg, SimpleNamespace(dp_group=None), actor=None)


def _step(learner, batch):
    """The advantages, then the step's logged metrics as every mode's loop makes them."""
    metrics = learner.compute_advantages(batch)
    return step_record(batch, metrics, _timer(), kl_coef=learner.kl_ctrl.value, dp=1)


def _batch(seed=0, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2  # (B, T)
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5  # (B, T)
    lengths = [6, 2, 4, 1]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths], dtype=torch.float64)
    scores = torch.zeros(B, T, dtype=torch.float64)
    scores[torch.arange(B), torch.tensor(lengths) - 1] = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    return {"old_log_probs": old, "rollout_log_probs": old.clone(), "ref_log_prob": ref, "response_mask": mask,
            "token_level_scores": scores, "index": [0, 0, 1, 1], "truncated": torch.zeros(B),
            "attention_mask": torch.ones(B, T + 3)}


def naive_penalty(batch, kind):
    """The batch mean of each sequence's mean KL over its response tokens, one token at a time."""
    per_seq = []
    for b in range(batch["response_mask"].shape[0]):
        kls = []
        for t in range(batch["response_mask"].shape[1]):
            if batch["response_mask"][b, t]:
                d = float(batch["old_log_probs"][b, t] - batch["ref_log_prob"][b, t])
                kls.append({"kl": d, "mse": 0.5 * d * d, "low_var_kl": math.exp(-d) + d - 1}[kind])
        per_seq.append(sum(kls) / len(kls))
    return sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("kind", ["kl", "mse", "low_var_kl"])
def test_step_metrics_log_the_reward_kl_penalty_and_its_coefficient(kind):
    """Fixed control: the coefficient is algorithm.kl_ctrl.kl_coef; the penalty the masked mean KL the rewards
    were lowered by (each sequence's token mean, then the batch mean).

    Mutation: compute_advantages not returning the penalty's metrics (`metrics = {...}` dropped) -> fails
    (KeyError)."""
    batch = _batch()
    logged = _step(_learner(f"algorithm.kl_penalty={kind}", "algorithm.kl_ctrl.kl_coef=0.05"), batch)
    penalty = naive_penalty(batch, kind)
    assert abs(penalty) > 0.01
    assert logged["actor/reward_kl_penalty"] == pytest.approx(penalty, rel=1e-9)
    assert logged["actor/reward_kl_penalty_coeff"] == 0.05
    # the KL the rewards were lowered by, averaged the same way, is the logged penalty
    used = (batch["token_level_scores"] - batch["token_level_rewards"]) / 0.05  # (B, T) KL_t on the response
    mask = batch["response_mask"]
    assert ((used * mask).sum(1) / mask.sum(1)).mean().item() == pytest.approx(penalty, rel=1e-9)


def test_adaptive_coefficient_is_the_one_the_penalty_used():
    """Adaptive control: `reward_kl_penalty_coeff` is the coefficient the step's penalty was computed with (veRL's
    beta, before the controller's update); `actor/kl_coef` the updated one the next step uses.

    Mutation: log `self.kl_ctrl.value` (after the update) as the coefficient -> fails."""
    learner = _learner("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.2",
                       "algorithm.kl_ctrl.target_kl=0.01", "algorithm.kl_ctrl.horizon=100")
    batch = _batch(seed=1)
    logged = _step(learner, batch)
    penalty = naive_penalty(batch, "kl")
    assert logged["actor/reward_kl_penalty"] == pytest.approx(penalty, rel=1e-9)
    assert logged["actor/reward_kl_penalty_coeff"] == 0.2
    grown = 0.2 * (1 + min(max(penalty / 0.01 - 1, -0.2), 0.2) * learner.cfg.data.train_batch_size / 100)
    assert logged["actor/kl_coef"] == pytest.approx(grown) and grown != pytest.approx(0.2)


def test_no_penalty_metrics_without_kl_in_reward():
    batch = _batch()
    logged = _step(_learner("algorithm.use_kl_in_reward=false"), batch)
    assert not any(k.startswith("actor/reward_kl_penalty") for k in logged)
    assert torch.equal(batch["token_level_rewards"], batch["token_level_scores"])


def _timer():
    t = PhaseTimer()
    with t("step"):
        pass
    return t
