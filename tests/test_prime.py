"""PRIME's math (rlhf_mcore.algos.prime) against plain Python loops written from the formulas."""
import math
import random

import pytest
import torch

from rlhf_mcore.algos.prime import (
    implicit_process_rewards,
    masked_rloo,
    prime_advantages,
    prime_ce_loss,
    prime_dpo_accuracy,
    prime_norm,
)

B, R, N = 8, 6, 4  # two groups of four samples


def close(got: torch.Tensor, want: list, tol: float = 1e-12) -> bool:
    return torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=tol, rtol=0)


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [1 + (3 * b + seed) % R for b in range(B)]
    mask = torch.zeros(B, R)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    prm = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3
    acc = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    index = torch.tensor([0] * N + [1] * N)
    return prm, ref, mask.double(), lengths, acc, index


def naive_rewards(prm, ref, lengths, beta, granularity):
    out = [[0.0] * R for _ in range(B)]
    for b in range(B):
        rs = [beta * (float(prm[b, t]) - float(ref[b, t])) for t in range(lengths[b])]
        if granularity == "token":
            out[b][:lengths[b]] = rs
        else:
            out[b][lengths[b] - 1] = sum(rs)
    return out


@pytest.mark.parametrize("granularity", ["token", "whole"])
def test_process_rewards_match_a_loop(granularity):
    prm, ref, mask, lengths, _, _ = batch()
    scores, q = implicit_process_rewards(prm, ref, mask, beta=0.05, granularity=granularity)
    assert close(scores, naive_rewards(prm, ref, lengths, 0.05, granularity))
    for b in range(B):  # q: the log-ratio on the response, 0 after it
        for t in range(R):
            want = float(prm[b, t] - ref[b, t]) if t < lengths[b] else 0.0
            assert float(q[b, t]) == pytest.approx(want)


def test_batch_norm_matches_a_loop():
    prm, ref, mask, lengths, _, _ = batch(1)
    scores, _ = implicit_process_rewards(prm, ref, mask, beta=0.05)
    rows = scores.tolist()
    biggest = max(abs(sum(row[t:])) for row in rows for t in range(R))
    assert close(prime_norm(scores, "batch_norm"), [[x / (biggest + 1e-6) for x in row] for row in rows])
    assert torch.equal(prime_norm(scores, "none"), scores)
    with pytest.raises(ValueError, match="prime_norm='layer'"):
        prime_norm(scores, "layer")


def naive_rloo(rewards, mask, groups):
    out = [[0.0] * R for _ in range(B)]
    for members in groups:
        n = len(members)
        means = {i: sum(rewards[i][t] for t in range(R) if mask[i][t]) / max(1, sum(mask[i])) for i in members}
        for i in members:
            others = sum(means[j] for j in members if j != i) / (n - 1)
            for t in range(R):
                if mask[i][t]:
                    # r * n/(n-1) - sum_j m_j/(n-1)  ==  r + (r - m_i)/(n-1) - mean_{j != i} m_j
                    out[i][t] = rewards[i][t] + (rewards[i][t] - means[i]) / (n - 1) - others
    return out


def test_rloo_matches_a_loop_and_is_leave_one_out_for_outcomes():
    prm, ref, mask, lengths, acc, index = batch(2)
    scores, _ = implicit_process_rewards(prm, ref, mask, beta=0.05)
    groups = [list(range(N)), list(range(N, B))]
    assert close(masked_rloo(scores, mask, index), naive_rloo(scores.tolist(), mask.tolist(), groups))
    # one reward per sample: r_i - mean of the others
    outcome = torch.zeros(B, R, dtype=torch.float64)
    last = torch.zeros(B, R)
    for b in range(B):
        outcome[b, lengths[b] - 1], last[b, lengths[b] - 1] = acc[b], 1
    rl = masked_rloo(outcome, last, index)
    for b in range(B):
        others = [float(acc[j]) for j in groups[b // N] if j != b]
        assert float(rl[b, lengths[b] - 1]) == pytest.approx(float(acc[b]) - sum(others) / len(others))
    with pytest.raises(ValueError, match="RLOO needs rollout.n >= 2"):
        masked_rloo(scores, mask, torch.arange(B))


@pytest.mark.parametrize("dpo_coef, gt_coef", [(5.0, 5.0), (0.0, 1.0), (2.0, 0.0)])
def test_advantages_match_a_loop(dpo_coef, gt_coef):
    prm, ref, mask, lengths, acc, index = batch(3)
    scores = prime_norm(implicit_process_rewards(prm, ref, mask, beta=0.05)[0])
    adv, ret = prime_advantages(scores, acc, mask, index, reward_dpo_coef=dpo_coef, reward_gt_coef=gt_coef)
    groups = [list(range(N)), list(range(N, B))]
    m = mask.tolist()
    proc = naive_rloo(scores.tolist(), m, groups)
    outcome_rewards = [[0.0] * R for _ in range(B)]
    last_mask = [[0] * R for _ in range(B)]
    for b in range(B):
        outcome_rewards[b][lengths[b] - 1], last_mask[b][lengths[b] - 1] = float(acc[b]), 1
    outc = naive_rloo(outcome_rewards, last_mask, groups)
    total = [[dpo_coef * proc[b][t] + gt_coef * outc[b][t] for t in range(R)] for b in range(B)]
    returns = [[sum(total[b][t:lengths[b]]) if t < lengths[b] else 0.0 for t in range(R)] for b in range(B)]
    assert close(ret, returns)
    valid = [returns[b][t] for b in range(B) for t in range(lengths[b])]
    mean = sum(valid) / len(valid)
    var = sum((x - mean) ** 2 for x in valid) / (len(valid) - 1)
    want = [[(returns[b][t] - mean) / math.sqrt(var + 1e-8) if t < lengths[b] else 0.0 for t in range(R)]
            for b in range(B)]
    assert close(adv, want, 1e-9)
    # split over two "ranks" whose partial sums are added: the same advantages as the whole batch
    from rlhf_mcore.algos.prime import _whiten

    halves = [slice(0, N), slice(N, B)]
    parts = [torch.stack([(ret[h] * mask[h]).sum(), (ret[h] ** 2 * mask[h]).sum(), mask[h].sum()]) for h in halves]
    for k, h in enumerate(halves):
        assert close(_whiten(ret[h], mask[h], lambda t, k=k: t + parts[1 - k]) * mask[h], want[h.start:h.stop], 1e-9)


def test_ce_loss_matches_a_loop_and_trains_q():
    prm, ref, mask, lengths, acc, _ = batch(4)
    prm = prm.clone().requires_grad_(True)
    _, q = implicit_process_rewards(prm, ref, mask, beta=0.05)
    loss = prime_ce_loss(q, acc, mask, beta=0.05)
    want = 0.0
    for b in range(B):
        s = 1 / (1 + math.exp(-0.05 * sum(float(prm.detach()[b, t] - ref[b, t]) for t in range(lengths[b]))))
        want -= (float(acc[b]) * math.log(s) + (1 - float(acc[b])) * math.log(1 - s)) / B
    assert float(loss.detach()) == pytest.approx(want, rel=1e-10)
    loss.backward()
    # the gradient raises the log-probs of correct samples and lowers those of wrong ones, on the response only
    for b in range(B):
        g = prm.grad[b, :lengths[b]]
        assert bool((g < 0).all()) if acc[b] == 1 else bool((g > 0).all())
        assert not prm.grad[b, lengths[b]:].any()


def test_dpo_accuracy_matches_a_loop():
    rng = random.Random(0)
    for seed in range(5):
        prm, ref, mask, lengths, acc, index = batch(seed)
        acc = torch.tensor([float(rng.random() < 0.5) for _ in range(B)], dtype=torch.float64)
        _, q = implicit_process_rewards(prm, ref, mask, beta=0.05)
        sums = [float(q[b].sum()) for b in range(B)]
        per_group = []
        for members in (range(N), range(N, B)):
            members = list(members)
            num = den = 0.0
            for a in range(len(members)):
                for c in range(a + 1, len(members)):
                    i, j = members[a], members[c]
                    w = abs(float(acc[i] - acc[j]))
                    num += w * (((sums[i] - sums[j]) > 0) == ((float(acc[i]) - float(acc[j])) > 0))
                    den += w
            per_group.append(num / den if den else 0.5)
        assert float(prime_dpo_accuracy(q, acc, mask, index)) == pytest.approx(sum(per_group) / len(per_group))


def test_prime_through_train_py_at_dp2(tmp_path, tiny_model_dir):
    """End to end under torchrun (2 ranks, DP=2): the implicit PRM is updated every step (its cross-entropy and
    gradient logged), its process rewards enter the advantages, and the run finishes."""
    import shutil

    from e2e_helpers import parity_task, records, torchrun_train

    out = tmp_path / "run"
    args = parity_task(tmp_path, tiny_model_dir("qwen2")) + [
        "algorithm.adv_estimator=rloo", "reward_model.enable=true", "reward_model.reward_manager=prime",
        "reward_model.model.optim.lr=1e-3", "trainer.total_training_steps=2", "trainer.export_hf_final=false",
        "trainer.save_freq=1"]
    proc = torchrun_train(2, args + [f"trainer.default_local_dir={out}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = records(out)
    assert [r["step"] for r in first] == [1, 2]
    for r in first:
        assert r["prime_rm/ce_loss"] > 0 and r["prime_rm/grad_norm"] > 0 and r["prime_rm/num_optimizer_steps"] == 1
        assert 0 <= r["prime/dpo_acc"] <= 1 and r["prime/process_reward_mean"] != 0
    assert first[0]["prime_rm/ce_loss"] != first[1]["prime_rm/ce_loss"]

    # resumed from the step-1 checkpoint, step 2 sees the PRM as it was trained through step 1 (its checkpoint)
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "global_step_2")
    proc = torchrun_train(2, args + [f"trainer.default_local_dir={resumed}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = records(resumed)
    assert [r["step"] for r in again] == [1, 2]
    for k in ("prime_rm/ce_loss", "prime/dpo_acc", "prime/process_reward_mean", "actor/pg_loss"):
        assert again[1][k] == first[1][k], (k, again[1][k], first[1][k])
