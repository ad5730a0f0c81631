"""Advantage estimators against naive per-row Python references (veRL 0.7 definitions, written as loops).

Batches are random and include all-masked rows, length-1 responses, groups of size 1 and groups whose
rewards are all equal (which must give exactly zero advantage and no NaN).
"""
import math
import random

import numpy as np
import pytest
import torch

from rlhf_mcore.algos import get_adv_estimator, list_adv_estimators, register_adv_estimator
from rlhf_mcore.algos.advantages import _gae_recursion, group_ids

ESTIMATORS = ["gae", "grpo", "rloo", "remax", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]


def make_batch(seed: int, T: int = 7):
    """Random right-padded batch: lengths include 0 and 1; groups of sizes 1, 2, 3, 4 and an equal-reward group."""
    rng = random.Random(seed)
    group_sizes = [3, 1, 4, 2, 3]
    index, lengths = [], []
    for g, size in enumerate(group_sizes):
        index += [f"uid-{g}"] * size
    rng.shuffle(index)  # groups need not be contiguous
    B = len(index)
    lengths = [rng.randint(2, T) for _ in range(B)]
    lengths[index.index("uid-1")] = 1  # the single-sample group has a length-1 response
    lengths[next(i for i, u in enumerate(index) if u not in ("uid-1", "uid-4"))] = 0  # an all-masked row
    mask = torch.zeros(B, T)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    g = torch.Generator().manual_seed(seed)
    # Outcome reward on the last valid token, plus small dense rewards (exercise token-level sums).
    rewards = torch.randn(B, T, generator=g) * 0.1 * mask
    for i, n in enumerate(lengths):
        if n:
            rewards[i, n - 1] += rng.choice([0.0, 1.0, 0.5, -1.0])
    # Every member of group "uid-4" scores exactly the same total: 0.3 on its last token only.
    for i, uid in enumerate(index):
        if uid == "uid-4":
            rewards[i] = 0.0
            rewards[i, lengths[i] - 1] = 0.3
    values = torch.randn(B, T, generator=g) * mask
    baselines = torch.randn(B, generator=g)
    return rewards, mask, values, index, baselines, lengths


def row_scores(rewards, lengths):
    return [float(sum(rewards[i, :n].double().tolist())) for i, n in enumerate(lengths)]


def naive_whiten(rows: list[list[float]]) -> list[list[float]]:
    flat = [x for row in rows for x in row]
    n = len(flat)
    mean = sum(flat) / n
    var = sum((x - mean) ** 2 for x in flat) / n * n / (n - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def to_grid(rows: list[list[float]], T: int) -> torch.Tensor:
    out = torch.zeros(len(rows), T, dtype=torch.float64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    return out


def naive_group_stats(scores, index):
    groups: dict = {}
    for s, uid in zip(scores, index, strict=True):
        groups.setdefault(uid, []).append(s)
    stats = {}
    for uid, xs in groups.items():
        n = len(xs)
        if n == 1:
            stats[uid] = (1, 0.0, 1.0)
        else:
            m = sum(xs) / n
            stats[uid] = (n, m, math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)))
    return stats, groups


def naive_gae(rewards, values, mask, gamma, lam):
    """Textbook backward recursion on each row's valid positions (masked positions are skipped)."""
    rows_adv, rows_ret = [], []
    for i in range(rewards.shape[0]):
        pos = [t for t in range(rewards.shape[1]) if mask[i, t] > 0]
        r = [float(rewards[i, t]) for t in pos]
        v = [float(values[i, t]) for t in pos]
        adv, next_adv, next_v = [0.0] * len(pos), 0.0, 0.0
        for k in reversed(range(len(pos))):
            delta = r[k] + gamma * next_v - v[k]
            next_adv = delta + gamma * lam * next_adv
            adv[k], next_v = next_adv, v[k]
        rows_adv.append(adv)
        rows_ret.append([a + b for a, b in zip(adv, v, strict=True)])
    return rows_adv, rows_ret, [[t for t in range(rewards.shape[1]) if mask[i, t] > 0] for i in range(len(rows_adv))]


def scatter(rows, positions, shape):
    out = torch.zeros(shape, dtype=torch.float64)
    for i, (row, pos) in enumerate(zip(rows, positions, strict=True)):
        for x, t in zip(row, pos, strict=True):
            out[i, t] = x
    return out


def assert_close(actual, expected, atol=2e-5):
    assert not torch.isnan(actual).any()
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)])
def test_gae_matches_textbook_recursion(seed, gamma, lam):
    rewards, mask, values, *_ = make_batch(seed)
    adv, ret = get_adv_estimator("gae")(
        token_level_rewards=rewards, values=values, response_mask=mask, gamma=gamma, lam=lam
    )
    raw, returns, pos = naive_gae(rewards, values, mask, gamma, lam)
    assert_close(ret, scatter(returns, pos, mask.shape))
    assert_close(adv, scatter(naive_whiten(raw), pos, mask.shape))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the recursion's host round trip")
def test_gae_on_gpu_tensors_returns_gpu_tensors_equal_to_the_reference():
    """compute_gae runs its recursion on the host; GPU inputs come back on the GPU with the reference's values."""
    rewards, mask, values, *_ = make_batch(0)
    adv, ret = get_adv_estimator("gae")(token_level_rewards=rewards.cuda(), values=values.cuda(),
                                        response_mask=mask.cuda(), gamma=0.9, lam=0.95)
    assert adv.is_cuda and ret.is_cuda
    raw, returns, pos = naive_gae(rewards, values, mask, 0.9, 0.95)
    assert_close(ret.cpu(), scatter(returns, pos, mask.shape))
    assert_close(adv.cpu(), scatter(naive_whiten(raw), pos, mask.shape))


def torch_gae_recursion(rewards, values, valid, gamma, lam):
    """The torch loop compute_gae ran before its numpy one: (B,)-vector fp32 ops per step, masked steps skipped."""
    next_value, next_adv, adv = torch.zeros(rewards.shape[0]), torch.zeros(rewards.shape[0]), torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        adv_t = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_adv = torch.where(valid[:, t], adv_t, next_adv)
        adv[:, t] = next_adv
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.7)])
def test_gae_numpy_recursion_equals_the_torch_loop_bit_for_bit(gamma, lam):
    """The numpy recursion gives the torch loop's fp32 bits on a 64 x 300 batch with 10% masked holes and random
    lengths, so the step's speed-up changes no number. Mutations: a float64 gamma * lam (np.float64 in place of
    np.float32) and `adv[t] = adv_t` (the masked steps' own TD values) each fail it."""
    g = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(64, 300, generator=g), torch.randn(64, 300, generator=g)
    valid = torch.rand(64, 300, generator=g) > 0.1
    valid &= torch.arange(300) < torch.randint(1, 301, (64, 1), generator=g)
    ours = _gae_recursion(rewards.numpy(), values.numpy(), valid.numpy(), gamma, lam)
    assert ours.dtype == np.float32
    assert np.array_equal(ours, torch_gae_recursion(rewards, values, valid, gamma, lam).numpy())


def test_gae_skips_masked_holes_inside_a_response():
    """Tool-output tokens inside a response are masked: the recursion jumps over them."""
    rewards = torch.tensor([[0.1, 9.0, 9.0, 0.2, 1.0, 0.0]])
    values = torch.tensor([[0.5, 7.0, 7.0, 0.3, 0.4, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    _, ret = get_adv_estimator("gae")(
        token_level_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.8
    )
    raw, returns, pos = naive_gae(rewards, values, mask, 0.9, 0.8)
    assert_close(ret, scatter(returns, pos, mask.shape))
    assert ret[0, 1] == 0 and ret[0, 2] == 0 and ret[0, 5] == 0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_naive_loop(seed, norm):
    rewards, mask, _, index, _, lengths = make_batch(seed)
    adv, ret = get_adv_estimator("grpo")(
        token_level_rewards=rewards, response_mask=mask, index=index, norm_adv_by_std_in_grpo=norm
    )
    stats, _ = naive_group_stats(row_scores(rewards, lengths), index)
    expected = []
    for s, uid in zip(row_scores(rewards, lengths), index, strict=True):
        _, m, sd = stats[uid]
        expected.append((s - m) / (sd + 1e-6) if norm else s - m)
    exp_grid = torch.tensor(expected, dtype=torch.float64)[:, None] * mask.double()
    assert_close(adv, exp_grid)
    assert torch.equal(adv, ret)
    assert all(torch.all(adv[i] == 0) for i, uid in enumerate(index) if uid == "uid-4")  # equal rewards


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_rloo_matches_leave_one_out_loop(seed):
    rewards, mask, _, index, _, lengths = make_batch(seed)
    adv, ret = get_adv_estimator("rloo")(token_level_rewards=rewards, response_mask=mask, index=index)
    scores = row_scores(rewards, lengths)
    expected = []
    for i, (s, uid) in enumerate(zip(scores, index, strict=True)):
        others = [scores[j] for j in range(len(scores)) if index[j] == uid and j != i]
        expected.append(s - sum(others) / len(others) if others else s)
    assert_close(adv, torch.tensor(expected, dtype=torch.float64)[:, None] * mask.double())
    assert torch.equal(adv, ret)
    assert all(torch.all(adv[i] == 0) for i, uid in enumerate(index) if uid == "uid-4")


@pytest.mark.parametrize("seed", [0, 1])
def test_remax_matches_reward_to_go_minus_greedy_baseline(seed):
    rewards, mask, _, _, baselines, lengths = make_batch(seed)
    adv, ret = get_adv_estimator("remax")(token_level_rewards=rewards, response_mask=mask, reward_baselines=baselines)
    exp_ret = torch.zeros_like(mask, dtype=torch.float64)
    for i, n in enumerate(lengths):
        for t in range(n):
            exp_ret[i, t] = sum(float(rewards[i, k]) for k in range(t, n))
    assert_close(ret, exp_ret)
    assert_close(adv, exp_ret - baselines.double()[:, None] * mask.double())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_discounted_whitened_returns(seed, gamma):
    rewards, mask, _, _, _, lengths = make_batch(seed)
    adv, ret = get_adv_estimator("reinforce_plus_plus")(token_level_rewards=rewards, response_mask=mask, gamma=gamma)
    rows = []
    for i, n in enumerate(lengths):
        row, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            running = float(rewards[i, t]) + gamma * running
            row[t] = running
        rows.append(row)
    assert_close(ret, to_grid(rows, mask.shape[1]))
    assert_close(adv, to_grid(naive_whiten(rows), mask.shape[1]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_plus_plus_baseline_matches_naive_loop(seed):
    rewards, mask, _, index, _, lengths = make_batch(seed)
    adv, ret = get_adv_estimator("reinforce_plus_plus_baseline")(
        token_level_rewards=rewards, response_mask=mask, index=index
    )
    scores = row_scores(rewards, lengths)
    stats, _ = naive_group_stats(scores, index)
    rows = [[s - stats[uid][1]] * n for s, uid, n in zip(scores, index, lengths, strict=True)]
    assert_close(adv, to_grid(naive_whiten(rows), mask.shape[1]))
    assert torch.equal(adv, ret)


def test_equal_rewards_everywhere_give_zero_advantage_without_nan():
    B, T = 6, 4
    rewards = torch.zeros(B, T)
    rewards[:, 2] = 0.1  # 0.1 is not exact in binary: the group mean must still equal every member
    mask = torch.ones(B, T)
    index = [0, 0, 0, 1, 1, 1]
    for name in ["grpo", "rloo", "reinforce_plus_plus_baseline"]:
        adv, _ = get_adv_estimator(name)(token_level_rewards=rewards, response_mask=mask, index=index)
        assert torch.all(adv == 0), name


def test_length_one_batch_and_all_masked_batch_are_finite():
    rewards = torch.tensor([[1.0], [0.0]])
    values = torch.tensor([[0.2], [0.0]])
    for mask in (torch.tensor([[1.0], [0.0]]), torch.zeros(2, 1)):
        for name in ESTIMATORS:
            adv, ret = get_adv_estimator(name)(
                token_level_rewards=rewards * mask, response_mask=mask, values=values, index=[0, 1],
                reward_baselines=torch.zeros(2), gamma=1.0, lam=1.0,
            )
            assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
            assert torch.all(adv[mask == 0] == 0), name


def test_estimators_accept_a_uniform_keyword_set():
    rewards, mask, values, index, baselines, _ = make_batch(5)
    kwargs = dict(
        token_level_rewards=rewards, response_mask=mask, values=values, index=index, gamma=1.0, lam=0.95,
        norm_adv_by_std_in_grpo=True, reward_baselines=baselines, something_new=123,
    )
    assert set(ESTIMATORS) <= set(list_adv_estimators())
    for name in ESTIMATORS:
        adv, ret = get_adv_estimator(name)(**kwargs)
        assert adv.shape == ret.shape == mask.shape and adv.dtype == torch.float32


def test_missing_inputs_and_unknown_names_raise_actionable_errors():
    rewards, mask, *_ = make_batch(0)
    with pytest.raises(ValueError, match="values"):
        get_adv_estimator("gae")(token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="index"):
        get_adv_estimator("grpo")(token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="reward_baselines"):
        get_adv_estimator("remax")(token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="known: .*grpo"):
        get_adv_estimator("grp0")


def test_register_custom_estimator_and_refuse_silent_overwrite():
    @register_adv_estimator("test_constant_one")
    def constant_one(*, token_level_rewards, response_mask, **_):
        return response_mask.float(), response_mask.float()

    adv, _ = get_adv_estimator("test_constant_one")(token_level_rewards=None, response_mask=torch.ones(1, 2), gamma=1)
    assert torch.equal(adv, torch.ones(1, 2))
    with pytest.raises(ValueError, match="already registered"):
        register_adv_estimator("grpo")(constant_one)


def test_group_ids_accept_tensors_arrays_and_strings():
    import numpy as np

    ids, n = group_ids(np.array(["a", "b", "a"], dtype=object), 3)
    assert ids.tolist() == [0, 1, 0] and n == 2
    ids, n = group_ids(torch.tensor([7, 7, 3]), 3)
    assert ids.tolist() == [0, 0, 1] and n == 2
    with pytest.raises(ValueError, match="3 rows"):
        group_ids([1, 2], 3)
