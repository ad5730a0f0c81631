"""LIBERO behind the chunk interface. UNVERIFIED: written against LIBERO's documented API (read, not run: libero
and its MuJoCo/robosuite stack are not installed on this project's machines); its test skips without the package.

    fn = functools.partial(LiberoEnv, suite="libero_spatial", image_size=128)
    env = SubprocVectorEnv(fn, num_envs=64, num_workers=8)      # one MuJoCo scene per env, a few per worker

What it relies on: `libero.libero.benchmark.get_benchmark_dict()[suite]()` with `n_tasks`, `get_task(i)` (`.language`,
`.problem_folder`, `.bddl_file`) and `get_task_init_states(i)` (the suite's fixed initial states, 50 a task);
`libero.libero.get_libero_path("bddl_files")`; `libero.libero.envs.OffScreenRenderEnv(bddl_file_name=,
camera_heights=, camera_widths=)` with `seed`, `reset`, `set_init_state(state) -> obs` and the old gym
`step(action) -> obs, reward, done, info` where `done` is task success. As OpenVLA's LIBERO evaluation does: the
image is `agentview_image` turned 180 degrees (LIBERO renders it upside down), the proprioception is the end
effector's position, its orientation as an axis-angle vector and the two gripper joints (8 numbers), and the first
`num_steps_wait` steps after a reset are no-op actions (the objects settle). Actions pass through unchanged (7:
end-effector delta position and rotation, gripper -1 open / +1 close): a policy trained on OpenVLA's data converts
its gripper convention itself. Episodes are truncated at the suite's usual budget (`MAX_STEPS`).

State ids: `task = state_id % n_tasks`, `init = (state_id // n_tasks) % len(init states of task)`, so consecutive ids
cycle through the tasks; one state id is one (task, initial state) in any slot.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from rlhf_mcore.vla.envs.base import EnvSpec, SteppedEnv, check_state_ids

__all__ = ["LiberoEnv", "MAX_STEPS", "quat_to_axis_angle", "task_and_init"]

MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}
NO_OP = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0]  # hold still, gripper open


def quat_to_axis_angle(q: np.ndarray) -> np.ndarray:
    """(x, y, z, w) unit quaternion -> (3,) axis * angle, angle in [0, pi] (robosuite's quaternion order)."""
    q = np.asarray(q, np.float64)
    w = float(np.clip(q[3], -1.0, 1.0))
    if w < 0:  # q and -q are one rotation: take the one with the angle <= pi
        q, w = -q, -w
    s = np.sqrt(max(1.0 - w * w, 0.0))
    if s < 1e-9:
        return np.zeros(3)
    return q[:3] / s * (2.0 * np.arccos(w))


def task_and_init(state_id: int, init_counts: list[int]) -> tuple[int, int]:
    task = state_id % len(init_counts)
    return task, (state_id // len(init_counts)) % init_counts[task]


class LiberoEnv(SteppedEnv):
    def __init__(self, num_envs: int, *, suite: str = "libero_spatial", image_size: int = 128, seed: int = 0,
                 num_steps_wait: int = 10, max_steps: int | None = None):
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import OffScreenRenderEnv

        suites = benchmark.get_benchmark_dict()
        if suite not in suites:
            raise ValueError(f"LiberoEnv: suite={suite!r} is not one of {sorted(suites)}")
        self._make, self._bddl_root = OffScreenRenderEnv, get_libero_path("bddl_files")
        self._suite = suites[suite]()
        self._init_states = [self._suite.get_task_init_states(i) for i in range(self._suite.n_tasks)]
        self.num_envs, self.seed, self.image_size, self.num_steps_wait = num_envs, seed, image_size, num_steps_wait
        self.spec = EnvSpec(image_shape=(image_size, image_size, 3), state_dim=8, action_dim=7,
                            max_steps=int(max_steps or MAX_STEPS.get(suite, 400)))
        self._envs: list[Any] = [None] * num_envs
        self._task_of = [-1] * num_envs
        self.instructions = [""] * num_envs
        self._image = np.zeros((num_envs, *self.spec.image_shape), np.uint8)
        self._state = np.zeros((num_envs, 8), np.float32)
        self.terminated, self.truncated = np.zeros(num_envs, bool), np.zeros(num_envs, bool)
        self.steps = np.zeros(num_envs, np.int64)

    def _take(self, i: int, obs: dict) -> None:
        self._image[i] = np.asarray(obs["agentview_image"])[::-1, ::-1]
        self._state[i] = np.concatenate([obs["robot0_eef_pos"], quat_to_axis_angle(obs["robot0_eef_quat"]),
                                         obs["robot0_gripper_qpos"]])

    def _obs(self) -> dict:
        return {"image": self._image.copy(), "state": self._state.copy(), "instruction": list(self.instructions)}

    def reset(self, state_ids: Any) -> dict:
        ids = check_state_ids(state_ids, self.num_envs)
        for i, sid in enumerate(ids):
            task_id, init = task_and_init(int(sid), [len(s) for s in self._init_states])
            task = self._suite.get_task(task_id)
            if self._task_of[i] != task_id:
                if self._envs[i] is not None:
                    self._envs[i].close()
                self._envs[i] = self._make(bddl_file_name=os.path.join(self._bddl_root, task.problem_folder,
                                                                       task.bddl_file),
                                           camera_heights=self.image_size, camera_widths=self.image_size)
                self._task_of[i] = task_id
            env = self._envs[i]
            env.seed(self.seed)
            env.reset()
            obs = env.set_init_state(self._init_states[task_id][init])
            for _ in range(self.num_steps_wait):
                obs, _, _, _ = env.step(NO_OP)
            self._take(i, obs)
            self.instructions[i] = task.language
        self.terminated[:] = False
        self.truncated[:] = False
        self.steps[:] = 0
        return self._obs()

    def _step(self, a: np.ndarray, live: np.ndarray):
        success = np.zeros(self.num_envs, bool)
        for i in np.flatnonzero(live):
            obs, _, done, _ = self._envs[i].step(a[i].tolist())
            self._take(i, obs)
            success[i] = bool(done)
        return success.astype(np.float32), success

    def close(self) -> None:
        for env in self._envs:
            if env is not None:
                env.close()
