"""Weight sync by broadcast: one source rank (training) to a group of rollout ranks.

For rollout engines on other GPUs than the trainer (the asynchronous trainers' rollout pool). The two ends
speak through a *comm*, anything with

    comm.broadcast(tensor, src)          # a tensor from global rank src to every member
    comm.broadcast_object(obj, src)      # a small picklable object likewise

:class:`GroupComm` wraps a `torch.distributed` group (and optionally a gloo group for the metadata);
:class:`rlhf_mcore.parallel.pools.Link` is a group across the asynchronous trainers' pools. Per bucket, the
source broadcasts the metadata list, then the flat buffer; the receivers reuse one buffer across buckets. A
`None` metadata entry ends the stream (with the source's checksums when it keeps them).

Every receiver gets the full HF tensors; a receiving engine with tensor parallelism takes its own slice
(`update_weights` of the native engine does), so the rollout TP size is independent of the trainer's.

:class:`StagedReceive` takes a broadcast in a background thread while the receiver goes on with other work (the
one-step-off rollout generating: `async_training.prefetch_weights`), at the cost of a second copy of the weights
on the receiver's device until they are loaded.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from rlhf_mcore import trace

from .buckets import BucketPacker, FlatBucket, NamedTensor
from .memory import MemoryTracker, tensor_nbytes
from .metrics import SyncStats
from .transport import Stopwatch, WeightReceiver, WeightSender, load_buckets_into
from .verify import ChecksumTap, EngineVerifier, compare_checksums


class GroupComm:
    """`torch.distributed` collectives: tensors over `group`, objects over `meta_group` (default `group`).
    `device`: where object collectives stage their bytes on an NCCL group."""

    def __init__(self, group, device, meta_group=None):
        self.group, self.meta_group = group, meta_group or group
        self.object_device = torch.device(device) if dist.get_backend(self.meta_group) == "nccl" \
            else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        dist.broadcast(tensor, src=src, group=self.group)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.meta_group, device=self.object_device)
        return box[0]


class BroadcastSender(WeightSender):
    """The source rank `src` (global). device: where the flat buffers live (must suit the comm: CUDA for NCCL)."""

    def __init__(self, comm, src: int, bucket_bytes: int, device, *, tracker: MemoryTracker | None = None,
                 checksums: bool = False):
        self.comm, self.src = comm, src
        self.device = torch.device(device)
        self.bucket_bytes, self.checksums = bucket_bytes, checksums
        self.tracker = tracker or MemoryTracker(self.device)
        self.stats = SyncStats()

    def send(self, named_tensors: Iterable[NamedTensor]) -> SyncStats:
        tap = ChecksumTap() if self.checksums else None
        stream = tap.wrap(named_tensors) if tap else named_tensors
        packer = BucketPacker(self.bucket_bytes, self.device, wrap_large=True, tracker=self.tracker)
        for s, bucket in trace.each("weight bucket", packer.buckets(stream)):  # its export, packing and broadcast
            self.stats.add_group(bucket.unpack())
            self.comm.broadcast_object((bucket.metas, bucket.nbytes), self.src)
            self.comm.broadcast(bucket.buffer, self.src)
            s.args.update(tensors=len(bucket.metas), bytes=sum(m.nbytes for m in bucket.metas))
            del bucket
        packer.release()
        self.comm.broadcast_object((None, tap.sums if tap else None), self.src)
        self.stats.peak_extra_bytes = self.tracker.peak
        return self.stats


class BroadcastReceiver(WeightReceiver):
    """A receiving rank. src: the source's global rank. device: where received buffers live.
    verify: compare checksums with the source's (needs checksums=True there)."""

    def __init__(self, comm, src: int, device, *, tracker: MemoryTracker | None = None, verify: bool = False):
        self.comm, self.src = comm, src
        self.device = torch.device(device)
        self.verify = verify
        self.tracker = tracker or MemoryTracker(self.device)
        self.stats = SyncStats()

    def receive_buckets(self, keep: bool = False) -> Iterator[list[NamedTensor]]:
        """The stream's buckets in order. keep: every bucket in a buffer of its own (the groups stay valid after
        the next one arrives: a staged receive); else one buffer reused, each group valid until the next."""
        tap = ChecksumTap() if self.verify else None
        buffer = None
        while True:
            metas, extra = self.comm.broadcast_object(None, self.src)
            if metas is None:
                sent_sums = extra
                break
            size = extra
            if keep or buffer is None or buffer.numel() < size:
                buffer = None
                buffer = self.tracker.track_storage(torch.empty(size, dtype=torch.uint8, device=self.device))
            view = buffer[:size]
            self.comm.broadcast(view, self.src)
            group = FlatBucket(view, metas).unpack()
            self.stats.add_group(group)
            if tap is not None:
                group = list(tap.wrap(group))
            yield group
            del group, view
        del buffer
        self.stats.peak_extra_bytes = self.tracker.peak
        if tap is not None:
            if sent_sums is None:
                raise RuntimeError("BroadcastReceiver(verify=True) but the source sent no checksums; create the "
                                   "BroadcastSender with checksums=True.")
            compare_checksums(sent_sums, tap.sums)


def broadcast_weights(comm, src: int, named_tensors: Iterable[NamedTensor], *, bucket_mb: float, device,
                      checksums: bool = False) -> dict[str, float]:
    """The source's side of a weight broadcast; returns `sync/*` metrics."""
    from .buckets import bucket_bytes_from_mb

    sender = BroadcastSender(comm, src, bucket_bytes_from_mb(bucket_mb), device, checksums=checksums)
    with Stopwatch(sender.device) as watch:
        stats = sender.send(named_tensors)
    stats.seconds = watch.seconds
    return stats.as_metrics()


class StagedReceive:
    """The next broadcast from `src`, taken by a thread into buffers of its own while the caller goes on;
    `load_into(engine)` waits for the thread and loads the buckets as :func:`receive_weights` does.

    The thread uses only `comm` (a group no other thread of this process uses meanwhile) and, on CUDA, a stream
    of its own: its copies neither wait for nor delay the caller's kernels. Until `load_into`, the receiver holds
    the whole stream (`sync/peak_extra_bytes`: a second copy of the weights)."""

    def __init__(self, comm, src: int, *, device, verify: bool = False, **trace_args: Any):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the caller's device (a new thread starts on 0)
            device = torch.device("cuda", torch.cuda.current_device())
        self.receiver = BroadcastReceiver(comm, src, device, verify=verify)
        self.trace_args = trace_args  # the receive's span ("receive weights", on the thread's own track)
        self.groups: list[list[NamedTensor]] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._receive, name="staged weight receive", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        device, stream = self.receiver.device, None
        try:  # everything: an error here must reach load_into, never leave it loading nothing
            if device.type == "cuda":
                torch.cuda.set_device(device)  # a new thread starts on device 0
                stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                with trace.span("receive weights", staged=True, **self.trace_args) as watch:
                    for b, group in trace.each("weight bucket", self.receiver.receive_buckets(keep=True)):
                        b.args.update(tensors=len(group), bytes=sum(tensor_nbytes(t) for _, t in group))
                        self.groups.append(group)
                    if stream is not None:
                        stream.synchronize()
            self.receiver.stats.receive_seconds = watch.seconds
        except BaseException as e:  # noqa: BLE001 - re-raised by load_into, in the caller's thread
            self.error = e

    def load_into(self, engine, *, verify: bool = False) -> dict[str, float]:
        """Wait for the whole stream, then load it into `engine` (checked against what arrived when `verify`);
        returns `sync/*` metrics: `seconds` is the load's, `receive_seconds` the background receive's."""
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"the staged weight receive failed: {type(self.error).__name__}: {self.error}") \
                from self.error
        groups, self.groups = self.groups, []
        verifier = EngineVerifier(engine) if verify else None
        buckets = (list(verifier.wrap(g)) for g in groups) if verifier is not None else iter(groups)
        with Stopwatch(self.receiver.device) as watch:
            finished = load_buckets_into(engine, buckets)
        del groups, buckets
        stats = self.receiver.stats
        stats.seconds = watch.seconds
        if verifier is not None:
            with Stopwatch(self.receiver.device) as check:
                verifier.verify()
            stats.verify_seconds = verifier.seconds + check.seconds
        return {**stats.as_metrics(), **{f"sync/{k}": v for k, v in finished.items()}}


def receive_weights(comm, src: int, engine, *, device, verify: bool = False) -> dict[str, float]:
    """A receiver's side: every bucket into `engine.update_weights`; returns `sync/*` metrics.
    verify: the received bytes are checked against the source's checksums, then the engine is read back and
    checked against what it received (`verify.EngineVerifier`, as the colocated sync does)."""
    receiver = BroadcastReceiver(comm, src, device, verify=verify)
    verifier = EngineVerifier(engine) if verify else None
    buckets = receiver.receive_buckets()
    if verifier is not None:
        buckets = (list(verifier.wrap(group)) for group in buckets)
    with Stopwatch(receiver.device) as watch:
        finished = load_buckets_into(engine, buckets)
    receiver.stats.seconds = watch.seconds
    if verifier is not None:
        with Stopwatch(receiver.device) as check:
            verifier.verify()
        receiver.stats.verify_seconds = verifier.seconds + check.seconds
    return {**receiver.stats.as_metrics(), **{f"sync/{k}": v for k, v in finished.items()}}
