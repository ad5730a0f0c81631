"""The vectorized chunk interface every VLA environment speaks, and the one implementation of its done rules.

    obs = env.reset(state_ids)                 # state_ids (B,) int: which initial state each env starts from
    res = env.chunk_step(actions)              # actions (B, C, A) float: C steps, open loop
    res.obs, res.reward (B, C), res.terminated (B, C), res.truncated (B, C), res.info

`obs` is a dict: `image` (B, H, W, 3) uint8, `state` (B, S) float32 (proprioception), `instruction` (list of B
strings). One episode per env per reset, no automatic reset: once an env is done (terminated: the task succeeded
or failed for good; truncated: out of time) it ignores further actions, its reward is 0 and both flags stay as they
were at its last step (sticky), so `terminated | truncated` is monotone along the chunk and across chunks, and the
first done step of an episode is where that turns True. The same `(seed, state_id)` always gives the same initial
state, whichever env slot or worker process runs it.

A *batch env* (a class with `num_envs`, `spec`, `reset`, `chunk_step`, `close`) implements this in one process;
:class:`rlhf_mcore.vla.envs.subproc.SubprocVectorEnv` runs batch envs in worker processes behind the same
interface, plus `chunk_step_async` / `chunk_step_wait` (the rollout overlaps them with the policy) and
`last_step_s` (the seconds the last chunk step took in the workers).
:func:`step_chunk` runs a chunk from a per-step function with the rules above, for every env that has one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

__all__ = ["EnvSpec", "ChunkResult", "step_chunk", "check_actions", "check_state_ids"]


@dataclass(frozen=True)
class EnvSpec:
    """What one env's observations and actions look like (the shared-memory layout of the workers)."""

    image_shape: tuple[int, int, int]  # (H, W, 3), uint8
    state_dim: int  # proprioception, float32
    action_dim: int
    max_steps: int  # an episode is truncated after this many steps


@dataclass
class ChunkResult:
    obs: dict  # as reset's: after the chunk's last step (a done env's: its last one)
    reward: np.ndarray  # (B, C) float32
    terminated: np.ndarray  # (B, C) bool, sticky
    truncated: np.ndarray  # (B, C) bool, sticky
    info: dict = field(default_factory=dict)  # arrays (B, ...) per key; `success` (B,) bool at least


def check_actions(actions: Any, num_envs: int, action_dim: int) -> np.ndarray:
    a = np.asarray(actions, dtype=np.float32)
    if a.ndim != 3 or a.shape[0] != num_envs or a.shape[2] != action_dim or a.shape[1] < 1:
        raise ValueError(f"chunk_step: actions shaped {a.shape}, expected (num_envs={num_envs}, C >= 1, "
                         f"action_dim={action_dim})")
    if not np.isfinite(a).all():
        raise ValueError("chunk_step: actions contain NaN or inf")
    return a


def check_state_ids(state_ids: Any, num_envs: int) -> np.ndarray:
    ids = np.asarray(state_ids)
    if ids.shape != (num_envs,) or not np.issubdtype(ids.dtype, np.integer) or (ids < 0).any():
        raise ValueError(f"reset: state_ids must be {num_envs} non-negative integers (one per env), got "
                         f"{ids.dtype} shaped {ids.shape}")
    return ids.astype(np.int64)


def step_chunk(step: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]], actions: np.ndarray,
               terminated: np.ndarray, truncated: np.ndarray, steps: np.ndarray, max_steps: int):
    """Run C steps of B envs with the done rules of the module docstring.

    `step(a (B, A), live (B,) bool) -> (reward (B,), terminated (B,))` advances the live envs only (the others
    must not change). `terminated`, `truncated` (B,) bool and `steps` (B,) int (steps taken this episode) are the
    env's running state, updated in place. Returns `(reward (B, C), terminated (B, C), truncated (B, C))`."""
    num_envs, chunk = actions.shape[:2]
    reward = np.zeros((num_envs, chunk), np.float32)
    term = np.zeros((num_envs, chunk), bool)
    trunc = np.zeros((num_envs, chunk), bool)
    for c in range(chunk):
        live = ~(terminated | truncated)
        if live.any():
            r, t = step(actions[:, c], live)
            reward[live, c] = np.asarray(r, np.float32)[live]
            terminated |= live & np.asarray(t, bool)
            steps += live
            truncated |= live & ~terminated & (steps >= max_steps)
        term[:, c], trunc[:, c] = terminated, truncated
    return reward, term, trunc


class SteppedEnv:
    """`chunk_step` for a batch env that steps one action at a time: a subclass keeps `num_envs`, `spec`, the running
    `terminated` / `truncated` / `steps` arrays and `_obs()`, and defines `_step(a (B, A), live) -> (reward,
    terminated)` (the contract of `step_chunk`); `action_dtype` (None: as given) is the dtype its `_step` takes."""

    action_dtype: Any = None

    def chunk_step(self, actions: Any) -> ChunkResult:
        a = check_actions(actions, self.num_envs, self.spec.action_dim)
        if self.action_dtype is not None:
            a = a.astype(self.action_dtype)
        reward, term, trunc = step_chunk(self._step, a, self.terminated, self.truncated, self.steps,
                                         self.spec.max_steps)
        return ChunkResult(self._obs(), reward, term, trunc, {"success": self.terminated.copy(),
                                                               "episode_steps": self.steps.copy()})
