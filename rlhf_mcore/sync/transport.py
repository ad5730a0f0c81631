"""The transport interface, the in-process (colocated) transport, and feeding received buckets to an engine.

Every transport has two ends:

    sender.send(named_tensors)            # training side: an iterable of (hf_name, full tensor)
    for group in receiver.receive_buckets():   # rollout side: lists of (hf_name, tensor), one per bucket
        engine.update_weights(group)
    # or receiver.receive(): a flat (hf_name, tensor) generator

Received tensors are only valid until the next bucket is requested (they may alias a reused buffer): a
consumer copies what it keeps (rollout engines copy into their own weights). Both ends keep `stats`
(`SyncStats`: bytes, buckets, tensors, peak extra bytes).

Transports: `InProcessChannel` (here; colocated, zero-copy), `ipc.IpcChannel` (CUDA IPC / shared memory to
another process), `broadcast.BroadcastSender/Receiver` (a collective over a process group).
"""
from __future__ import annotations

import abc
import time
from typing import Iterable, Iterator

import torch

from rlhf_mcore import trace

from .buckets import NamedTensor, group_by_bytes
from .memory import MemoryTracker, tensor_nbytes
from .metrics import SyncStats


class WeightReceiver(abc.ABC):
    """The rollout side of a transport."""

    stats: SyncStats

    @abc.abstractmethod
    def receive_buckets(self) -> Iterator[list[NamedTensor]]:
        """One list of (hf_name, tensor) per bucket, valid until the next one is requested."""

    def receive(self) -> Iterator[NamedTensor]:
        """The received tensors one by one (valid until the generator moves past their bucket)."""
        for group in self.receive_buckets():
            yield from group
            del group


class WeightSender(abc.ABC):
    """The training side of a transport."""

    stats: SyncStats

    @abc.abstractmethod
    def send(self, named_tensors: Iterable[NamedTensor]) -> SyncStats:
        """Send every (hf_name, tensor); returns this end's statistics."""


class InProcessChannel(WeightSender, WeightReceiver):
    """Colocated transport: the rollout engine lives in the training process, so nothing is copied.

    `send` hands the stream over and returns at once; `receive_buckets` pulls it, grouping references to the
    exported tensors up to `bucket_bytes` (see `buckets.group_by_bytes`), so the engine gets a handful of
    `update_weights` calls and the sync holds at most `bucket_bytes` + one tensor of exported tensors.
    """

    def __init__(self, bucket_bytes: int, tracker: MemoryTracker | None = None):
        self.bucket_bytes = bucket_bytes
        self.tracker = tracker or MemoryTracker()
        self.stats = SyncStats()
        self._source: Iterable[NamedTensor] | None = None

    def send(self, named_tensors: Iterable[NamedTensor]) -> SyncStats:
        if self._source is not None:
            raise RuntimeError("InProcessChannel.send called twice before the first stream was received.")
        self._source = named_tensors
        return self.stats

    def _tracked(self) -> Iterator[NamedTensor]:
        for name, t in self._source:
            yield name, self.tracker.track_reference(t)

    def receive_buckets(self) -> Iterator[list[NamedTensor]]:
        if self._source is None:
            raise RuntimeError("InProcessChannel.receive_buckets before send(): nothing to receive.")
        try:
            for group in group_by_bytes(self._tracked(), self.bucket_bytes):
                self.stats.add_group(group)
                yield group
                del group  # before the next group fills: at most one group alive
        finally:
            self._source = None
        self.stats.peak_extra_bytes = max(self.stats.peak_extra_bytes, self.tracker.peak)


def load_buckets_into(engine, buckets: Iterable[list[NamedTensor]]) -> dict[str, float]:
    """Call `engine.update_weights` once per bucket, dropping each bucket before the next arrives, then the
    engine's `finish_weight_update` (where it has one); returns that call's metrics (unprefixed). Each bucket is a
    span of the run's trace ("weight bucket": its arrival -- the export's work, or the broadcast -- and its load)."""
    for s, group in trace.each("weight bucket", buckets):
        engine.update_weights(group)
        s.args.update(tensors=len(group), bytes=sum(tensor_nbytes(t) for _, t in group))
        del group
    finish = getattr(engine, "finish_weight_update", None)
    return dict(finish()) if finish is not None else {}


def device_synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Wall time of a block, with the device drained at both ends so queued GPU work is counted."""

    def __init__(self, device: torch.device | None):
        self.device = device
        self.seconds = 0.0

    def __enter__(self) -> "Stopwatch":
        device_synchronize(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        device_synchronize(self.device)
        self.seconds = time.perf_counter() - self._t0
