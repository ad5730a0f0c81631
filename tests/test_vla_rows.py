"""Training rows from VLA rollouts (rlhf_mcore/vla/rows.py) against a naive loop: which (trajectory, chunk step)
pairs become rows, the response mask up to the first done, where the rewards sit, the trajectory scores and groups.
numpy only, in-process; well under a second."""
import numpy as np
from vla_helpers import pixel_reach_policy

from rlhf_mcore.vla.envs.reach_push import ReachPush
from rlhf_mcore.vla.rollout import Rollout, rollout
from rlhf_mcore.vla.rows import flatten_rollout, repeat_for_groups

B, T, C, A = 9, 4, 3, 2


def _synthetic(seed=0) -> Rollout:
    """Episodes ending at random steps (terminated or truncated, some never), with junk rewards after the end
    that the rows must ignore."""
    rng = np.random.default_rng(seed)
    end = rng.integers(0, T * C + 3, size=B)  # >= T*C: never done
    end[0], end[1] = 0, T * C - 1  # done at the very first step, and at the very last one
    step = np.arange(T * C)
    done = step[None] >= end[:, None]  # (B, T*C) sticky
    by_truncation = rng.random(B) < 0.4
    terminated = (done & ~by_truncation[:, None]).reshape(B, T, C)
    truncated = (done & by_truncation[:, None]).reshape(B, T, C)
    reward = rng.normal(size=(B, T, C)).astype(np.float32)
    outputs = {"actions": rng.normal(size=(B, T, C, A)).astype(np.float32),
               "logprobs": rng.normal(size=(B, T, C * A)).astype(np.float32)}
    return Rollout(state_ids=np.arange(100, 100 + B), instructions=[f"task {b}" for b in range(B)],
                   images=rng.integers(0, 255, size=(B, T, 4, 4, 3), dtype=np.uint8),
                   states=rng.normal(size=(B, T, 2)).astype(np.float32), outputs=outputs, reward=reward,
                   terminated=terminated, truncated=truncated, success=terminated[:, -1, -1])


def _naive(ro: Rollout, group):
    rows = []
    for b in range(B):
        ended, score = False, 0.0
        for t in range(T):
            if ended:
                break
            mask, rew = [], []
            for c in range(C):
                valid = not ended
                mask += [int(valid)] * A
                rew += [0.0] * (A - 1) + [float(ro.reward[b, t, c]) if valid else 0.0]
                if valid:
                    score += float(ro.reward[b, t, c])
                if ro.terminated[b, t, c] or ro.truncated[b, t, c]:
                    ended = True
            rows.append({"traj": b, "chunk": t, "mask": mask, "rew": rew, "group": group[b]})
        for r in rows:
            if r["traj"] == b:
                r["score"] = score
    return rows


def test_rows_match_a_naive_loop():
    """Rows, masks (the first done step included, nothing after it), reward placement (the last token of each
    step), scores and per-row data equal a plain loop's.
    Mutations: exclude the done step (`<` for `<=`) -> masks, rewards and scores differ; put the reward on each
    step's first token -> the placement differs."""
    for seed in range(3):
        ro = _synthetic(seed)
        _, group = repeat_for_groups(np.arange(3), 3)  # 3 groups of 3 trajectories
        rows = flatten_rollout(ro, group)
        ref = _naive(ro, group)
        assert len(rows) == len(ref) and rows.traj.tolist() == [r["traj"] for r in ref]
        assert rows.chunk.tolist() == [r["chunk"] for r in ref]
        assert np.array_equal(rows.response_mask, np.array([r["mask"] for r in ref]))
        assert np.allclose(rows.token_rewards, np.array([r["rew"] for r in ref]))
        assert np.allclose(rows.traj_score, [r["score"] for r in ref], atol=1e-5)
        assert rows.group.tolist() == [r["group"] for r in ref]
        assert np.array_equal(rows.image, ro.images[rows.traj, rows.chunk])
        assert np.array_equal(rows.outputs["logprobs"], ro.outputs["logprobs"][rows.traj, rows.chunk])
        assert rows.instruction == [ro.instructions[b] for b in rows.traj]
        assert rows.state_id.tolist() == [100 + b for b in rows.traj]
        assert rows.response_mask.shape == (len(rows), C * A)
        # the edge cases are in: an episode done at its first step is one row with one valid step
        assert rows.response_mask[rows.traj == 0].sum() == A


def test_rows_of_a_real_rollout_and_groups():
    """From a rollout of the built-in task with GRPO groups: every trajectory's rows cover exactly its episode
    length, its score is its success, and the groups are the repeated initial states."""
    ids, group = repeat_for_groups([7, 3, 7], 2)
    assert ids.tolist() == [7, 7, 3, 3, 7, 7] and group.tolist() == [0, 0, 1, 1, 2, 2]
    envs = [ReachPush(3, tasks=("reach",), max_steps=6), ReachPush(3, tasks=("reach",), max_steps=6)]
    ro = rollout(envs, pixel_reach_policy(chunk=4, noise=3.0, seed=0), ids)
    assert 0 < ro.success.sum() < 6  # successes and failures (truncated at 6 steps, inside the second chunk)
    rows = flatten_rollout(ro, group)
    act_dim = ro.outputs["actions"].shape[-1]
    for b in range(6):
        mine = rows.traj == b
        assert rows.response_mask[mine].sum() == ro.episode_length[b] * act_dim
        assert np.all(rows.traj_score[mine] == float(ro.success[b]))
        assert np.all(rows.group[mine] == group[b])
    assert np.array_equal(rows.token_rewards.sum(1) > 0, np.isin(np.arange(len(rows)), [
        np.flatnonzero(rows.traj == b)[-1] for b in range(6) if ro.success[b]]))
