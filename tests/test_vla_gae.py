"""Chunk-level GAE over VLA training rows (rlhf_mcore/vla/gae.py) against a plain per-episode loop. In-process, well
under a second."""
import numpy as np
import pytest
import torch

from rlhf_mcore.vla.gae import chunk_gae


def naive_gae(values, rewards, gamma, lam):
    """One episode's rows 0..T-1 backwards: the last row bootstraps with 0."""
    T = len(values)
    adv, nxt_v, nxt_a = [0.0] * T, 0.0, 0.0
    for t in reversed(range(T)):
        delta = rewards[t] + gamma * (nxt_v if t + 1 < T else 0.0) - values[t]
        adv[t] = nxt_a = delta + gamma * lam * (nxt_a if t + 1 < T else 0.0)
        nxt_v = values[t]
    return adv


def test_chunk_gae_against_a_naive_per_episode_loop():
    """Six episodes of 1 to 7 rows, successes (reward on the last row) and failures, rows shuffled across episodes,
    gamma=0.9, lam=0.8: returns = A + V of the naive loop (not whitened), advantages = A whitened over all rows
    (unbiased variance, as compute_gae). Mutations in chunk_gae (each run once, each fails here): rows placed on the
    grid in arrival order, the chunk index ignored -> 19/22 returns differ; lam=gamma passed to compute_gae -> 16/22
    differ; the rewards rolled one row back on the grid -> 14/22 differ."""
    rng = np.random.default_rng(0)
    lengths, success = [3, 1, 7, 4, 2, 5], [1, 0, 1, 0, 1, 0]
    traj = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
    chunk = np.concatenate([np.arange(n) for n in lengths])
    values = rng.normal(0.3, 0.4, len(traj)).astype(np.float32)
    rewards = np.zeros(len(traj), np.float32)
    for i in range(len(lengths)):
        rewards[np.flatnonzero(traj == i)[-1]] = success[i]
    rewards[np.flatnonzero(traj == 3)[1]] = 0.25  # a reward inside an episode too
    order = rng.permutation(len(traj))  # rows in any order
    gamma, lam = 0.9, 0.8

    adv, ret = chunk_gae(torch.as_tensor(values[order]), torch.as_tensor(rewards[order]), traj[order], chunk[order],
                         gamma=gamma, lam=lam)
    raw = np.zeros(len(traj))
    for i in range(len(lengths)):
        rows = np.flatnonzero(traj == i)  # in chunk order
        raw[rows] = naive_gae(values[rows].tolist(), rewards[rows].tolist(), gamma, lam)
    raw = raw[order]
    np.testing.assert_allclose(ret.numpy(), raw + values[order], atol=1e-6)
    want = (raw - raw.mean()) / np.sqrt(raw.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(adv.numpy(), want, atol=1e-5)
    # the one-row failed episode: its advantage is -V before whitening, its return 0
    one = np.flatnonzero(traj[order] == 1)[0]
    assert abs(ret[one].item()) < 1e-6


def test_chunk_gae_refuses_rows_that_are_not_whole_trajectories():
    """A trajectory missing a chunk step (a filtered row) would chain across the gap silently."""
    v = torch.zeros(3)
    with pytest.raises(ValueError, match="0..T-1"):
        chunk_gae(v, v, np.array([0, 0, 0]), np.array([0, 1, 3]), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="each step once"):
        chunk_gae(v, v, np.array([0, 0, 0]), np.array([0, 1, 1]), gamma=1.0, lam=1.0)
