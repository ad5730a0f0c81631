"""The asynchronous trainers' process layout: the torchrun world split into a training pool and a rollout pool.

    ranks 0 .. T-1        training pool (Megatron TP x PP x DP; rank 0 is the coordinator)
    ranks T .. T+R-1      rollout pool  (R / rollout_tp engine replicas of rollout_tp consecutive ranks)

Each pool gets its own default process group (so Megatron, which builds its groups over the default group,
sees the training pool only, and the rollout's tensor-parallel groups span rollout ranks only). Groups that
cross the pools are :class:`Link`s, process groups built straight from the launcher's key-value store:

    bus      gloo, every rank: samples travel producer -> consumer point to point
    weights  NCCL on GPU (gloo on CPU): training rank 0 + every rollout rank, for the weight broadcast

Small control messages go through the store itself (:class:`Mailbox`).
"""
from __future__ import annotations

import datetime
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class PoolLayout:
    train_size: int
    rollout_size: int
    rollout_tp: int = 1

    def __post_init__(self):
        if self.train_size < 1 or self.rollout_size < 1 or self.rollout_size % self.rollout_tp:
            raise ValueError(f"bad pool layout: {self.train_size} training + {self.rollout_size} rollout processes "
                             f"with rollout TP {self.rollout_tp}")

    @property
    def world_size(self) -> int:
        return self.train_size + self.rollout_size

    @property
    def replicas(self) -> int:
        return self.rollout_size // self.rollout_tp

    def is_rollout(self, rank: int) -> bool:
        return rank >= self.train_size

    def replica_of(self, rank: int) -> int:
        return (rank - self.train_size) // self.rollout_tp

    def replica_leader(self, replica: int) -> int:
        """The global rank that speaks for a rollout replica (its first rank)."""
        return self.train_size + replica * self.rollout_tp

    @property
    def rollout_ranks(self) -> list[int]:
        return list(range(self.train_size, self.world_size))


class Link:
    """A process group over chosen global ranks, built from the launcher's store (it may cross the pools'
    default groups). Only its members construct it. Operations take global ranks."""

    def __init__(self, store, name: str, ranks: Sequence[int], rank: int, backend: str,
                 timeout: datetime.timedelta):
        self.ranks = list(ranks)
        self.rank = rank
        self.local = {g: i for i, g in enumerate(self.ranks)}
        prefixed = dist.PrefixStore(f"link/{name}", store)
        me, size = self.local[rank], len(self.ranks)
        if backend == "nccl":  # the current CUDA device must be this rank's (init_pools sets it first)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            opts.global_ranks_in_group = self.ranks
            opts.group_name = f"link/{name}"
            self.pg = dist.ProcessGroupNCCL(prefixed, me, size, opts)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, me, size, timeout)
            self.device = torch.device("cpu")
        self.backend = backend

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = self.local[src], 0
        self.pg.broadcast([tensor], opts).wait()

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """`obj` of rank `src` on every member (two broadcasts: the length, then the pickled bytes)."""
        if self.rank == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        size_dev = size.to(self.device)
        self.broadcast(size_dev, src)
        if self.rank != src:
            data = torch.empty(int(size_dev.item()), dtype=torch.uint8)
        buf = data.to(self.device)
        self.broadcast(buf, src)
        return obj if self.rank == src else pickle.loads(buf.cpu().numpy().tobytes())

    def send(self, tensor: torch.Tensor, dst: int, tag: int):
        """Asynchronous: returns the work (keep `tensor` alive until `work.wait()` or `is_completed()`)."""
        return self.pg.send([tensor], self.local[dst], tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        self.pg.recv([tensor], self.local[src], tag).wait()


def pack(obj: Any) -> torch.Tensor:
    """An object as a uint8 CPU tensor (what the bus sends)."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def unpack(t: torch.Tensor) -> Any:
    return pickle.loads(t.numpy().tobytes())


class Mailbox:
    """An append-only message stream in the launcher's store: any member puts, one reader takes in order.

    `put` numbers messages with the store's atomic counter, so several writers may share a mailbox; the reader
    keeps its cursor (part of its state, so a reader can be checkpointed) and deletes what it has read."""

    def __init__(self, store, name: str):
        self.store, self.name = store, name
        self.cursor = 0  # messages read

    def put(self, obj: Any) -> None:
        i = self.store.add(f"mb/{self.name}/n", 1)  # 1-based
        self.store.set(f"mb/{self.name}/{i}", pickle.dumps(obj))

    def _key(self) -> str:
        return f"mb/{self.name}/{self.cursor + 1}"

    def poll(self) -> list[Any]:
        """Every message available now (never blocks)."""
        out = []
        while self.store.check([self._key()]):
            out.append(self._take())
        return out

    def get(self, timeout_s: float = 1800.0) -> Any:
        """The next message, waiting for it up to `timeout_s`."""
        self.store.wait([self._key()], datetime.timedelta(seconds=timeout_s))
        return self._take()

    def _take(self) -> Any:
        key = self._key()
        obj = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        self.cursor += 1
        return obj


class IdleBackoff:
    """The sleep of a polling loop's idle turns: `first_s`, doubled at each idle turn in a row up to `max_s`, back
    to `first_s` after a busy one (`reset`). An idle replica polls its mailbox (a store round trip, which costs the
    store's process CPU too) at 50 Hz instead of 500, while a burst of work still sees its next command within a
    millisecond."""

    def __init__(self, first_s: float = 0.001, max_s: float = 0.02):
        self.first_s, self.max_s = first_s, max_s
        self.next_s = first_s

    def wait(self) -> float:
        """Sleep this idle turn's time and lengthen the next; returns the seconds slept."""
        t0 = time.perf_counter()
        time.sleep(self.next_s)
        self.next_s = min(self.next_s * 2, self.max_s)
        return time.perf_counter() - t0

    def reset(self) -> None:
        self.next_s = self.first_s


@dataclass
class Pools:
    """What a rank of an asynchronous run holds: the layout, its role, the store and the cross-pool links."""

    layout: PoolLayout
    rank: int  # global
    store: Any
    bus: Link
    weights: Optional[Link]  # None on training ranks other than 0

    @property
    def is_rollout(self) -> bool:
        return self.layout.is_rollout(self.rank)

    def mailbox(self, name: str) -> Mailbox:
        return Mailbox(self.store, name)


def init_pools(layout: PoolLayout, device: torch.device, timeout_minutes: int = 30) -> Pools:
    """Join this rank's pool (its default process group) and the cross-pool links. Call before
    :func:`rlhf_mcore.parallel.init_distributed`, which then builds Megatron's groups inside the training pool."""
    if dist.is_initialized():
        raise RuntimeError("init_pools must run before torch.distributed is initialised.")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != layout.world_size:
        raise ValueError(f"{world} processes launched for a layout of {layout.world_size}")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rollout = layout.is_rollout(rank)
    pool_rank = rank - layout.train_size if rollout else rank
    pool_size = layout.rollout_size if rollout else layout.train_size
    dist.init_process_group(backend, store=dist.PrefixStore("rollout" if rollout else "train", store),
                            rank=pool_rank, world_size=pool_size, timeout=timeout)
    bus = Link(store, "bus", range(world), rank, "gloo", timeout)
    weights = None
    members = [0] + layout.rollout_ranks
    if rank in members:
        weights = Link(store, "weights", members, rank, backend, timeout)
    return Pools(layout, rank, store, bus, weights)
