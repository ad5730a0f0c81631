"""Rollout correction (IS weights, TIS cap, batch normalisation, rejection, veto) against naive loops and
hand-computed numbers from veRL's formulas; its config keys; its use by the policy loss and the trainer."""
import math
from types import SimpleNamespace

import pytest
import torch

from rlhf_mcore.algos.policy_loss import get_policy_loss
from rlhf_mcore.algos.rollout_correction import (
    batch_normalize_is_weights,
    compute_rollout_correction,
    is_weights,
    rejection_mask,
    token_veto_mask,
    truncate_is_weights,
)
from rlhf_mcore.config import ConfigError, load_config

MODEL = ["actor_rollout_ref.model.path=/models/m"]
RC = "algorithm.rollout_correction"


def grid(seed=0, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3  # (B, T)
    roll = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4  # (B, T)
    lengths = [T, 3, 1, 5, 0]  # a full row, short rows, an empty row
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths[:B]], dtype=torch.float64)
    old = torch.where(mask.bool(), old, torch.full_like(old, float("nan")))  # padding never leaks
    return old, roll, mask


def rows(x):
    return x.tolist()


def naive_ratios(old, roll, mask, level):
    """Per (b, t) the ratio pi_old/pi_rollout each token is judged by, with a plain loop."""
    out = []
    for b in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[b, t] > 0]
        logs = [float(old[b, t] - roll[b, t]) for t in valid]
        if level == "sequence":
            seq = math.prod(math.exp(x) for x in logs)
        elif level == "geometric":
            seq = math.exp(sum(logs) / len(logs)) if logs else 1.0
        out.append([(math.exp(float(old[b, t] - roll[b, t])) if level == "token" else seq) if t in valid else None
                    for t in range(old.shape[1])])
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_is_weights_match_a_naive_loop_and_ignore_padding(level):
    old, roll, mask = grid()
    w = is_weights(old - roll, mask, level)
    expect = naive_ratios(old, roll, mask, level)
    for b, row in enumerate(expect):
        for t, e in enumerate(row):
            assert w[b, t].item() == pytest.approx(0.0 if e is None else e, rel=1e-9)
    assert torch.isfinite(w).all()


def test_tis_cap_and_verl_formula_numbers():
    # log-ratios 0.5, -1.0, 0.0 (veRL: rho = exp(old - rollout); sequence: exp(sum); TIS: min(rho, threshold))
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    roll = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    tok = is_weights(old - roll, mask, "token")
    assert rows(tok)[0] == pytest.approx([1.6487212707, 0.3678794412, 1.0])
    assert rows(truncate_is_weights(tok, 1.5))[0] == pytest.approx([1.5, 0.3678794412, 1.0])
    assert rows(is_weights(old - roll, mask, "sequence"))[0] == pytest.approx([0.6065306597] * 3)
    # rejection band [1/2, 2]: token keeps rho 1.65 and 1.0, drops 0.37; the sequence (0.61) stays;
    # geometric exp(-0.5/3) = 0.8465 stays; a band [0.7, 2] drops the sequence but keeps the geometric mean
    assert rows(rejection_mask(old - roll, mask, "token", 2.0))[0] == [1.0, 0.0, 1.0]
    assert rows(rejection_mask(old - roll, mask, "sequence", 2.0))[0] == [1.0, 1.0, 1.0]
    assert rows(rejection_mask(old - roll, mask, "sequence", 2.0, 0.7))[0] == [0.0, 0.0, 0.0]
    assert rows(rejection_mask(old - roll, mask, "geometric", 2.0, 0.7))[0] == [1.0, 1.0, 1.0]
    assert rows(rejection_mask(old - roll, mask, "geometric", 2.0, 0.85))[0] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rollout_is_threshold must be > 0"):
        truncate_is_weights(tok, 0.0)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("upper, lower", [(1.3, None), (1.5, 0.9)])
def test_rejection_band_matches_a_naive_loop(level, upper, lower):
    old, roll, mask = grid(seed=1)
    keep = rejection_mask(old - roll, mask, level, upper, lower)
    lo = 1 / upper if lower is None else lower
    for b, row in enumerate(naive_ratios(old, roll, mask, level)):
        for t, r in enumerate(row):
            assert keep[b, t].item() == (0.0 if r is None else float(lo <= r <= upper)), (b, t, r)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalisation_divides_by_the_batch_mean_and_splits_over_ranks(level):
    old, roll, mask = grid(seed=2)
    w = truncate_is_weights(is_weights(old - roll, mask, level), 2.0)
    normed, factor = batch_normalize_is_weights(w, mask, level)
    if level == "token":
        vals = [w[b, t].item() for b in range(w.shape[0]) for t in range(w.shape[1]) if mask[b, t]]
    else:  # one weight per sequence with a valid token
        vals = [w[b][mask[b].bool()][0].item() for b in range(w.shape[0]) if mask[b].any()]
    mean = sum(vals) / len(vals)
    assert factor.item() == pytest.approx(mean)
    assert torch.allclose(normed, w / mean)
    # the batch split over two "ranks": each normalises by the whole batch's mean through batch_sum
    halves = [slice(0, 2), slice(2, None)]
    local = torch.cat([batch_normalize_is_weights(w[h], mask[h], level)[0] for h in halves])
    assert not torch.allclose(local, normed)  # each half's own mean differs from the batch's
    stats = []

    def record(t):  # first pass: collect each rank's (sum, count)
        stats.append(t)
        return t

    for h in halves:
        batch_normalize_is_weights(w[h], mask[h], level, batch_sum=record)
    total = stats[0] + stats[1]  # what the all-reduce returns on every rank
    parts = [batch_normalize_is_weights(w[h], mask[h], level, batch_sum=lambda t: total)[0] for h in halves]
    assert torch.allclose(torch.cat(parts), normed)


def test_token_veto_rejects_whole_sequences_with_one_bad_token():
    old, roll, mask = grid(seed=3)
    keep = token_veto_mask(old - roll, mask, 0.6)
    for b in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[b, t]]
        bad = any(math.exp(float(old[b, t] - roll[b, t])) < 0.6 for t in valid)
        assert rows(keep[b]) == [0.0 if bad or t not in valid else 1.0 for t in range(mask.shape[1])]


@pytest.mark.parametrize("threshold", [1e-30, 1e-10, 1e-8, 0.6])
def test_token_veto_matches_a_naive_loop_past_the_clamp(threshold):
    """Log-ratios up to +40 with one low token per row at -75, -32.2, -20.5 (most past the +-20 clamp), padding
    at -100; thresholds on both sides of e^-20 (log 1e-30 = -69.1, log 1e-10 = -23.0, log 1e-8 = -18.4).

    Mutation: compare `exp(log_ratio.clamp(-20, 20)) < threshold` again -> fails for 1e-30 and 1e-10."""
    _, _, mask = grid(B=5, T=7)  # lengths 7, 3, 1, 5, 0
    g = torch.Generator().manual_seed(8)
    lr = torch.rand(mask.shape, generator=g, dtype=torch.float64) * 40  # (B, T)
    for b, (t, low) in enumerate([(4, -75.0), (1, -32.2), (0, -20.5)]):  # row 3: all >= 0; row 4: empty
        lr[b, t] = low
    lr = torch.where(mask.bool(), lr, torch.full_like(lr, -100.0))  # padding never vetoes
    keep = token_veto_mask(lr, mask, threshold)
    vetoed_rows = 0
    for b in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[b, t]]
        bad = any(math.exp(float(lr[b, t])) < threshold for t in valid)  # float64: exp(-75) = 2.7e-33 > 0
        vetoed_rows += bad
        assert rows(keep[b]) == [0.0 if bad or t not in valid else 1.0 for t in range(mask.shape[1])], b
    assert vetoed_rows == {1e-30: 1, 1e-10: 2, 1e-8: 3, 0.6: 3}[threshold]


@pytest.mark.parametrize("log_ratio, threshold, vetoed", [
    (-32.2, 1e-10, True),   # ratio 1.0e-14 < 1e-10: veRL vetoes; the clamp made it e^-20 = 2.1e-9 and kept it
    (-23.5, 1e-10, True),   # 6.2e-11 < 1e-10, just past the clamp
    (-20.5, 1e-10, False),  # 1.25e-9 > 1e-10: past the clamp, still above the threshold
    (-20.5, 1e-8, True),    # threshold above e^-20
    (-18.0, 1e-8, False),   # 1.5e-8 > 1e-8
    (-float("inf"), 1e-30, True),  # pi_old(y) = 0
    (32.2, 1e-10, False),   # a huge ratio is never vetoed
    (float("nan"), 1e-10, False),  # veRL's `<` on NaN: no veto
])
def test_token_veto_in_log_space_on_both_sides_of_the_clamp(log_ratio, threshold, vetoed):
    """One bad token in row 0; row 1 has the same value on a padded position and must be kept.

    Mutation: compare `exp(log_ratio.clamp(-20, 20)) < threshold` again -> fails on -32.2, -23.5 and -inf."""
    old = torch.tensor([[-1.0, -1.0 + log_ratio, -2.0], [-1.0, -1.5, -1.0 + log_ratio]])  # (2, 3) fp32
    roll = torch.tensor([[-1.0, -1.0, -2.0], [-1.0, -1.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    keep = token_veto_mask(old - roll, mask, threshold)
    assert rows(keep) == [[0.0] * 3 if vetoed else [1.0] * 3, [1.0, 1.0, 0.0]]
    c = compute_rollout_correction(old, roll, mask, rollout_token_veto_threshold=threshold)
    assert torch.equal(c.response_mask, keep)
    assert c.metrics["rollout_corr/rollout_is_veto_fraction"] == (0.5 if vetoed else 0.0)


def test_compute_rollout_correction_combines_weights_masks_and_metrics():
    old, roll, mask = grid(seed=4)
    c = compute_rollout_correction(old, roll, mask, rollout_is="token", rollout_is_threshold=1.2,
                                   rollout_rs="token", rollout_rs_threshold=1.4)
    raw = is_weights(old - roll, mask, "token")
    keep = rejection_mask(old - roll, mask, "token", 1.4)
    assert torch.equal(c.response_mask, mask * keep)
    assert torch.allclose(c.rollout_is_weights, raw.clamp(max=1.2) * keep)
    n = mask.sum().item()
    valid_raw = raw[mask.bool()]
    m = c.metrics
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(valid_raw.mean().item())
    assert m["rollout_corr/rollout_is/max"] == pytest.approx(valid_raw.max().item())
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx((valid_raw > 1.2).sum().item() / n)
    rejected = (mask - mask * keep).sum().item()
    assert 0 < rejected < n
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected / n)
    seqs_hit = sum(bool(((mask[b] - mask[b] * keep[b]) > 0).any()) for b in range(mask.shape[0]))
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(seqs_hit / mask.shape[0])
    off = compute_rollout_correction(old, roll, mask)
    assert off.rollout_is_weights is None and torch.equal(off.response_mask, mask) and off.metrics == {}
    with pytest.raises(ValueError, match="needs rollout_rs_threshold"):
        compute_rollout_correction(old, roll, mask, rollout_rs="token")
    with pytest.raises(ValueError, match="rollout_is='seq'; choose one of token, sequence"):
        compute_rollout_correction(old, roll, mask, rollout_is="seq")


@pytest.mark.parametrize("loss", ["vanilla", "gspo"])
def test_policy_loss_with_unit_weights_equals_the_loss_without(loss):
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(4, 6, generator=g)
    new = (old + 0.1 * torch.randn(4, 6, generator=g)).requires_grad_()
    adv = torch.randn(4, 6, generator=g)
    mask = (torch.arange(6) < torch.tensor([[6], [4], [2], [5]])).float()
    fn = get_policy_loss(loss)
    base, _ = fn(old, new, adv, mask)
    ones, _ = fn(old, new, adv, mask, rollout_is_weights=torch.ones(4, 6))
    assert torch.equal(base, ones)
    w = torch.rand(4, 6, generator=g) + 0.5
    weighted, _ = fn(old, new, adv, mask, rollout_is_weights=w)
    assert not torch.allclose(weighted, base)
    twice, _ = fn(old, new, adv, mask, rollout_is_weights=torch.full((4, 6), 2.0))
    assert torch.allclose(twice, 2 * base)


@pytest.mark.parametrize("overrides, message", [
    ([f"{RC}.rollout_is=tokens"], r"rollout_is' has value 'tokens'; it must be null \(off\), token or sequence"),
    ([f"{RC}.rollout_rs=seq", f"{RC}.rollout_rs_threshold=2"], r"rollout_rs' has value 'seq'; .*geometric"),
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0"], r"rollout_is_threshold' has value 0.0; .*> 0"),
    ([f"{RC}.rollout_is_batch_normalize=true"], r"no IS weights to normalise"),
    ([f"{RC}.rollout_rs=token"], r"rollout_rs_threshold' has value None; it must be set when"),
    ([f"{RC}.rollout_rs_threshold=2"], r"set only with algorithm.rollout_correction.rollout_rs"),
    ([f"{RC}.rollout_rs=token", f"{RC}.rollout_rs_threshold=2", f"{RC}.rollout_rs_threshold_lower=3"],
     r"rollout_rs_threshold_lower' has value 3.0; it must be below"),
    ([f"{RC}.rollout_rs=token", f"{RC}.rollout_rs_threshold=0.5"], r"the band \[1/threshold, threshold\] is empty"),
    ([f"{RC}.rollout_token_veto_threshold=-1"], r"rollout_token_veto_threshold' has value -1.0"),
    ([f"{RC}.rollout_is=token", "actor_rollout_ref.actor.use_rollout_log_probs=true"],
     r"use_rollout_log_probs' has value True; it must be false while algorithm.rollout_correction is on"),
    ([f"{RC}.bypass_mode=true"], r"set actor_rollout_ref.actor.use_rollout_log_probs=true"),
])
def test_rollout_correction_keys_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, MODEL + overrides)


def test_rollout_correction_keys_load_and_default_off():
    rc = load_config(None, MODEL).algorithm.rollout_correction
    assert rc.rollout_is is None and rc.rollout_rs is None and rc.rollout_token_veto_threshold is None
    cfg = load_config(None, MODEL + [f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold=5",
                                     f"{RC}.rollout_is_batch_normalize=true", f"{RC}.rollout_rs=geometric",
                                     f"{RC}.rollout_rs_threshold=1.01", f"{RC}.rollout_rs_threshold_lower=0.99",
                                     f"{RC}.rollout_token_veto_threshold=1e-4"])
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs_threshold_lower) == ("sequence", 5.0, 0.99)
    assert load_config(None, MODEL + ["actor_rollout_ref.actor.use_rollout_log_probs=true"]) \
        .actor_rollout_ref.actor.use_rollout_log_probs


class _Engine:
    def __init__(self):
        self.seen = None

    def compute_log_probs(self, batch):
        raise AssertionError("bypass mode must not run the old-log-prob forward pass")

    def update_policy(self, batch):
        self.seen = batch
        return {"actor/pg_loss": 0.0}


def _learner(*overrides):
    from rlhf_mcore.trainer.learner import Learner

    cfg = load_config(None, MODEL + list(overrides))
    return Learner(cfg, SimpleNamespace(dp_group=None), actor=_Engine())


def test_trainer_bypass_uses_the_rollout_log_probs_as_the_old_policy():
    from rlhf_mcore.trainer.stats import batch_metrics

    learner = _learner("actor_rollout_ref.actor.use_rollout_log_probs=true")
    old, roll, mask = grid(seed=6)
    batch = {"rollout_log_probs": roll, "response_mask": mask}
    learner.forward_passes(batch)
    assert batch["old_log_probs"] is roll and "old_entropy" not in batch
    assert learner.correct_rollout(batch) == {}
    batch.update(token_level_scores=torch.zeros_like(mask), token_level_rewards=torch.zeros_like(mask),
                 advantages=torch.zeros_like(mask), returns=torch.zeros_like(mask),
                 truncated=torch.zeros(mask.shape[0]), attention_mask=torch.ones(mask.shape[0], 10))
    assert not any(k.startswith("rollout/") for k in batch_metrics(batch))  # no gap: nothing was recomputed


def test_trainer_correction_feeds_weights_and_the_rejection_mask_to_the_update():
    learner = _learner(f"{RC}.rollout_is=token", f"{RC}.rollout_rs=token", f"{RC}.rollout_rs_threshold=1.3")
    old, roll, mask = grid(seed=7)
    old = torch.nan_to_num(old)
    batch = {"old_log_probs": old, "rollout_log_probs": roll, "response_mask": mask}
    metrics = learner.correct_rollout(batch)
    assert set(metrics) >= {"rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction"}
    keep = rejection_mask(old - roll, mask, "token", 1.3)
    learner.update(batch)
    assert torch.equal(learner.actor.seen["response_mask"], mask * keep)  # the loss sees the rejection
    assert torch.equal(batch["response_mask"], mask)  # advantages and metrics keep the whole response
    want = is_weights(old - roll, mask, "token").clamp(max=2) * keep
    assert torch.allclose(learner.actor.seen["rollout_is_weights"], want)
