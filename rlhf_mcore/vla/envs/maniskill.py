"""ManiSkill 3 behind the chunk interface. UNVERIFIED: written against ManiSkill 3's documented gymnasium API (read,
not run: mani_skill is not installed on this project's machines); its test skips without the package.

    env = ManiSkillEnv(16, env_id="PickCube-v1", instruction="pick up the red cube and lift it")

ManiSkill vectorizes inside one process (GPU simulation), so this is a batch env: use it directly, or give each
SubprocVectorEnv worker one. What it relies on: `gymnasium.make(env_id, num_envs=, obs_mode="rgb", control_mode=,
sensor_configs={"width":, "height":})` after `import mani_skill.envs`; batched torch outputs from `step(actions
(B, A))` -> `obs, reward, terminated, truncated, info` with `info["success"]` (B,) bool;
`reset(seed=[one int per env])` seeding each env's episode; images at `obs["sensor_data"][camera]["rgb"]` (B, H, W,
3) uint8 and proprioception at `obs["agent"]["qpos"]`. ManiSkill tasks carry no language, so the instruction is one
fixed string. The reward is success (as for every env here), not ManiSkill's dense reward; the done rules are
rlhf_mcore.vla.envs.base's: a done env gets zero actions and keeps its last observation. Seeds: env slot i resets
with seed `seed * 1_000_003 + state_ids[i]`; whether one state id gives the same scene in another slot depends on the
task drawing from ManiSkill's per-env batched RNG.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from rlhf_mcore.vla.envs.base import EnvSpec, SteppedEnv, check_state_ids

__all__ = ["ManiSkillEnv"]


class ManiSkillEnv(SteppedEnv):
    def __init__(self, num_envs: int, *, env_id: str = "PickCube-v1", instruction: str = "pick up the cube",
                 camera: str = "base_camera", image_size: int = 128, control_mode: str = "pd_ee_delta_pose",
                 max_steps: int | None = None, seed: int = 0, sim_backend: str = "auto"):
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401  (registers the tasks)
        import torch

        self._torch = torch
        self.num_envs, self.seed, self.camera, self.instruction = num_envs, seed, camera, instruction
        self._env = gym.make(env_id, num_envs=num_envs, obs_mode="rgb", control_mode=control_mode,
                             sensor_configs={"width": image_size, "height": image_size}, sim_backend=sim_backend)
        base = self._env.unwrapped
        self._device = getattr(base, "device", "cpu")
        steps = max_steps or (self._env.spec.max_episode_steps if self._env.spec else None)
        if not steps:
            raise ValueError(f"ManiSkillEnv({env_id!r}): the task has no max_episode_steps; pass max_steps")
        self.spec = EnvSpec(image_shape=(image_size, image_size, 3),
                            state_dim=int(np.prod(base.single_observation_space["agent"]["qpos"].shape)),
                            action_dim=int(np.prod(base.single_action_space.shape)), max_steps=int(steps))
        self.terminated, self.truncated = np.zeros(num_envs, bool), np.zeros(num_envs, bool)
        self.steps = np.zeros(num_envs, np.int64)
        self._image = np.zeros((num_envs, *self.spec.image_shape), np.uint8)
        self._state = np.zeros((num_envs, self.spec.state_dim), np.float32)

    def _take(self, obs, rows: np.ndarray) -> None:
        image = obs["sensor_data"][self.camera]["rgb"]
        state = obs["agent"]["qpos"]
        self._image[rows] = image.cpu().numpy()[rows] if hasattr(image, "cpu") else np.asarray(image)[rows]
        self._state[rows] = (state.cpu().numpy() if hasattr(state, "cpu") else np.asarray(state))[rows]

    def _obs(self) -> dict:
        return {"image": self._image.copy(), "state": self._state.copy(),
                "instruction": [self.instruction] * self.num_envs}

    def reset(self, state_ids: Any) -> dict:
        ids = check_state_ids(state_ids, self.num_envs)
        obs, _ = self._env.reset(seed=[int(self.seed * 1_000_003 + i) for i in ids])
        self._take(obs, np.arange(self.num_envs))
        self.terminated[:] = False
        self.truncated[:] = False
        self.steps[:] = 0
        return self._obs()

    def _step(self, a: np.ndarray, live: np.ndarray):
        a = np.where(live[:, None], a, 0.0).astype(np.float32)
        obs, _, _, _, info = self._env.step(self._torch.as_tensor(a, device=self._device))
        self._take(obs, np.flatnonzero(live))
        success = info["success"]
        success = success.cpu().numpy() if hasattr(success, "cpu") else np.asarray(success)
        return success.astype(np.float32), success.astype(bool)

    def close(self) -> None:
        self._env.close()
