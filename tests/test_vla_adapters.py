"""The ManiSkill 3 and LIBERO adapters (rlhf_mcore/vla/envs/maniskill.py, libero.py). Neither package is installed
on this project's machines: the env tests skip without them (UNVERIFIED here, README says so); the adapters' own
arithmetic (LIBERO's orientation as axis-angle, the state-id -> (task, initial state) map) is tested always."""
import numpy as np
import pytest

from rlhf_mcore.vla.envs.libero import quat_to_axis_angle, task_and_init


def test_quaternion_to_axis_angle():
    """Against building the quaternion from a known axis and angle (x, y, z, w order), both signs of q.
    Mutation: drop the factor 2 on the angle -> fails."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        axis = rng.normal(size=3)
        axis /= np.linalg.norm(axis)
        angle = rng.uniform(0.01, np.pi - 0.01)
        q = np.concatenate([axis * np.sin(angle / 2), [np.cos(angle / 2)]])
        assert np.allclose(quat_to_axis_angle(q), axis * angle, atol=1e-9)
        assert np.allclose(quat_to_axis_angle(-q), axis * angle, atol=1e-9)
    assert np.array_equal(quat_to_axis_angle(np.array([0.0, 0.0, 0.0, 1.0])), np.zeros(3))


def test_state_ids_cover_every_task_and_initial_state_once():
    counts = [50] * 10
    pairs = [task_and_init(i, counts) for i in range(500)]
    assert len(set(pairs)) == 500 and pairs[:3] == [(0, 0), (1, 0), (2, 0)]
    assert task_and_init(500, counts) == (0, 0)


def _exercise(env, action_dim):
    obs = env.reset([0, 1])
    assert obs["image"].shape == (2, *env.spec.image_shape) and obs["image"].dtype == np.uint8
    assert obs["state"].shape == (2, env.spec.state_dim) and len(obs["instruction"]) == 2
    res = env.chunk_step(np.zeros((2, 2, action_dim), np.float32))
    assert res.reward.shape == res.terminated.shape == res.truncated.shape == (2, 2)
    again = env.reset([0, 1])
    assert np.array_equal(again["image"], obs["image"])  # same state ids, same start
    env.close()


def test_maniskill_env():
    pytest.importorskip("mani_skill")
    from rlhf_mcore.vla.envs.maniskill import ManiSkillEnv

    env = ManiSkillEnv(2, env_id="PickCube-v1", image_size=64)
    _exercise(env, env.spec.action_dim)


def test_libero_env():
    pytest.importorskip("libero")
    from rlhf_mcore.vla.envs.libero import LiberoEnv

    _exercise(LiberoEnv(2, suite="libero_spatial", image_size=64, num_steps_wait=2), 7)
