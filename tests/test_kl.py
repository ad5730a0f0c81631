"""KL estimators, controllers, KL-in-reward and KL-as-loss against per-element Python references."""
import math

import pytest
import torch

from rlhf_mcore.algos import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    compute_kl_loss,
    kl_penalty,
)

F64 = torch.float64


def naive_kl(lp: float, ref: float, kind: str) -> float:
    d = lp - ref
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    if kind in ("k3", "low_var_kl"):  # veRL: clamp -d to [-20, 20], the estimate to [-10, 10]
        x = min(max(-d, -20.0), 20.0)
        return min(max(math.exp(x) - x - 1, -10.0), 10.0)
    raise AssertionError(kind)


def batch(seed=0, B=4, T=5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=F64) * 4
    ref = lp + torch.randn(B, T, generator=g, dtype=F64)
    ref[0, 0] = lp[0, 0] + 25.0  # exercises the k3 clamps (|d| > 20 and estimate > 10)
    ref[0, 1] = lp[0, 1] - 25.0
    mask = torch.ones(B, T, dtype=F64)
    mask[1, 3:] = 0
    mask[2] = 0  # an all-masked row
    mask[3, 1:] = 0  # a length-1 row
    return lp, ref, mask


@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_estimators_match_formulas(kind):
    lp, ref, _ = batch()
    out = kl_penalty(lp, ref, kind)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            assert out[i, t].item() == pytest.approx(naive_kl(lp[i, t].item(), ref[i, t].item(), kind), rel=1e-12)
    if kind in ("k3", "low_var_kl"):
        assert out.max().item() == 10.0 and out.min().item() >= 0.0


@pytest.mark.parametrize("kind", ["k1", "k3", "low_var_kl", "abs"])
def test_straight_through_variants_keep_value_and_take_k2_gradient(kind):
    lp, ref, _ = batch(1)
    a = lp.clone().requires_grad_(True)
    b = lp.clone().requires_grad_(True)
    value = kl_penalty(a, ref, kind + "+")
    torch.testing.assert_close(value.detach(), kl_penalty(lp, ref, kind))
    value.sum().backward()
    kl_penalty(b, ref, "k2").sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    torch.testing.assert_close(a.grad, lp - ref)  # d/dlp of 0.5 (lp - ref)^2


def test_unknown_estimator_names_the_config_keys():
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "full")


def test_fixed_controller_never_moves_and_round_trips():
    ctrl = build_kl_controller(type="fixed", kl_coef=0.05)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(current_kl=10.0, n_steps=256)
    assert ctrl.value == 0.05
    other = FixedKLController(0.0)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.05


def test_adaptive_controller_follows_ziegler_update_and_resumes_exactly():
    ctrl = build_kl_controller(type="adaptive", kl_coef=0.1, target_kl=0.05, horizon=1000)
    assert isinstance(ctrl, AdaptiveKLController)
    value = 0.1
    kls = [0.0, 0.04, 0.05, 0.06, 1.0, 0.2, 0.01]
    for step, kl in enumerate(kls):
        if step == 3:  # checkpoint mid-run, resume into a fresh controller
            state = ctrl.state_dict()
            ctrl = AdaptiveKLController(init_kl_coef=123.0, target_kl=1.0, horizon=1)
            ctrl.load_state_dict(state)
        ctrl.update(current_kl=kl, n_steps=64)
        err = min(max(kl / 0.05 - 1, -0.2), 0.2)
        value *= 1 + err * 64 / 1000
        assert ctrl.value == pytest.approx(value, rel=1e-12)
    assert ctrl.target == 0.05 and ctrl.horizon == 1000


def test_controller_config_errors_are_actionable():
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        build_kl_controller(type="pid")
    with pytest.raises(ValueError, match="horizon"):
        build_kl_controller(type="adaptive", horizon=0)
    with pytest.raises(ValueError, match="target_kl"):
        build_kl_controller(type="adaptive", target_kl=0.0)


@pytest.mark.parametrize("kind", ["kl", "low_var_kl", "abs"])
def test_apply_kl_penalty_matches_naive_loop(kind):
    lp, ref, mask = batch(2)
    scores = torch.zeros_like(lp)
    scores[0, 4] = 1.0
    scores[1, 2] = 1.0
    rewards, metrics = apply_kl_penalty(scores, lp, ref, mask, kl_coef=0.2, kl_penalty_type=kind)
    per_seq = []
    for i in range(lp.shape[0]):
        kls = []
        for t in range(lp.shape[1]):
            kl = naive_kl(lp[i, t].item(), ref[i, t].item(), kind) if mask[i, t] else 0.0
            assert rewards[i, t].item() == pytest.approx(scores[i, t].item() - 0.2 * kl, abs=1e-12)
            if mask[i, t]:
                kls.append(kl)
        per_seq.append(sum(kls) / len(kls) if kls else 0.0)
    assert metrics["reward_kl_penalty"].item() == pytest.approx(sum(per_seq) / len(per_seq))
    assert metrics["reward_kl_penalty_coeff"].item() == pytest.approx(0.2)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_kl_loss_matches_naive_aggregation_and_gradient_flows_to_policy(mode):
    lp, ref, mask = batch(3)
    a = lp.clone().requires_grad_(True)
    loss, metrics = compute_kl_loss(a, ref, mask, kl_loss_coef=0.5, kl_loss_type="low_var_kl", loss_agg_mode=mode)
    rows = [[naive_kl(lp[i, t].item(), ref[i, t].item(), "low_var_kl") for t in range(5) if mask[i, t]]
            for i in range(4)]
    if mode == "token-mean":
        expected = sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    else:
        expected = sum(sum(r) / len(r) for r in rows if r) / sum(1 for r in rows if r)
    assert metrics["kl_loss"].item() == pytest.approx(expected)
    assert loss.item() == pytest.approx(0.5 * expected)
    loss.backward()
    assert torch.all(a.grad[mask == 0] == 0) and a.grad[mask == 1].abs().sum() > 0
