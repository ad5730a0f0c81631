"""Worker for tests/test_async.py: launch/train.py's fully asynchronous run with both sides of the data bus observed
(tests/scripts/async_observers.py: what the rollout pool published, sent and dropped; what each training rank
trained, row by row, with the trainer's policy version), optionally one group held back until it is stale, and
optionally the whole job killed (SIGKILL to its process group) at the end of a given step.

Usage: torchrun --nproc_per_node=N tests/scripts/async_stream_rows.py --bus DIR [--hold UID:VERSION]
       [--kill-after STEP] key=value ...
"""
import os
import signal
import sys

from async_observers import Observers, TrainedRows, observe_from_command_line
from worker_common import pop_flag, run_async_trainer

from rlhf_mcore.trainer.hooks import StepHooks


def _parent_of(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


class KillAfter(StepHooks):
    """The coordinator SIGKILLs the whole job (torchrun, every rank; torchrun starts each rank in a session of its
    own, so by process id: its children) once step `step` has ended (its metrics logged, its checkpoint saved when
    one is due): a crash at a known step."""

    def __init__(self, step: int):
        self.step = step

    def step_end(self, parts, step, batch, metrics, timer) -> None:
        if step != self.step or not parts.state.is_coordinator:
            return
        print(f"async_stream_rows: SIGKILL to the job after step {step}", flush=True)
        launcher, me = os.getppid(), os.getpid()
        ranks = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent_of(p) == launcher and int(p) != me]
        for pid in [launcher, *ranks, me]:
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    out = observe_from_command_line()
    kill_after = pop_flag("--kill-after")
    sys.argv += ["--trained", out]
    run_async_trainer("--trained", lambda d: Observers(TrainedRows(d), *(
        [KillAfter(int(kill_after))] if kill_after is not None else [])))
