"""Process lifetimes and the run-directory lock.

- Unit (fast): the parent-death signal kills a process with its parent, and at once when the parent died before
  it was armed; the run lock refuses a live holder (flock held, or a live PID where flock is not enforced) and a
  holder on another host, and takes over the lock of a dead holder with a message.
- The lock's decision reaches every rank: under a 2-process gloo group both ranks raise the refusal.
- End to end (CPU, tiny random model): a 2-rank torchrun training run holds the lock; a second run on the same
  directory is refused before building anything (exit 2, one line naming the holder); `kill -9` of the torchrun
  agent takes its ranks and every helper they started
  (reward workers, dist_checkpointing's Manager and resource tracker) down within seconds; a following run takes
  the stale lock over with a message and dies loading a truncated model, leaving no lock; the run after it starts
  without a takeover and completes.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher import QUIET, free_port, start
from launcher import env as child_env

from rlhf_mcore.trainer.run_lock import LOCK_NAME, RunLock, RunLockError, _boot_id, _start_ticks

pytestmark = pytest.mark.cost(40)

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def _env():
    return child_env(**QUIET)


def _alive(pid: int, ticks: int) -> bool:
    """Whether the process `pid` that started at `ticks` still exists and is not a zombie (dead, not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0] != "Z" and int(fields[19]) == ticks


def _wait_gone(procs: dict[int, tuple[int, str]], seconds: float) -> dict[int, str]:
    """Wait until none of `procs` ({pid: (start ticks, cmdline)}) is alive; returns those still alive."""
    deadline = time.time() + seconds
    while True:
        left = {pid: cmd for pid, (ticks, cmd) in procs.items() if _alive(pid, ticks)}
        if not left or time.time() > deadline:
            return left
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent_of(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone since the snapshot
        return -1
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _descendants(root: int) -> dict[int, tuple[int, str]]:
    """{pid: (start ticks, cmdline)} of every live descendant of `root`."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parent[int(d.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    found, frontier = {}, [root]
    while frontier:
        p = frontier.pop()
        for child, pp in parent.items():
            if pp == p and child not in found:
                ticks = _start_ticks(child)
                if ticks is not None:
                    found[child] = (ticks, _cmdline(child))
                    frontier.append(child)
    return found


def _mentioning(text: str) -> dict[int, tuple[int, str]]:
    """Live processes whose command line contains `text`."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid() and text in _cmdline(int(d.name)):
            ticks = _start_ticks(int(d.name))
            if ticks is not None and _alive(int(d.name), ticks):
                out[int(d.name)] = (ticks, _cmdline(int(d.name)))
    return out


# ------------------------------------------------------------------------------------ parent-death signal

ARMED = ("import sys, time; from rlhf_mcore.lifetime import die_with_parent; die_with_parent(int(sys.argv[1])); "
         "print('armed', flush=True); time.sleep(120)")
# the middle process starts a helper that expects it as its parent, reports the helper's PID, then sleeps
PARENT = ("import os, subprocess, sys, time; "
          "g = subprocess.Popen([sys.executable, '-c', sys.argv[1], str(os.getpid())]); "
          "print(g.pid, flush=True); time.sleep(120)")


def _assert_dies_with_its_killed_parent(parent_args: list[str], what: str, expect_armed_line: bool) -> None:
    """The parent prints its child's PID (and the child "armed", where it does); the child must live while the
    parent does and be gone within 5 s of the parent's SIGKILL."""
    parent = subprocess.Popen([PY, "-c", *parent_args], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        ticks = _start_ticks(child)
        if expect_armed_line:
            assert parent.stdout.readline().strip() == "armed"  # the child's line (it shares the pipe)
        time.sleep(0.5)
        assert _alive(child, ticks), f"the {what} died while its parent was alive"
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert not _wait_gone({child: (ticks, what)}, 5.0), f"the {what} outlived its SIGKILLed parent"


def test_helper_dies_with_its_killed_parent():
    _assert_dies_with_its_killed_parent([PARENT, ARMED], "helper", expect_armed_line=True)


def test_parent_gone_before_arming_kills_at_once():
    no_such_pid = 2**22 + 7  # above Linux's largest pid_max: not this process's parent, whatever happened
    proc = subprocess.run([PY, "-c", ARMED, str(no_such_pid)], env=_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGKILL and "armed" not in proc.stdout, (proc.returncode, proc.stderr)


FORKER = ("import multiprocessing as mp, time; from rlhf_mcore.lifetime import arm_forked_children; "
          "assert arm_forked_children(); p = mp.get_context('fork').Process(target=time.sleep, args=(120,)); "
          "p.start(); print(p.pid, flush=True); time.sleep(120)")


def test_forked_child_dies_with_its_killed_parent():
    """What dist_checkpointing's bucket writers are: multiprocessing fork-context children."""
    _assert_dies_with_its_killed_parent([FORKER], "forked child", expect_armed_line=False)


HANG_REWARD = """
import time
from pathlib import Path

def hang(data_source, solution_str, ground_truth, extra_info=None):
    Path(extra_info["marker"]).write_text("scoring")
    time.sleep(120)
"""
SCORE = ("import sys; sys.path.insert(0, sys.argv[1]); from hang_reward import hang; "
         "from rlhf_mcore.rewards import RewardScorer; s = RewardScorer(hang, num_workers=1, timeout_s=100); "
         "print(s._workers[0].proc.pid, flush=True); s.score(['x'], ['y'], ['z'], [{'marker': sys.argv[2]}])")


def test_reward_worker_stuck_in_user_code_dies_with_the_trainer(tmp_path):
    """A worker inside a hanging reward function never reads its socket's end: only the parent-death signal
    stops it when the trainer is killed."""
    (tmp_path / "hang_reward.py").write_text(HANG_REWARD)
    marker = tmp_path / "scoring"
    trainer = subprocess.Popen([PY, "-c", SCORE, str(tmp_path), str(marker)], env=_env(), stdout=subprocess.PIPE,
                               text=True)
    try:
        worker = int(trainer.stdout.readline())
        ticks = _start_ticks(worker)
        deadline = time.time() + 60
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the reward function was never called"
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    assert not _wait_gone({worker: (ticks, "reward worker")}, 5.0), "the reward worker outlived the trainer"


# ------------------------------------------------------------------------------------ the run lock (unit)

HOLD = ("import sys; from rlhf_mcore.trainer.run_lock import RunLock; lock = RunLock.acquire(sys.argv[1]); "
        "print('held', flush=True); sys.stdin.readline(); lock.release()")


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([PY, "-c", HOLD, str(run_dir)], env=_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_live_holder_is_refused(tmp_path):
    holder = _holder(tmp_path)
    try:
        before = (tmp_path / LOCK_NAME).read_text()
        with pytest.raises(RunLockError) as e:
            RunLock.acquire(tmp_path)
        msg = str(e.value)
        assert f"PID {holder.pid} on host {socket.gethostname()}" in msg and "is in use" in msg, msg
        assert f"trainer.default_local_dir={tmp_path}" in msg and "choose another" in msg, msg
        assert "\n" not in msg and (tmp_path / LOCK_NAME).read_text() == before
    finally:
        holder.communicate("\n", timeout=30)
    assert holder.returncode == 0 and not (tmp_path / LOCK_NAME).exists()  # released at clean exit
    lock = RunLock.acquire(tmp_path)  # free again: taken without a takeover
    assert lock.held and lock.took_over is None
    lock.release()


def test_dead_holder_is_taken_over_with_a_message(tmp_path, capfd):
    holder = _holder(tmp_path)
    holder.kill()  # SIGKILL: no release, the file stays; the kernel drops the flock
    holder.wait()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid
    lock = RunLock.acquire(tmp_path, key="--out")
    try:
        assert lock.took_over["pid"] == holder.pid
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        err = capfd.readouterr().err
        assert f"took over {tmp_path / LOCK_NAME} from PID {holder.pid}" in err and "no longer running" in err, err
    finally:
        lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_unreaped_killed_holder_is_taken_over(tmp_path):
    """A holder SIGKILLed and not yet reaped (a zombie: CI's container init reaps a killed rank whose torchrun died
    with it late, and the fully_async kill-and-resume test's resume then met its lock) still has a /proc entry with
    its PID and start time; it holds nothing, so the lock is stale and taken over. Mutation: `_start_ticks` not
    treating state Z as gone -> refused as "which is running" -> fails."""
    holder = _holder(tmp_path)
    holder.kill()  # no wait(): the child stays a zombie until reaped below
    deadline = time.monotonic() + 30
    while Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the killed holder never became a zombie"
        time.sleep(0.01)
    try:
        lock = RunLock.acquire(tmp_path)
        assert lock.took_over["pid"] == holder.pid
        lock.release()
    finally:
        holder.wait()


def _record(pid: int, host: str, boot_id: str) -> str:
    return json.dumps({"host": host, "boot_id": boot_id, "pid": pid, "start_ticks": _start_ticks(pid),
                       "started": "2026-01-01 00:00:00 +0000", "command": "launch/train.py"})


def test_live_pid_without_flock_is_refused(tmp_path):
    """A filesystem that does not enforce flock: the record names a live process on this host, so it is refused."""
    sleeper = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_NAME).write_text(_record(sleeper.pid, socket.gethostname(), _boot_id()))
        with pytest.raises(RunLockError, match=f"PID {sleeper.pid} .*which is running"):
            RunLock.acquire(tmp_path)
    finally:
        sleeper.kill()
        sleeper.wait()
    lock = RunLock.acquire(tmp_path)  # the same record with the process gone: stale
    assert lock.took_over["pid"] == sleeper.pid
    lock.release()


def test_holder_on_another_host_is_refused(tmp_path):
    (tmp_path / LOCK_NAME).write_text(_record(os.getpid(), "node-elsewhere", "another-boot"))
    with pytest.raises(RunLockError) as e:
        RunLock.acquire(tmp_path)
    msg = str(e.value)
    assert "host node-elsewhere" in msg and f"delete {tmp_path / LOCK_NAME}" in msg, msg
    assert "node-elsewhere" in (tmp_path / LOCK_NAME).read_text()  # left alone


COLLECTIVE = """
import sys
from types import SimpleNamespace
import torch.distributed as dist
from rlhf_mcore.trainer.run_lock import RunLockError, take_run_lock
dist.init_process_group("gloo")
try:
    lock = take_run_lock(sys.argv[1], SimpleNamespace(is_coordinator=dist.get_rank() == 0, cpu_group=None))
    print("took", lock.held)
except RunLockError as e:
    print("refused:", e, "| process group left:", dist.is_initialized())
"""


def test_every_rank_gets_rank0s_refusal(tmp_path):
    port = free_port()
    holder = _holder(tmp_path)
    try:
        ranks = [subprocess.Popen([PY, "-c", COLLECTIVE, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                                  stderr=subprocess.PIPE, env=dict(_env(), MASTER_ADDR="127.0.0.1",
                                                                   MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2"))
                 for r in range(2)]
        outs = [p.communicate(timeout=300) for p in ranks]
    finally:
        holder.communicate("\n", timeout=30)
    for r, (p, (out, err)) in enumerate(zip(ranks, outs)):
        assert p.returncode == 0 and out.startswith("refused:"), (r, out, err[-3000:])
        assert f"PID {holder.pid} on host" in out and out.rstrip().endswith("process group left: False"), (r, out)


# ------------------------------------------------------------------------------------ end to end

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny random Qwen2 model and synthetic data; returns train.py arguments for a run into a directory."""
    from rlhf_mcore.data import write_synthetic_parquet
    from rlhf_mcore.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("lifetime")
    make_tiny_model(root / "tiny", arch="qwen2", layers=2, hidden=128, heads=4, kv_heads=2, seed=0, init_std=0.02)
    write_synthetic_parquet(root / "syn", n=256, difficulty=0, seed=0, n_test=8)

    def args(out: Path, steps: int, nproc: int, *extra: str) -> list[str]:
        return ["--config", str(ROOT / "configs" / "demo_cpu.yaml"), f"actor_rollout_ref.model.path={root / 'tiny'}",
                f"data.train_files=[{root / 'syn' / 'train.parquet'}]", "data.val_files=[]",
                f"trainer.default_local_dir={out}", f"trainer.total_training_steps={steps}", "trainer.logger=[jsonl]",
                "trainer.val_before_train=false", "trainer.test_freq=-1", f"trainer.n_gpus_per_node={nproc}",
                "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                "actor_rollout_ref.actor.ppo_epochs=1", *extra]

    return args


def _train(*args: str, nproc: int = 1, log=None) -> subprocess.Popen:
    """launch/train.py (under torchrun when nproc > 1); output to pipes, or to the open file `log`: a pipe would
    tie the rank's fate to our reading of it."""
    out = {} if log is None else {"stdout": log, "stderr": log}
    return start("launch/train.py", *args, nproc=None if nproc == 1 else nproc, env_extra=QUIET, zygote=False,
                 **out)  # torchrun and fresh interpreters: their parents are what this file tests


def _wait_for(root: Path, pattern: str, proc: subprocess.Popen, log: Path, seconds: float,
              nonempty: bool = False) -> None:
    """Wait until a file matching `pattern` under `root` exists (holding something if `nonempty`), while `proc`
    runs; fail with the end of `log` otherwise."""
    def there() -> bool:
        for p in root.glob(pattern):
            try:
                if not nonempty or p.stat().st_size > 0:
                    return True
            except FileNotFoundError:  # an old checkpoint being rotated out
                pass
        return False

    deadline = time.time() + seconds
    while not there() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if not there():
        pytest.fail(f"no {root / pattern} (exit {proc.poll()}):\n{log.read_text()[-5000:]}")


@pytest.mark.slow
def test_killed_torchrun_takes_its_ranks_and_helpers_down_and_its_lock_is_taken_over(tiny_run, tmp_path):
    out, log = tmp_path / "run", tmp_path / "a.log"
    lock_file = out / LOCK_NAME
    # run A: 2 ranks, a reward worker each, a checkpoint every step (dist_checkpointing's Manager), many steps
    with open(log, "w") as f:
        a = _train(*tiny_run(out, 500, 2, "trainer.save_freq=1", "reward.num_workers=1"), nproc=2, log=f)
    tree = {}
    try:
        _wait_for(out, LOCK_NAME, a, log, 300, nonempty=True)
        holder = json.loads(lock_file.read_text())

        # a second live run on the directory: refused before any model is built, with one line
        b = _train(*tiny_run(out, 1, 1))
        b_err = b.communicate(timeout=300)[1]
        lines = b_err.strip().splitlines()
        assert b.returncode == 2 and len(lines) == 1, (b.returncode, b_err[-3000:])
        assert lines[0].startswith("config error:") and f"PID {holder['pid']} on host {holder['host']}" in lines[0]
        assert f"{lock_file} is held by" in lines[0] and "Stop that run" in lines[0], lines[0]
        assert json.loads(lock_file.read_text()) == holder and a.poll() is None  # A is untouched

        _wait_for(out, "checkpoints/global_step_*/COMPLETE", a, log, 300)  # any: older ones are rotated out
        tree = _descendants(a.pid)
        # ranks are the agent's own children (a checkpoint writer a rank forks shares its command line)
        kinds = {"rank": [p for p, (_, c) in tree.items() if "launch/train.py" in c and str(out) in c
                          and _parent_of(p) == a.pid],
                 "reward worker": [p for p, (_, c) in tree.items() if "worker_main()" in c],
                 "Manager": [p for p, (_, c) in tree.items() if "spawn_main" in c]}
        assert {k: len(v) for k, v in kinds.items()} == {"rank": 2, "reward worker": 2, "Manager": 2}, tree
        assert holder["pid"] in kinds["rank"]
    finally:
        a.kill()  # SIGKILL to the torchrun agent only
        a.wait()
        left = _wait_gone({**tree, **_mentioning(str(out))}, 10.0)
        for pid in left:  # whatever the outcome, leave nothing running
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not left, f"processes outlived the killed torchrun: {left}"
    assert json.loads(lock_file.read_text()) == holder  # the stale lock stays behind

    # the next run takes the stale lock over, says so, then dies loading a truncated model: it leaves no lock
    # (mutation: drop the release in RunContext.building's except -> the lock stays and run C takes it over: fails)
    model = Path(next(a for a in tiny_run(out, 1, 1) if a.startswith("actor_rollout_ref.model.path=")).split("=")[1])
    broken = tmp_path / "truncated_model"
    shutil.copytree(model, broken)
    (broken / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:-1000])
    d = _train(*tiny_run(out, 1, 1, "trainer.resume_mode=disable", f"actor_rollout_ref.model.path={broken}"))
    d_err = d.communicate(timeout=300)[1]
    assert d.returncode == 2 and "is truncated" in d_err, (d.returncode, d_err[-3000:])
    assert f"run lock: took over {lock_file} from PID {holder['pid']} on host {holder['host']}" in d_err, d_err[-3000:]
    assert not lock_file.exists(), "a run that died loading its model left its RUN_LOCK"

    # so the run after it starts without a takeover, and completes (fresh: resume off)
    c = _train(*tiny_run(out, 1, 1, "trainer.resume_mode=disable"))
    c_err = c.communicate(timeout=300)[1]
    assert c.returncode == 0, c_err[-4000:]
    assert "run lock: took over" not in c_err, c_err[-3000:]
    assert (out / "hf_final" / "config.json").is_file() and not lock_file.exists()  # released at clean exit
