"""The data bus between the rollout pool and the training pool (the asynchronous trainers' TransferQueue).

    producer (rollout replica)          coordinator (training rank 0)          consumer (training rank)
    group finished: keep its rows ----> GroupMeta (ids, lengths, versions)
    in a local store                    into the Ledger (a bounded queue)
                                        a step: choose groups, split them
                                        over DP ranks ------------------------> pull orders (src, uid, bytes)
    "send uid to ranks" <-------------- send orders
    rows --------------------------------------------- point to point -------> rows

The coordinator only ever holds metadata; rows travel producer -> consumer over the `bus` link. All `n`
samples of a prompt travel as one group and land on one DP rank (every rank of its model-parallel group gets
them). The ledger accounts for every group: produced = trained + dropped (stale) + queued.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_mcore.parallel.pools import Link, pack, unpack

_TAG_SPACE = 2**31 - 1


@dataclass
class GroupMeta:
    """What the coordinator knows of a finished group."""

    uid: int  # unique over the run (the coordinator hands them out)
    src: int  # the producer's global rank
    nbytes: int  # packed size of its rows
    prompt: int  # dataset index
    tokens: int  # prompt + response tokens over the group (for balancing)
    min_version: int  # the oldest policy version that sampled one of its tokens
    max_version: int
    partial: bool = False  # some sample spans more than one version
    spanning: int = 0  # its samples (multi-turn: trajectories) whose tokens span more than one version
    step: int = 0  # one_step_off: the step whose plan holds it
    pos: int = 0  # one_step_off: its position in that plan
    stats: dict = field(default_factory=dict)  # reward counters, producer clocks


class Ledger:
    """The coordinator's queue of finished groups, oldest first, and the run's sample accounting."""

    def __init__(self):
        self.queue: OrderedDict[int, GroupMeta] = OrderedDict()
        self.produced = self.trained = self.dropped = 0  # groups

    def add(self, meta: GroupMeta) -> None:
        self.queue[meta.uid] = meta
        self.produced += 1

    def __len__(self) -> int:
        return len(self.queue)

    def take(self, uids: list[int]) -> list[GroupMeta]:
        out = [self.queue.pop(u) for u in uids]
        self.trained += len(out)
        return out

    def drop_stale(self, version: int, threshold: int) -> list[GroupMeta]:
        """Remove (and count) the groups whose oldest token is more than `threshold` versions behind."""
        stale = [m for m in self.queue.values() if version - m.min_version > threshold]
        for m in stale:
            del self.queue[m.uid]
        self.dropped += len(stale)
        return stale

    def check(self) -> None:
        if self.produced != self.trained + self.dropped + len(self.queue):
            raise RuntimeError(f"sample accounting broken: produced {self.produced} != trained {self.trained} + "
                               f"dropped {self.dropped} + queued {len(self.queue)}")

    def state_dict(self) -> dict:
        return {"produced": self.produced, "trained": self.trained, "dropped": self.dropped}

    def load_state_dict(self, s: dict) -> None:
        self.produced, self.trained, self.dropped = s["produced"], s["trained"], s["dropped"]


class GroupStore:
    """A producer's finished groups, kept until the coordinator says where they go (or drops them)."""

    def __init__(self, bus: Link):
        self.bus = bus
        self.held: dict[int, torch.Tensor] = {}
        self.in_flight: list[tuple[Any, torch.Tensor]] = []  # (work, buffer) of sends not yet completed

    def put(self, uid: int, rows: Any) -> int:
        """Keep `rows` under `uid`; returns their packed size."""
        self.held[uid] = pack(rows)
        return self.held[uid].numel()

    def send(self, uid: int, dsts: list[int]) -> None:
        buf = self.held.pop(uid)
        for dst in dsts:
            self.in_flight.append((self.bus.send(buf, dst, uid % _TAG_SPACE), buf))

    def drop(self, uid: int) -> None:
        self.held.pop(uid, None)

    def reap(self, wait: bool = False) -> None:
        """Forget completed sends (all of them, waiting, with `wait`)."""
        if wait:
            for work, _ in self.in_flight:
                work.wait()
            self.in_flight = []
        else:
            self.in_flight = [(w, b) for w, b in self.in_flight if not w.is_completed()]


def pull(bus: Link, orders: list[tuple[int, int, int]]) -> list[Any]:
    """A consumer's side: the rows of each (src, uid, nbytes), in order."""
    out = []
    for src, uid, nbytes in orders:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        bus.recv(buf, src, uid % _TAG_SPACE)
        out.append(unpack(buf))
    return out


def send_orders(groups_per_dp: list[list[GroupMeta]], dp_ranks: list[list[int]]) -> dict[int, list]:
    """Per producer: [(uid, destination ranks)] for groups assigned to DP ranks (`dp_ranks[d]`: the global
    ranks of DP rank d's model-parallel group, all of which receive its groups)."""
    orders: dict[int, list] = {}
    for d, groups in enumerate(groups_per_dp):
        for m in groups:
            orders.setdefault(m.src, []).append((m.uid, dp_ranks[d]))
    return orders


def pull_orders(groups_per_dp: list[list[GroupMeta]]) -> list[list[tuple[int, int, int]]]:
    return [[(m.src, m.uid, m.nbytes) for m in groups] for groups in groups_per_dp]


def staleness_metrics(metas: list[GroupMeta], version: int, prefix: str = "fully_async") -> dict[str, float]:
    """Histogram of trained groups' staleness (versions behind the trainer, by their oldest token) and the
    partial-rollout counts: the share of groups with a sample across a weight sync, the samples (multi-turn:
    trajectories) across one, the widest span of versions."""
    out: dict[str, float] = {}
    for m in metas:
        k = f"{prefix}/staleness/{version - m.min_version}"
        out[k] = out.get(k, 0.0) + 1
    n = max(len(metas), 1)
    out[f"{prefix}/count/stale_samples_processed"] = float(sum(version - m.min_version > 0 for m in metas))
    out[f"{prefix}/partial/partial_ratio"] = sum(m.partial for m in metas) / n
    out[f"{prefix}/partial/samples_across_sync"] = float(sum(m.spanning for m in metas))
    out[f"{prefix}/partial/max_partial_span"] = float(max((m.max_version - m.min_version for m in metas),
                                                          default=0))
    return out


__all__ = ["GroupMeta", "GroupStore", "Ledger", "pull", "pull_orders", "send_orders", "staleness_metrics"]

