"""Chunk-level GAE over training rows (PPO with a value head, `algorithm.adv_estimator=gae`).

A trajectory's rows t = 0..T-1 (its chunk steps up to the first done, :mod:`rlhf_mcore.vla.rows`) are its decision
steps: one action chunk each, as RLinf's and SimpleVLA-RL-style PPO treat them. With V_t the critic's value of row t
(the value of its observation: the critic's output at the position predicting the chunk's first action token) and
r_t the row's reward (the env's rewards of the chunk's steps that ran, summed: with ReachPush 1.0 on the row where
the episode succeeds, else 0):

    delta_t = r_t + gamma * V_{t+1} * [t + 1 < T] - V_t,    A_t = delta_t + gamma * lam * A_{t+1},    R_t = A_t + V_t

The last row bootstraps with 0, whether the episode terminated or was truncated at `vla.max_steps`: rows stop at the
first done, so the observation after a truncation is never rendered or valued (truncation counts as terminal; with
ReachPush a truncated episode failed, so its return is 0 either way). The steps inside a chunk are not discounted
against each other (one decision, one reward sum).

This is :func:`rlhf_mcore.algos.advantages.compute_gae` on a (trajectories, chunk steps) grid: the same recursion and
the same whitening of the advantages over the batch (here over rows, each row one decision; the text trainer's
grid is tokens). The trainer puts A_t on every action token of row t and R_t as the value target on each of them.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["chunk_gae"]


def chunk_gae(values: Any, rewards: Any, traj: Any, chunk: Any, *, gamma: float, lam: float):
    """(advantages (N,), returns (N,)) float32 tensors of N rows; `values`, `rewards` (N,) tensors, `traj`, `chunk`
    (N,) ints: each row's trajectory and chunk step (a trajectory's steps must be 0..T-1, in any order). Advantages
    whitened over the N rows, returns not (module docstring)."""
    import torch

    from rlhf_mcore.algos.advantages import compute_gae

    traj, chunk = np.asarray(traj, np.int64), np.asarray(chunk, np.int64)
    n = len(traj)
    if not (len(chunk) == len(values) == len(rewards) == n):
        raise ValueError(f"chunk_gae: {n} trajectory ids, {len(chunk)} chunk steps, {len(values)} values and "
                         f"{len(rewards)} rewards; one of each per row")
    ids, row_of = np.unique(traj, return_inverse=True)  # (B,), (N,)
    steps = np.bincount(row_of, minlength=len(ids))  # (B,) rows per trajectory
    grid = np.full((len(ids), int(steps.max(initial=0))), -1, np.int64)  # (B, T) row index, -1: past the end
    if chunk.min(initial=0) < 0 or (chunk >= steps[row_of]).any():
        raise ValueError("chunk_gae: a trajectory's chunk steps must be 0..T-1 (the rows up to its first done)")
    grid[row_of, chunk] = np.arange(n)
    if (grid[np.arange(grid.shape[1])[None] < steps[:, None]] < 0).any():
        raise ValueError("chunk_gae: a trajectory's chunk steps must be 0..T-1 with each step once")
    valid = torch.as_tensor(grid >= 0)  # (B, T)
    where = torch.as_tensor(np.where(grid >= 0, grid, 0))  # (B, T)
    v = torch.as_tensor(values, dtype=torch.float32)[where] * valid  # (B, T)
    r = torch.as_tensor(rewards, dtype=torch.float32)[where] * valid  # (B, T)
    adv, ret = compute_gae(token_level_rewards=r, response_mask=valid.float(), values=v, gamma=gamma, lam=lam)
    out_adv, out_ret = torch.empty(n), torch.empty(n)
    out_adv[where[valid]], out_ret[where[valid]] = adv[valid], ret[valid]
    return out_adv, out_ret
