"""One rollout of a chunk policy over vectorized envs, with the two-stage overlap.

    ro = rollout([env_a, env_b], policy, state_ids)           # env_a takes state_ids[:B_a], env_b the rest
    ro.images (B, T, H, W, 3), ro.outputs["actions"] (B, T, C, A), ro.reward (B, T, C), ...

`policy(obs, rows, chunk) -> dict` gets one stage's observations (`image` (b, H, W, 3), `state`, `instruction`),
the rows of the whole batch they are (`rows` (b,) int: key any per-sample randomness on them) and the chunk index;
it returns `actions` (b, C, A) float and whatever else the trainer keeps per chunk step (token ids, log-probs), each
(b, ...) and stored as (B, T, ...).

The envs are split into stages (one or two vector envs). With `overlap=True` the policy generates for one stage
while the other stage's workers step: the calls run in the order

    policy(A, 0)  send(A)  policy(B, 0)  send(B)  wait(A)  policy(A, 1)  send(A)  wait(B)  policy(B, 1) ...

so each stage's env step hides behind the other stage's generation (a stage cannot overlap with itself: with one
stage nothing overlaps). `overlap=False` waits right after each send. The policy is called on the same stage batches
in the same order either way, so both give the same rollout (tests/test_vla_envs.py checks it bit for bit). A stage
whose envs are all done is not generated for or stepped again; the rollout ends when every stage is done or after
`max_chunks` chunk steps. Steps a stage did not run (it finished early) are padded: zero images and outputs, zero
reward and the stage's last (sticky) done flags, so they are never rows (rlhf_mcore.vla.rows).

Envs with `chunk_step_async` / `chunk_step_wait` (:class:`rlhf_mcore.vla.envs.subproc.SubprocVectorEnv`) overlap;
a batch env in this process steps inside `send`, so it runs but never overlaps.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

__all__ = ["Rollout", "rollout"]


@dataclass
class Rollout:
    state_ids: np.ndarray  # (B,)
    instructions: list[str]  # (B,)
    images: np.ndarray  # (B, T, H, W, 3) uint8: the observation each chunk step was generated from
    states: np.ndarray  # (B, T, S) float32
    outputs: dict[str, np.ndarray]  # (B, T, ...) per key; "actions" (B, T, C, A)
    reward: np.ndarray  # (B, T, C) float32
    terminated: np.ndarray  # (B, T, C) bool, sticky
    truncated: np.ndarray  # (B, T, C) bool, sticky
    success: np.ndarray  # (B,) bool: the env's `success` at the episode's end
    # policy_s: in the policy; env_s: the envs stepping (per stage and chunk, the slowest worker); env_wait_s: the
    # rollout blocked on the envs (what the overlap did not hide); env_steps: env steps run; chunk_steps; wall_s
    stats: dict = field(default_factory=dict)

    @property
    def episode_length(self) -> np.ndarray:
        """(B,) env steps to the first done, inclusive (all steps run when never done)."""
        done = (self.terminated | self.truncated).reshape(len(self.state_ids), -1)  # (B, T*C)
        return np.where(done.any(1), done.argmax(1) + 1, done.shape[1])


def _send(env, actions):
    """None for an env stepping in the background; else (an in-process batch env: it steps now) the result and
    its seconds."""
    if hasattr(env, "chunk_step_async"):
        env.chunk_step_async(actions)
        return None
    start = time.perf_counter()
    res = env.chunk_step(actions)
    return res, time.perf_counter() - start


def _wait(env, stepped):
    """(result, seconds the env spent stepping)."""
    if stepped is None:
        return env.chunk_step_wait(), env.last_step_s
    return stepped


def rollout(stages: Sequence[Any], policy: Callable[[dict, np.ndarray, int], dict], state_ids: Any, *,
            overlap: bool = True, max_chunks: Optional[int] = None) -> Rollout:
    """See the module docstring. `stages`: one or more vector envs; `state_ids` (sum of their num_envs,)."""
    state_ids = np.asarray(state_ids, np.int64)
    bounds = np.cumsum([0] + [env.num_envs for env in stages])
    if bounds[-1] != len(state_ids):
        raise ValueError(f"rollout: {len(state_ids)} state ids for stages of {bounds[-1]} envs in all")
    rows = [np.arange(bounds[s], bounds[s + 1]) for s in range(len(stages))]
    start = time.perf_counter()
    policy_s = env_s = env_wait_s = 0.0
    obs = [env.reset(state_ids[r]) for env, r in zip(stages, rows)]
    instructions = [text for o in obs for text in o["instruction"]]
    recs: list[list[dict]] = [[] for _ in stages]  # per stage, per chunk step
    done = [False] * len(stages)
    in_flight: deque = deque()  # (stage, what _send returned)
    env_steps = 0

    def finish(s: int, stepped) -> None:
        nonlocal env_s, env_wait_s, env_steps
        t0 = time.perf_counter()
        res, seconds = _wait(stages[s], stepped)
        env_wait_s += time.perf_counter() - t0
        env_s += seconds
        rec = recs[s][-1]
        prev = rec["prev_done"]  # (b,) done before this chunk
        now = res.terminated | res.truncated  # (b, C)
        env_steps += int((~np.concatenate([prev[:, None], now[:, :-1]], axis=1)).sum())
        rec.update(reward=res.reward, terminated=res.terminated, truncated=res.truncated,
                   success=np.asarray(res.info["success"], bool))
        obs[s] = res.obs
        done[s] = bool(now[:, -1].all())

    t = 0
    while not all(done) and (max_chunks is None or t < max_chunks):
        for s in range(len(stages)):
            while any(q == s for q, _ in in_flight):  # its previous step must be back (round robin: the oldest)
                finish(*in_flight.popleft())
            if done[s]:
                continue
            prev_done = (recs[s][-1]["terminated"][:, -1] | recs[s][-1]["truncated"][:, -1]) if recs[s] else \
                np.zeros(len(rows[s]), bool)
            t0 = time.perf_counter()
            out = policy(obs[s], rows[s], t)
            policy_s += time.perf_counter() - t0
            actions = np.asarray(out["actions"], np.float32)
            if actions.ndim != 3 or actions.shape[0] != len(rows[s]):
                raise ValueError(f"rollout: the policy returned actions shaped {actions.shape} for {len(rows[s])} "
                                 "envs; expected (b, C, A)")
            recs[s].append({"image": obs[s]["image"], "state": obs[s]["state"], "prev_done": prev_done,
                            "outputs": {k: np.asarray(v) for k, v in out.items()}})
            in_flight.append((s, _send(stages[s], actions)))
            if not overlap:
                finish(*in_flight.popleft())
        t += 1
    while in_flight:
        finish(*in_flight.popleft())
    return _assemble(state_ids, instructions, recs, rows, {
        "policy_s": policy_s, "env_s": env_s, "env_wait_s": env_wait_s, "env_steps": env_steps,
        "chunk_steps": max(len(r) for r in recs),
        "wall_s": time.perf_counter() - start})


def _assemble(state_ids, instructions, recs, rows, stats) -> Rollout:
    num_steps = max(len(r) for r in recs)
    first = next(r[0] for r in recs if r)
    b = len(state_ids)

    def empty(x, dtype=None):
        x = np.asarray(x)
        return np.zeros((b, num_steps, *x.shape[1:]), dtype or x.dtype)

    images, states = empty(first["image"]), empty(first["state"])
    outputs = {k: empty(v) for k, v in first["outputs"].items()}
    reward = empty(first["reward"])
    terminated, truncated = empty(first["terminated"]), empty(first["truncated"])
    success = np.zeros(b, bool)
    for s, stage in enumerate(recs):
        r = rows[s]
        for t, rec in enumerate(stage):
            images[r, t], states[r, t], reward[r, t] = rec["image"], rec["state"], rec["reward"]
            terminated[r, t], truncated[r, t] = rec["terminated"], rec["truncated"]
            for k, v in rec["outputs"].items():
                outputs[k][r, t] = v
        if stage:  # padding after the stage ended: sticky flags, nothing else
            terminated[r, len(stage):] = stage[-1]["terminated"][:, None, -1:]
            truncated[r, len(stage):] = stage[-1]["truncated"][:, None, -1:]
            success[r] = stage[-1]["success"]
    return Rollout(state_ids, instructions, images, states, outputs, reward, terminated, truncated, success, stats)
