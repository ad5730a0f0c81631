"""Helpers of the VLA tests (tests/test_vla_*.py): a policy that reads the image, and an env whose chunk steps wait
for a gate file (it runs in env worker processes: they import this module through the parent's sys.path)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from rlhf_mcore.vla.envs.reach_push import COLORS, ReachPush


def pixel_reach_policy(chunk: int = 4, noise: float = 0.5, seed: int = 0, speed: float = 0.06):
    """A chunk policy for reach tasks that sees what a VLA sees: it finds the named block's pixels in the image and
    plans `chunk` steps towards their centroid (ignoring contacts), plus Gaussian noise keyed on (seed, row,
    chunk index), so that episodes vary in length and some fail. Outputs `actions` and a per-row `tag`."""

    def policy(obs: dict, rows: np.ndarray, t: int) -> dict:
        img = obs["image"].astype(np.int64)  # (b, H, W, 3)
        h, w = img.shape[1:3]
        actions = np.zeros((len(rows), chunk, 2), np.float32)
        for i, row in enumerate(rows):
            words = obs["instruction"][i].split()
            colour = np.array(COLORS[words[words.index("block") - 1]])
            ys, xs = np.nonzero((img[i] == colour).all(-1))
            goal = np.array([(xs.mean() + 0.5) / w, 1 - (ys.mean() + 0.5) / h]) if len(xs) else np.full(2, 0.5)
            p = obs["state"][i].astype(np.float64)
            rng = np.random.default_rng([seed, int(row), t])
            for c in range(chunk):
                a = np.clip((goal - p) / speed + rng.normal(0, noise, 2), -1, 1)
                actions[i, c] = a
                p = p + speed * a
        return {"actions": actions, "tag": (rows * 100 + t).astype(np.int64)}

    return policy


class GatedReachPush(ReachPush):
    """ReachPush whose k-th chunk step (k = 1, 2, ...) first waits for the file `<gate_dir>/<name>-<k>`, and
    raises TimeoutError after `timeout_s` without it."""

    def __init__(self, num_envs: int, *, gate_dir: str, name: str, timeout_s: float, **kwargs):
        super().__init__(num_envs, **kwargs)
        self.gate_dir, self.name, self.timeout_s, self.calls = Path(gate_dir), name, timeout_s, 0

    def chunk_step(self, actions):
        self.calls += 1
        gate = self.gate_dir / f"{self.name}-{self.calls}"
        deadline = time.monotonic() + self.timeout_s
        while not gate.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{gate} never appeared: the chunk step was not overlapped with the policy")
            time.sleep(0.002)
        return super().chunk_step(actions)
