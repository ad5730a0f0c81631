"""Observers of the fully asynchronous trainer for the test scripts (imported as a sibling module), both sides of the
data bus recorded independently of the trainer's own bookkeeping (its Ledger, its staleness metrics):

- rollout side (`watch_rollout`): every group a rollout worker publishes (uid, prompt, each row's versions, the
  worker's weight version at that moment), and every group it is told to send (trained) or to drop (stale); each
  published row is tagged with its group's uid (`bus_uid`, an extra attribute that travels with the pickled row);
  optionally one group is held back (`hold`: its rows kept, unpublished, until the worker has received the weights
  of a given version), the deterministic way to make a group stale;
- training side (`TrainedRows`): every row a training rank trains on, with its uid tag, prompt, versions and the
  trainer's policy version when the step took it (the hook's `parts.rows` and `parts.version`: updates done before
  this step's).

Files: DIR/bus.rank{R}.jsonl ({"event": "published" | "held" | "sent" | "dropped", "uid", ...}) from rollout rank
R and DIR/trained.rank{R}.jsonl ({"step", "rank", "uid", "prompt", "sample", "versions", "trainer_version"}) from
training rank R, one JSON object a line, each written through at once (a SIGKILL loses no line written before it).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from rlhf_mcore.trainer.databus import GroupStore
from rlhf_mcore.trainer.hooks import StepHooks
from rlhf_mcore.trainer.rollout_worker import RolloutWorker


def _writer(path: Path):
    f = open(path, "a", buffering=1)  # line-buffered: each record reaches the file as it is written

    def write(**record) -> None:
        f.write(json.dumps(record) + "\n")

    return write


def watch_rollout(out: str, hold: Optional[tuple[int, int]] = None) -> None:
    """Patch the rollout worker (read only, but for `hold`) to log what it publishes, sends and drops under
    `out`. `hold=(uid, version)`: the group `uid` is published only once the worker holds weights of `version` or
    later (its rows unchanged: sampled by the versions they record)."""
    import torch.distributed as dist

    publish, receive, send, drop = (RolloutWorker.publish, RolloutWorker.receive_weights, GroupStore.send,
                                    GroupStore.drop)
    log = {}

    def write(**record):
        if "w" not in log:
            log["w"] = _writer(Path(out) / f"bus.rank{dist.get_rank()}.jsonl")
        log["w"](**record)

    def logged_publish(self, done):
        keep = []
        for uid, g in done:
            if hold is not None and uid == hold[0] and self.version < hold[1]:
                self.held_back = [(uid, g)]
                write(event="held", uid=uid, rollout_version=self.version)
                continue
            for r in g["rows"]:
                r.bus_uid = uid
            write(event="published", uid=uid, prompt=g["prompt"], rollout_version=self.version,
                  versions=[list(r.versions) for r in g["rows"]])
            keep.append((uid, g))
        if keep:
            publish(self, keep)

    def receive_and_release(self, version):
        receive(self, version)
        held = getattr(self, "held_back", None)
        if held and self.version >= hold[1]:
            self.held_back = None
            logged_publish(self, held)

    def logged_send(self, uid, dsts):
        write(event="sent", uid=uid, dsts=list(dsts))
        send(self, uid, dsts)

    def logged_drop(self, uid):
        write(event="dropped", uid=uid, held=uid in self.held)
        drop(self, uid)

    RolloutWorker.publish, RolloutWorker.receive_weights = logged_publish, receive_and_release
    GroupStore.send, GroupStore.drop = logged_send, logged_drop


class TrainedRows(StepHooks):
    """Every training rank writes the rows it trained on at each step (fully_async: `parts.version`)."""

    def __init__(self, out: str):
        self.out = Path(out)
        self.write = None

    def step_end(self, parts, step, batch, metrics, timer) -> None:
        if self.write is None:
            self.write = _writer(self.out / f"trained.rank{parts.state.rank}.jsonl")
        version = parts.version
        for prompt, r in parts.rows:
            self.write(step=step, rank=parts.state.rank, uid=getattr(r, "bus_uid", None), prompt=prompt,
                       sample=r.sample, versions=list(r.versions), trainer_version=version)


def read_jsonl(out: Path, stem: str) -> list[dict]:
    """The records of every rank's `stem.rank*.jsonl` under `out` (for the tests)."""
    return [json.loads(x) for f in sorted(Path(out).glob(f"{stem}.rank*.jsonl")) for x in f.read_text().splitlines()]


class Observers(StepHooks):
    """Several step hooks, called in order."""

    def __init__(self, *hooks: StepHooks):
        self.hooks = hooks

    def step_start(self, parts, step) -> None:
        for h in self.hooks:
            h.step_start(parts, step)

    def step_end(self, parts, step, batch, metrics, timer) -> None:
        for h in self.hooks:
            h.step_end(parts, step, batch, metrics, timer)


def observe_from_command_line() -> Optional[str]:
    """`--bus DIR [--hold UID:VERSION]` taken out of sys.argv: the rollout side watched (and the group held) into
    DIR. Returns DIR (None without --bus)."""
    from worker_common import pop_flag

    out, hold = pop_flag("--bus"), pop_flag("--hold")
    if out is not None:
        watch_rollout(out, hold=tuple(int(x) for x in hold.split(":")) if hold else None)
    return out
