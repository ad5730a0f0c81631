"""VLA environments (rlhf_mcore/vla/envs/, rlhf_mcore/vla/rollout.py): the built-in reach-and-push task, its
determinism under seeds and state ids, the done rules, the scripted expert, the subprocess workers (equal to the
in-process env, clean close, gone when their parent is SIGKILLed, errors surfaced) and the two-stage overlap
(it happens, shown by the order of calls and by a gate only an overlapped step passes; same rollout as without).

Cost: about a dozen env worker processes (python + numpy, ~0.3 CPU-s each), a few CPU-seconds in all."""
import functools
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from vla_helpers import GatedReachPush, pixel_reach_policy

from rlhf_mcore.vla.actions import ActionStats
from rlhf_mcore.vla.envs.reach_push import ReachPush, collect_demos, held_out_state_ids
from rlhf_mcore.vla.envs.subproc import SubprocVectorEnv
from rlhf_mcore.vla.rollout import rollout

ROOT = Path(__file__).resolve().parents[1]


def _episode(env, state_ids, actions_seed=0, chunks=4, chunk=4):
    """Reset, then random chunks: the observations and results, as a list of arrays."""
    out = []
    obs = env.reset(state_ids)
    out += [obs["image"], obs["state"], np.array(obs["instruction"])]
    rng = np.random.default_rng(actions_seed)
    for _ in range(chunks):
        res = env.chunk_step(rng.uniform(-1, 1, size=(len(state_ids), chunk, 2)))
        out += [res.obs["image"], res.obs["state"], res.reward, res.terminated, res.truncated, res.info["success"]]
    return out


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------- the built-in task


def test_reach_push_is_deterministic_per_seed_and_state_id():
    """The same (seed, state ids, actions) replay bit for bit; a state id is one scene in any env slot; another
    seed or held-out ids give other scenes. Mutation: draw scenes from one rng shared by the slots -> the permuted
    reset differs."""
    ids = np.array([3, 1, 4, 1, 5, 9])
    env = ReachPush(6, seed=7)
    first = _episode(env, ids)
    assert _same(first, _episode(ReachPush(6, seed=7), ids))
    perm = np.array([5, 0, 3, 1, 2, 4])
    obs = ReachPush(6, seed=7).reset(ids[perm])
    assert np.array_equal(obs["image"], first[0][perm]) and obs["instruction"] == list(first[2][perm])
    assert not np.array_equal(ReachPush(6, seed=8).reset(ids)["image"], first[0])
    held = ReachPush(6, seed=7).reset(held_out_state_ids(6))
    assert not any(np.array_equal(h, f) for h in held["image"] for f in first[0])
    kinds = {s.split()[0] for s in ReachPush(64).reset(np.arange(64))["instruction"]}
    assert kinds == {"reach", "push"}


def test_done_rules_sticky_flags_no_reward_after_the_end():
    """Success terminates with reward 1 at that step; afterwards the env ignores actions, rewards 0 and keeps its
    flags while its neighbour still moves; without success it truncates at max_steps.
    Mutation: step the envs that are done too -> the finished env's state moves."""
    env = ReachPush(2, tasks=("reach",), max_steps=10)
    env.reset([0, 1])
    actions = env.expert_chunk(8)
    actions[1] = 0.0  # env 1 stands still
    res = env.chunk_step(actions)
    assert res.terminated[0, -1] and not res.terminated[1].any() and not res.truncated.any()
    first = int(res.terminated[0].argmax())
    assert res.reward[0].sum() == 1 and res.reward[0, first] == 1 and res.terminated[0, first:].all()
    frozen = res.obs["state"].copy()
    res = env.chunk_step(np.ones((2, 4, 2)))
    assert (res.reward[0] == 0).all() and res.terminated[0].all() and np.array_equal(res.obs["state"][0], frozen[0])
    assert not np.array_equal(res.obs["state"][1], frozen[1])
    env.reset([0, 1])
    res = env.chunk_step(np.zeros((2, 12, 2)))  # standing still: never succeeds
    assert not res.terminated.any() and not res.truncated[:, :9].any() and res.truncated[:, 9:].all()
    assert (res.info["episode_steps"] == 10).all()


def test_expert_solves_the_tasks_and_demos_give_action_statistics():
    """The scripted expert succeeds on at least 95% of 64 scenes of each kind (measured: reach 256/256, push
    255/256); its demonstrations are rows of (image, state, instruction, action chunk) up to the episode's end."""
    for tasks in (("reach",), ("push",)):
        env = ReachPush(64, tasks=tasks)
        demos = collect_demos(env, np.arange(64), chunk=8)
        assert env.terminated.mean() >= 0.95, (tasks, env.terminated.mean())
        n = len(demos["actions"])
        assert demos["image"].shape == (n, 32, 32, 3) and demos["actions"].shape == (n, 8, 2)
        assert len(demos["instruction"]) == n and demos["success"].shape == (n,)
        assert n >= 64 and set(demos["state_id"]) == set(range(64))
    stats = ActionStats.from_actions(demos["actions"])
    assert (stats.q01 >= -1).all() and (stats.q99 <= 1).all() and (stats.q99 > stats.q01).all()


def test_demo_habits_stop_short_and_wrong_target():
    """collect_demos' imperfect experts (vla.demo_stop_short, vla.demo_wrong_target; make demo-vla's warm start):
    the drawn fraction of scenes, the same scenes whatever the batch; a stop-short episode ends standing STOP_GAP
    short of the named block (its last chunk all zeros, the instruction unchanged, not a task success); a wrong-target
    episode ends at the next colour's block while the instruction names the other. Mutation (run once): the stop
    point at the block (`short` unused in `_expert_action`) -> the stop-short episodes succeed at the task and the
    first assert after the draw fails."""
    from rlhf_mcore.vla.envs.reach_push import BLOCK_R, PUSHER_R, STOP_GAP

    n = 256
    env = ReachPush(n, seed=3, tasks=("reach",), max_steps=24, image_size=16)
    demos = collect_demos(env, np.arange(n), chunk=4, stop_short=0.7)
    habit = np.zeros(n, int)
    habit[demos["state_id"]] = demos["habit"]
    assert 0.6 < (habit == 2).mean() < 0.8 and set(np.unique(habit)) == {0, 2}
    gap = np.linalg.norm(env.pusher - env.blocks[np.arange(n), env.target], axis=1) - PUSHER_R - BLOCK_R
    short = habit == 2
    last = {int(s): i for i, s in enumerate(demos["state_id"])}  # each episode's last row
    ok = demos["success"][[last[i] for i in range(n)]]  # a stop-short success: it stood (its last chunk ~0)
    assert not env.terminated[short].any() and env.terminated[~short].all() and ok[~short].all()
    assert ok[short].mean() > 0.9  # (some stop points lie off the table: those push into its edge, never stand)
    assert np.allclose(gap[short & ok], STOP_GAP, atol=1e-3)
    assert all(np.abs(demos["actions"][last[i]]).max() < 1e-6 for i in np.flatnonzero(short & ok))
    assert all(f"the {env.colors[env.target[i]]} block" in demos["instruction"][last[i]] for i in range(n))
    half = ReachPush(n // 2, seed=3, tasks=("reach",), max_steps=24, image_size=16)  # the same scenes, other batch
    part = collect_demos(half, np.arange(n // 2, n), chunk=4, stop_short=0.7)
    assert (part["habit"] == habit[part["state_id"]]).all()

    env = ReachPush(n, seed=3, tasks=("reach",), max_steps=24, image_size=16)
    demos = collect_demos(env, np.arange(n), chunk=4, wrong_target=0.65)
    last = {int(s): i for i, s in enumerate(demos["state_id"])}
    named = np.array([next(k for k, c in enumerate(env.colors) if f"the {c} block" in s) for s in
                      [demos["instruction"][last[i]] for i in range(n)]])
    wrong = np.zeros(n, int)
    wrong[demos["state_id"]] = demos["habit"]
    assert 0.55 < (wrong == 1).mean() < 0.75 and env.terminated.mean() > 0.99
    assert (env.target == np.where(wrong == 1, (named + 1) % len(env.colors), named)).all()
    with pytest.raises(ValueError, match="sum to <= 1"):
        collect_demos(env, np.arange(n), chunk=4, wrong_target=0.5, stop_short=0.6)


# ----------------------------------------------------------------------------------- subprocess workers


@pytest.fixture(scope="module")
def two_stages():
    """Two vector envs of 3 reach scenes each (one worker each) and one of 5 in 2 workers, 6-step episodes."""
    fn = functools.partial(ReachPush, seed=5, tasks=("reach",), max_steps=6)
    envs = [SubprocVectorEnv(fn, 3, 1), SubprocVectorEnv(fn, 3, 1), SubprocVectorEnv(fn, 5, 2)]
    yield envs
    for env in envs:
        env.close()


def test_workers_equal_the_in_process_env(two_stages):
    """5 envs over 2 workers (3 + 2) step as the in-process batch env does, bit for bit; obs are copies (the next
    step does not change them)."""
    env = two_stages[2]
    ids = np.array([10, 11, 12, 13, 14])
    got = _episode(env, ids)
    assert _same(got, _episode(ReachPush(5, seed=5, tasks=("reach",), max_steps=6), ids))
    kept = got[0].copy()
    env.chunk_step(np.ones((5, 2, 2)))
    assert np.array_equal(got[0], kept)


def test_close_ends_the_workers():
    env = SubprocVectorEnv(functools.partial(ReachPush), 2, 2)
    env.reset([0, 1])
    env.close()
    assert [p.returncode for p in env._procs] == [0, 0]


def test_worker_errors_reach_the_parent(tmp_path):
    """An env that fails in its worker raises there with its traceback; a step past step_timeout_s raises and
    kills the hung worker."""
    with pytest.raises(RuntimeError, match="(?s)env worker 0 failed.*ReachPush: tasks"):
        SubprocVectorEnv(functools.partial(ReachPush, tasks=("juggle",)), 1, 1)
    env = SubprocVectorEnv(functools.partial(GatedReachPush, gate_dir=str(tmp_path), name="never", timeout_s=60), 1,
                           1, step_timeout_s=0.5)
    env.reset([0])
    with pytest.raises(RuntimeError, match="did not answer within step_timeout_s=0.5"):
        env.chunk_step(np.zeros((1, 1, 2)))
    assert env._procs[0].returncode is not None


PARENT = """
import functools, sys, time
sys.path.insert(0, "tests")
from vla_helpers import GatedReachPush
from rlhf_mcore.vla.envs.subproc import SubprocVectorEnv
env = SubprocVectorEnv(functools.partial(GatedReachPush, gate_dir=sys.argv[1], name="never", timeout_s=120), 4, 2)
env.reset([0, 1, 2, 3])
env.chunk_step_async([[[0.0, 0.0]]] * 4)  # the workers now wait in their step, not in recv
print(*env.worker_pids, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_die_when_the_parent_is_killed(tmp_path):
    """SIGKILL the process holding a SubprocVectorEnv while its workers are busy in a chunk step (so they do not
    see their socket close): the workers are gone within 5 s.
    Mutation: drop die_with_parent from the worker -> they outlive the parent."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "env workers outlived their SIGKILLed parent"


# ----------------------------------------------------------------------------------- the two-stage overlap


class _Recorder:
    """An async vector env that records its calls (send/wait per stage) into a shared log."""

    def __init__(self, name, log, num_envs=2, done_after=3):
        self.name, self.log, self.num_envs, self.done_after, self.k = name, log, num_envs, done_after, 0
        self.last_step_s = 0.0
        self.env = ReachPush(num_envs, tasks=("reach",))

    def reset(self, ids):
        self.k = 0
        return self.env.reset(ids)

    def chunk_step_async(self, actions):
        self.log.append(("send", self.name, self.k))
        self.res = self.env.chunk_step(actions)
        if self.k + 1 >= self.done_after:
            self.res.truncated[:] = True
        self.k += 1

    def chunk_step_wait(self):
        self.log.append(("wait", self.name, self.k - 1))
        return self.res


def test_overlap_order_generates_for_one_stage_while_the_other_steps():
    """With overlap, policy(B, t) runs between send(A, t) and wait(A, t), and policy(A, t+1) between send(B, t)
    and wait(B, t); without, every send is waited for before the policy runs again.
    Mutation: wait right after each send in the overlapped schedule -> the order check fails."""
    for overlap in (True, False):
        log = []
        envs = [_Recorder("A", log), _Recorder("B", log)]

        def policy(obs, rows, t, log=log):  # standing still: the envs end by the recorder's truncation only
            log.append(("policy", "A" if rows[0] == 0 else "B", t))
            return {"actions": np.zeros((len(rows), 4, 2))}

        rollout(envs, policy, np.arange(4), overlap=overlap)
        pos = {e: i for i, e in enumerate(log)}
        for t in range(3):
            if overlap:
                assert pos["send", "A", t] < pos["policy", "B", t] < pos["wait", "A", t]
                if t < 2:
                    assert pos["send", "B", t] < pos["policy", "A", t + 1] < pos["wait", "B", t]
            else:
                assert pos["send", "A", t] + 1 == pos["wait", "A", t] < pos["policy", "B", t]
        assert sum(e[0] == "policy" for e in log) == 6  # both stages stop after 3 chunks


def _gated(tmp_path, timeout_s):
    fn = functools.partial(GatedReachPush, gate_dir=str(tmp_path), name="A", timeout_s=timeout_s, tasks=("reach",),
                           max_steps=12)
    return [SubprocVectorEnv(fn, 2, 1), SubprocVectorEnv(functools.partial(ReachPush, tasks=("reach",),
                                                                           max_steps=12), 2, 1)]


def _opening_policy(tmp_path):
    """Opens stage A's gate for its chunk step t while generating for stage B at chunk t; stands still, so every
    episode runs its 3 chunks (truncated at 12 steps)."""

    def policy(obs, rows, t):
        if rows[0] >= 2:  # stage B
            (tmp_path / f"A-{t + 1}").touch()
        return {"actions": np.zeros((len(rows), 4, 2))}

    return policy


def test_overlap_happens_across_processes(tmp_path):
    """Stage A's worker can finish chunk step t only once the policy has started generating for stage B at t (a
    gate file): the overlapped rollout passes; the same rollout without overlap waits on A first and A's worker
    gives up (TimeoutError, re-raised here). No timing is measured; the timeouts only stop a hang."""
    envs = _gated(tmp_path, timeout_s=30)
    try:
        ro = rollout(envs, _opening_policy(tmp_path), np.arange(4), overlap=True)
        assert ro.stats["chunk_steps"] == 3
    finally:
        for env in envs:
            env.close()
    for f in tmp_path.iterdir():
        f.unlink()
    envs = _gated(tmp_path, timeout_s=1)
    try:
        with pytest.raises(RuntimeError, match="TimeoutError"):
            rollout(envs, _opening_policy(tmp_path), np.arange(4), overlap=False)
    finally:
        for env in envs:
            env.close()


def test_overlap_gives_the_same_rollout_as_without(two_stages):
    """Two subprocess stages, a noisy image-reading policy: overlapped and sequential rollouts are equal in every
    array; some episodes succeed, some do not, at different lengths (so padding and early stops are exercised)."""
    envs = two_stages[:2]
    ids = np.array([0, 1, 2, 3, 4, 5])
    policy = pixel_reach_policy(chunk=4, noise=3.0, seed=3)
    a = rollout(envs, policy, ids, overlap=True)
    b = rollout(envs, policy, ids, overlap=False)
    for key in ("images", "states", "reward", "terminated", "truncated", "success"):
        assert np.array_equal(getattr(a, key), getattr(b, key)), key
    assert a.outputs.keys() == b.outputs.keys() == {"actions", "tag"}
    assert all(np.array_equal(a.outputs[k], b.outputs[k]) for k in a.outputs)
    assert a.instructions == b.instructions and len(a.instructions) == 6
    assert 0 < a.success.sum() < 6 and len(set(a.episode_length)) > 2, (a.success, a.episode_length)
    assert a.stats["env_steps"] == a.episode_length.sum()
