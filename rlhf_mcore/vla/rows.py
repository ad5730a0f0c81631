"""Rollouts -> training rows: one row per (trajectory, chunk step) up to the episode's first done, and GRPO groups.

Each row is what the policy saw and did at one chunk step: its own image and state, the trajectory's instruction,
the policy's outputs (the C*A action token ids, their log-probs, ...), and over those C*A response tokens:

- `response_mask` (C*A,): 1 on the tokens of the action steps the env actually ran, i.e. every step up to and
  including the episode's first done step (terminated or truncated); 0 on the steps after it inside that chunk.
  Chunk steps after the first done are not rows at all.
- `token_rewards` (C*A,): the env's reward of step c on the last token of that step (token `c*A + A-1`), 0
  elsewhere, only where the mask is 1: the per-step rewards a PPO value head bootstraps along the trajectory.

GRPO on success scores whole trajectories, not rows: `traj_score` (the sum of a trajectory's rewards up to its
first done: 1 for a success, 0 otherwise with the built-in task) is repeated on each of its rows, with `traj` (the
trajectory's index) and `group` (its initial state's group, :func:`repeat_for_groups`), so the trainer normalises
the B trajectory scores within groups and broadcasts the advantage to rows as `adv_traj[rows.traj]` (normalising
over rows would weight long trajectories more).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rlhf_mcore.vla.rollout import Rollout

__all__ = ["VLARows", "flatten_rollout", "repeat_for_groups", "first_done_step"]


def repeat_for_groups(state_ids: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Each initial state `n` times in a row (`rollout.n` samples of one state for a GRPO group):
    returns `(state_ids (len*n,), group (len*n,))`, group = the state's position in `state_ids` (a state drawn
    twice in one step makes two groups)."""
    ids = np.asarray(state_ids, np.int64)
    if ids.ndim != 1 or n < 1:
        raise ValueError(f"repeat_for_groups: state_ids must be 1-D and n >= 1 (got shape {ids.shape}, n={n})")
    return np.repeat(ids, n), np.repeat(np.arange(len(ids)), n)


def first_done_step(ro: Rollout) -> np.ndarray:
    """(B,) the flat step index (t*C + c) of each episode's first done; T*C when it never ended."""
    done = (ro.terminated | ro.truncated).reshape(len(ro.state_ids), -1)  # (B, T*C)
    return np.where(done.any(1), done.argmax(1), done.shape[1])


@dataclass
class VLARows:
    traj: np.ndarray  # (N,) trajectory index into the rollout
    chunk: np.ndarray  # (N,) chunk step within the trajectory
    group: np.ndarray  # (N,) GRPO group of the trajectory
    state_id: np.ndarray  # (N,)
    instruction: list[str]  # (N,)
    image: np.ndarray  # (N, H, W, 3)
    state: np.ndarray  # (N, S)
    outputs: dict[str, np.ndarray]  # (N, ...) per key, as the policy returned them
    response_mask: np.ndarray  # (N, C*A) int64
    token_rewards: np.ndarray  # (N, C*A) float32
    traj_score: np.ndarray  # (N,) float32

    def __len__(self) -> int:
        return len(self.traj)


def flatten_rollout(ro: Rollout, group: Any = None) -> VLARows:
    """The rows of `ro` (module docstring). `group` (B,): each trajectory's group (default: its own)."""
    b, t_steps, c = ro.reward.shape
    a = ro.outputs["actions"].shape[-1]
    group = np.arange(b) if group is None else np.asarray(group)
    if group.shape != (b,):
        raise ValueError(f"flatten_rollout: group shaped {group.shape}, expected ({b},)")
    first = first_done_step(ro)  # (B,)
    step = np.arange(t_steps * c).reshape(t_steps, c)  # (T, C) flat step index
    step_valid = step[None] <= first[:, None, None]  # (B, T, C): ran, up to and including the first done
    row_valid = step_valid[:, :, 0]  # (B, T): the chunk's first step ran
    traj, chunk = np.nonzero(row_valid)  # (N,) each, trajectory-major
    mask = np.repeat(step_valid[traj, chunk], a, axis=1).astype(np.int64)  # (N, C*A)
    rewards = np.zeros((len(traj), c, a), np.float32)
    rewards[:, :, -1] = np.where(step_valid[traj, chunk], ro.reward[traj, chunk], 0.0)
    score = np.where(step_valid, ro.reward, 0.0).reshape(b, -1).sum(1).astype(np.float32)  # (B,)
    return VLARows(traj=traj, chunk=chunk, group=group[traj], state_id=ro.state_ids[traj],
                   instruction=[ro.instructions[i] for i in traj], image=ro.images[traj, chunk],
                   state=ro.states[traj, chunk], outputs={k: v[traj, chunk] for k, v in ro.outputs.items()},
                   response_mask=mask, token_rewards=rewards.reshape(len(traj), c * a), traj_score=score[traj])
