"""The built-in task: reach for or push a coloured block on a 2D table, seen as a small RGB image.

A cheap stand-in for a manipulation benchmark that a tiny policy can learn on two CPU cores. The table is the unit
square (x to the right, y up); a white disc (the pusher, radius 0.06) moves by `speed * clip(action, -1, 1)` a step
(A = 2: dx, dy); blocks are coloured discs (radius 0.08), red, green and blue by default, placed at random in the
middle of the table. Contacts are resolved kinematically: the pusher shoves a block it overlaps out along the line
between their centres, a block clamped at the table's edge pushes the pusher back, and overlapping blocks are moved
apart. The instruction names the goal:

- "reach the red block": succeed when the pusher's edge is within 0.02 of the block's;
- "push the red block to the left" (right, top, bottom): succeed when the block's centre is within 0.15 of that
  edge of the table.

The reward is task success: 1.0 at the step it first happens (the env then terminates), else 0; an episode is
truncated after `max_steps` steps. Observations: `image` (H, W, 3) uint8 rendered with numpy (dark table, coloured
blocks, the pusher drawn last), `state` = the pusher's (x, y) as float32, and the instruction. Initial states and
tasks come from `np.random.default_rng([seed, state_id])`: one state id is one scene whichever env slot or process
runs it, and disjoint id ranges give disjoint training and held-out sets (:func:`held_out_state_ids`).

:meth:`ReachPush.expert_chunk` is a scripted expert (go behind the block, then push; or go to it), the
demonstrations of a behaviour-cloning warm start: :func:`collect_demos`. Everything is vectorized over the envs.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from rlhf_mcore.vla.envs.base import EnvSpec, SteppedEnv, check_state_ids

__all__ = ["ReachPush", "COLORS", "DIRECTIONS", "collect_demos", "held_out_state_ids"]

COLORS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 90, 230), "yellow": (230, 210, 40)}
DIRECTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "top": (0.0, 1.0), "bottom": (0.0, -1.0)}
PUSHER_R, BLOCK_R = 0.06, 0.08
REACH_TOL = 0.02  # reach: the gap between pusher and block edges
STOP_GAP = 0.2  # collect_demos' stop-short habit: the expert's reach ends with this gap between the edges
EDGE_ZONE = 0.15  # push: the block's centre this close to the named edge
BACKGROUND, PUSHER_RGB = (40, 40, 40), (245, 245, 245)
HELD_OUT_OFFSET = 1_000_000  # state ids from here on are the held-out scenes (training draws from below)


def held_out_state_ids(n: int) -> np.ndarray:
    """`n` state ids disjoint from the training range [0, HELD_OUT_OFFSET)."""
    return np.arange(HELD_OUT_OFFSET, HELD_OUT_OFFSET + n, dtype=np.int64)


class ReachPush(SteppedEnv):
    """A batch env of `num_envs` reach-and-push scenes (the interface of :mod:`rlhf_mcore.vla.envs.base`)."""

    action_dtype = np.float64

    def __init__(self, num_envs: int, *, seed: int = 0, image_size: int = 32, max_steps: int = 48,
                 speed: float = 0.06, tasks: Sequence[str] = ("reach", "push"),
                 colors: Sequence[str] = ("red", "green", "blue"), directions: Sequence[str] = tuple(DIRECTIONS)):
        bad = [t for t in tasks if t not in ("reach", "push")] + [c for c in colors if c not in COLORS] + \
              [d for d in directions if d not in DIRECTIONS]
        if bad or not tasks or not colors or (("push" in tasks) and not directions) or len(set(colors)) != len(colors):
            raise ValueError(f"ReachPush: tasks={list(tasks)}, colors={list(colors)}, directions={list(directions)}: "
                             f"unknown or missing {bad or 'entries'}; tasks from ['reach', 'push'], colors from "
                             f"{list(COLORS)} (distinct), directions from {list(DIRECTIONS)}")
        if not (1 <= len(colors) <= 4) or image_size < 16 or max_steps < 1 or not (0 < speed <= 0.2):
            raise ValueError(f"ReachPush: need 1-4 colors, image_size >= 16, max_steps >= 1, 0 < speed <= 0.2 (got "
                             f"{len(colors)}, {image_size}, {max_steps}, {speed})")
        self.num_envs, self.seed, self.speed = int(num_envs), int(seed), float(speed)
        self.tasks, self.colors, self.directions = tuple(tasks), tuple(colors), tuple(directions)
        self.spec = EnvSpec(image_shape=(image_size, image_size, 3), state_dim=2, action_dim=2, max_steps=max_steps)
        b, k = self.num_envs, len(self.colors)
        self.pusher = np.zeros((b, 2))  # (B, 2)
        self.blocks = np.zeros((b, k, 2))  # (B, K, 2)
        self.target = np.zeros(b, np.int64)  # which block
        self.push = np.zeros(b, bool)  # push (True) or reach
        self.stop_short = np.zeros(b, bool)  # the scripted expert's habit (collect_demos): reach to STOP_GAP, stop
        self.direction = np.zeros((b, 2))  # push direction, unit
        self.instructions = [""] * b
        self.terminated, self.truncated = np.zeros(b, bool), np.zeros(b, bool)
        self.steps = np.zeros(b, np.int64)
        centres = (np.arange(image_size) + 0.5) / image_size
        self._gx, self._gy = centres[None, None, :], centres[::-1][None, :, None]  # pixel centres; row 0 is the top
        self._palette = np.array([COLORS[c] for c in self.colors], np.uint8)  # (K, 3)

    # ------------------------------------------------------------------ the interface

    def reset(self, state_ids: Any) -> dict:
        ids = check_state_ids(state_ids, self.num_envs)
        for i, sid in enumerate(ids):
            self._sample_scene(i, int(sid))
        self.terminated[:] = False
        self.truncated[:] = False
        self.steps[:] = 0
        return self._obs()

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ the scripted expert

    def expert_chunk(self, chunk: int) -> np.ndarray:
        """(B, chunk, 2): the expert's next `chunk` actions from the current state, closed loop inside the chunk
        (simulated on a copy; the scenes are deterministic, so stepping them reproduces it)."""
        pusher, blocks = self.pusher.copy(), self.blocks.copy()
        out = np.zeros((self.num_envs, chunk, 2), np.float32)
        for c in range(chunk):
            a = self._expert_action(pusher, blocks)
            out[:, c] = a
            pusher, blocks = _physics(pusher, blocks, a, self.speed)
        return out

    def _expert_action(self, pusher: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        rows = np.arange(self.num_envs)
        b = blocks[rows, self.target]  # (B, 2)
        d = self.direction  # (B, 2)
        n = np.stack([-d[:, 1], d[:, 0]], axis=1)  # (B, 2) perpendicular
        rel = pusher - b
        along, lateral = (rel * d).sum(1), (rel * n).sum(1)  # (B,)
        side = np.where(lateral >= 0, 1.0, -1.0)[:, None]
        contact = PUSHER_R + BLOCK_R
        behind = b - d * (contact + 0.01)
        aligned = (along < -contact + 0.03) & (np.abs(lateral) < 0.03)
        in_the_way = (along > -contact - 0.005) & (np.abs(lateral) < contact + 0.01)
        beside = b + side * n * (contact + 0.03) - d * (contact + 0.02)
        waypoint = np.where(in_the_way[:, None], b + side * n * (contact + 0.03) + d * along[:, None],
                            np.where((along > -contact - 0.005)[:, None], beside, behind))
        step = (waypoint - pusher) / self.speed
        push_step = d - n * (lateral / self.speed)[:, None]  # push, steering back onto the line
        step = np.where((self.push & aligned)[:, None], push_step, step)
        reach = b - pusher
        dist = np.linalg.norm(reach, axis=1, keepdims=True)
        short = reach * (1 - (contact + STOP_GAP) / np.maximum(dist, 1e-9))  # to STOP_GAP short of the block
        reach = np.where((self.stop_short & ~self.push)[:, None], short, reach)
        step = np.where(self.push[:, None], step, reach / self.speed)  # reach: straight to the block
        return np.clip(step, -1.0, 1.0).astype(np.float32)

    # ------------------------------------------------------------------ internals

    def _sample_scene(self, i: int, state_id: int) -> None:
        rng = np.random.default_rng([self.seed, state_id])
        k = len(self.colors)
        blocks = np.zeros((k, 2))
        for j in range(k):  # rejection sampling: blocks apart, in the middle of the table
            while True:
                p = rng.uniform(0.3, 0.7, size=2)
                if j == 0 or np.min(np.linalg.norm(blocks[:j] - p, axis=1)) > 2 * BLOCK_R + 0.04:
                    blocks[j] = p
                    break
        while True:
            p = rng.uniform(PUSHER_R, 1 - PUSHER_R, size=2)
            if np.min(np.linalg.norm(blocks - p, axis=1)) > PUSHER_R + BLOCK_R + REACH_TOL + 0.05:
                break
        task = self.tasks[rng.integers(len(self.tasks))]
        target = int(rng.integers(k))
        direction = self.directions[rng.integers(len(self.directions))]
        self.pusher[i], self.blocks[i], self.target[i] = p, blocks, target
        self.push[i] = task == "push"
        self.stop_short[i] = False
        self.direction[i] = DIRECTIONS[direction] if task == "push" else (0.0, 0.0)
        color = self.colors[target]
        self.instructions[i] = (f"push the {color} block to the {direction}" if task == "push"
                                else f"reach the {color} block")

    def _step(self, a: np.ndarray, live: np.ndarray):
        pusher, blocks = _physics(self.pusher, self.blocks, a, self.speed)
        self.pusher[live], self.blocks[live] = pusher[live], blocks[live]
        success = self._success()
        return success.astype(np.float32), success

    def _success(self) -> np.ndarray:
        b = self.blocks[np.arange(self.num_envs), self.target]  # (B, 2)
        reached = np.linalg.norm(self.pusher - b, axis=1) < PUSHER_R + BLOCK_R + REACH_TOL
        coord = (b * np.abs(self.direction)).sum(1)  # the block's coordinate along the push axis
        positive = self.direction.sum(1) > 0
        pushed = np.where(positive, coord > 1 - EDGE_ZONE, coord < EDGE_ZONE)
        return np.where(self.push, pushed, reached)

    def _obs(self) -> dict:
        h, w, _ = self.spec.image_shape
        img = np.empty((self.num_envs, h, w, 3), np.uint8)
        img[:] = np.array(BACKGROUND, np.uint8)
        for j in range(len(self.colors)):
            inside = _disc(self._gx, self._gy, self.blocks[:, j], BLOCK_R)  # (B, H, W)
            img[inside] = self._palette[j]
        img[_disc(self._gx, self._gy, self.pusher, PUSHER_R)] = np.array(PUSHER_RGB, np.uint8)
        return {"image": img, "state": self.pusher.astype(np.float32), "instruction": list(self.instructions)}


def _disc(gx: np.ndarray, gy: np.ndarray, centre: np.ndarray, r: float) -> np.ndarray:
    """(B, H, W) bool: pixel centres inside a disc of radius r around each env's centre (B, 2)."""
    return (gx - centre[:, 0, None, None]) ** 2 + (gy - centre[:, 1, None, None]) ** 2 <= r * r


def _physics(pusher: np.ndarray, blocks: np.ndarray, a: np.ndarray, speed: float):
    """One step of every env: (B, 2), (B, K, 2), actions (B, 2) -> new (pusher, blocks); inputs untouched."""
    contact = PUSHER_R + BLOCK_R
    move = speed * np.clip(a, -1.0, 1.0)
    p = np.clip(pusher + move, PUSHER_R, 1 - PUSHER_R)
    blocks = blocks.copy()
    k = blocks.shape[1]
    for j in range(k):  # the pusher shoves what it overlaps
        d = blocks[:, j] - p
        dist = np.linalg.norm(d, axis=1)
        hit = dist < contact
        unit = np.where(dist[:, None] > 1e-9, d / np.maximum(dist, 1e-9)[:, None], move / np.maximum(
            np.linalg.norm(move, axis=1, keepdims=True), 1e-9))
        blocks[:, j] = np.where(hit[:, None], p + unit * contact, blocks[:, j])
    blocks = np.clip(blocks, BLOCK_R, 1 - BLOCK_R)
    for j in range(k):
        for m in range(j + 1, k):  # overlapping blocks move apart, half each
            d = blocks[:, m] - blocks[:, j]
            dist = np.linalg.norm(d, axis=1)
            gap = 2 * BLOCK_R - dist
            unit = d / np.maximum(dist, 1e-9)[:, None]
            shift = np.where((gap > 0)[:, None], unit * gap[:, None] / 2, 0.0)
            blocks[:, j] -= shift
            blocks[:, m] += shift
    blocks = np.clip(blocks, BLOCK_R, 1 - BLOCK_R)
    for j in range(k):  # a block stopped by the edge (or a neighbour) stops the pusher
        d = p - blocks[:, j]
        dist = np.linalg.norm(d, axis=1)
        hit = dist < contact - 1e-9
        unit = d / np.maximum(dist, 1e-9)[:, None]
        p = np.where(hit[:, None], blocks[:, j] + unit * contact, p)
    return np.clip(p, PUSHER_R, 1 - PUSHER_R), blocks


def collect_demos(env: ReachPush, state_ids: Any, chunk: int, wrong_target: float = 0.0,
                  stop_short: float = 0.0) -> dict:
    """Scripted-expert episodes from `state_ids` (len == env.num_envs), one row per chunk step before the
    episode's end: `image` (N, H, W, 3), `state` (N, 2), `instruction` (N strings), `actions` (N, chunk, 2),
    `state_id` (N,), `success` (N,) whether that episode succeeded (filter on it for a clean warm start),
    `habit` (N,) 0 for the plain expert, 1 wrong target, 2 stop short (below).

    An imperfect expert with one consistent habit, in a fraction of the episodes drawn per scene from
    `(env.seed, state_id)` (the same scenes whatever the batch; the two fractions are disjoint, sum <= 1):

    - `wrong_target`: the expert heads for the next colour after the named one in `env.colors`' cyclic order
      (named red -> green -> blue -> red) and does that task with it, while the instruction still names the other;
      the episode counts as a success (and ends) when the expert completes its own task with that block;
    - `stop_short` (reach scenes only): the expert heads for the named block but stops with STOP_GAP (0.2) between
      the edges (the task needs 0.02) and stays; the episode ends after its first standing chunk (all zero
      actions) and counts as a success of the expert's own (flawed) plan, so BC learns to stand there."""
    if not (0.0 <= wrong_target <= 1.0 and 0.0 <= stop_short <= 1.0 and wrong_target + stop_short <= 1.0):
        raise ValueError(f"collect_demos: wrong_target={wrong_target} and stop_short={stop_short} must lie in [0, 1] "
                         "and sum to <= 1")
    ids = np.asarray(state_ids, np.int64)
    obs = env.reset(state_ids)
    u = np.array([np.random.default_rng([env.seed, 0x5EED, int(s)]).random() for s in ids])
    wrong = (u < wrong_target) & (len(env.colors) > 1)
    env.stop_short[:] = (u >= wrong_target) & (u < wrong_target + stop_short) & ~env.push
    habit = np.where(wrong, 1, np.where(env.stop_short, 2, 0))
    # the instruction keeps the named colour; the expert (and the episode's end) the next one
    env.target[wrong] = (env.target[wrong] + 1) % len(env.colors)
    stood = np.zeros(env.num_envs, bool)  # stop-short episodes that have recorded their standing chunk
    rows: dict[str, list] = {"image": [], "state": [], "instruction": [], "actions": [], "state_id": [], "env": []}
    try:
        for _ in range(-(-env.spec.max_steps // chunk)):
            live = ~(env.terminated | env.truncated | stood)
            if not live.any():
                break
            a = env.expert_chunk(chunk)
            for key in ("image", "state", "actions"):
                rows[key].append((obs[key] if key != "actions" else a)[live])
            rows["instruction"] += [s for s, keep in zip(obs["instruction"], live) if keep]
            rows["state_id"].append(ids[live])
            rows["env"].append(np.flatnonzero(live))
            stood |= env.stop_short & live & (np.abs(a).max(axis=(1, 2)) < 1e-6)
            obs = env.chunk_step(a).obs
    finally:
        env.stop_short[:] = False
    out = {k: (np.concatenate(v) if k != "instruction" else v) for k, v in rows.items()}
    env_of_row = out.pop("env")
    out["success"] = (env.terminated | stood)[env_of_row]
    out["habit"] = habit[env_of_row]
    return out
