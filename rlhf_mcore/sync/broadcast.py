"""Weight sync by collective broadcast: one source rank (training) to a group of rollout ranks.

For rollout engines on other GPUs than the trainer (one-step-off-policy and asynchronous training): the
group holds the source rank and the receiving ranks. Per bucket, the source broadcasts the small metadata
list (`broadcast_object_list`, over `meta_group` if given, e.g. a gloo group, else over `group`) and then
the flat buffer (`dist.broadcast`); the receivers reuse one buffer across buckets. A `None` metadata entry
ends the stream (with the source's checksums when it keeps them).

Every receiver gets the full HF tensors; a receiving engine with tensor parallelism takes its own slice
(`update_weights` of the native engine does), so the rollout TP size is independent of the trainer's.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from .buckets import BucketPacker, FlatBucket, NamedTensor
from .memory import MemoryTracker
from .metrics import SyncStats
from .transport import WeightReceiver, WeightSender
from .verify import ChecksumTap, compare_checksums


def _broadcast_object(obj, src: int, group, device):
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    return box[0]


def _object_device(group, device: torch.device):
    """broadcast_object_list on an NCCL group needs the CUDA device; on gloo, the CPU."""
    backend = dist.get_backend(group)
    return device if backend == "nccl" else torch.device("cpu")


class BroadcastSender(WeightSender):
    """The source rank. group: the process group of source + receivers; src defaults to this rank.
    device: where the flat buffers live (must suit the group's backend: CUDA for NCCL)."""

    def __init__(self, group, bucket_bytes: int, device, *, meta_group=None, tracker: MemoryTracker | None = None,
                 checksums: bool = False):
        self.group, self.meta_group = group, meta_group or group
        self.src = dist.get_rank()
        self.device = torch.device(device)
        self.bucket_bytes, self.checksums = bucket_bytes, checksums
        self.tracker = tracker or MemoryTracker(self.device)
        self.stats = SyncStats()

    def send(self, named_tensors: Iterable[NamedTensor]) -> SyncStats:
        tap = ChecksumTap() if self.checksums else None
        stream = tap.wrap(named_tensors) if tap else named_tensors
        packer = BucketPacker(self.bucket_bytes, self.device, wrap_large=True, tracker=self.tracker)
        meta_dev = _object_device(self.meta_group, self.device)
        for bucket in packer.buckets(stream):
            self.stats.add_group(bucket.unpack())
            _broadcast_object((bucket.metas, bucket.nbytes), self.src, self.meta_group, meta_dev)
            dist.broadcast(bucket.buffer, src=self.src, group=self.group)
            del bucket
        packer.release()
        _broadcast_object((None, tap.sums if tap else None), self.src, self.meta_group, meta_dev)
        self.stats.peak_extra_bytes = self.tracker.peak
        return self.stats


class BroadcastReceiver(WeightReceiver):
    """A receiving rank. src: the source's global rank. device: where received buffers live.
    verify: compare checksums with the source's (needs checksums=True there)."""

    def __init__(self, group, src: int, device, *, meta_group=None, tracker: MemoryTracker | None = None,
                 verify: bool = False):
        self.group, self.meta_group, self.src = group, meta_group or group, src
        self.device = torch.device(device)
        self.verify = verify
        self.tracker = tracker or MemoryTracker(self.device)
        self.stats = SyncStats()

    def receive_buckets(self) -> Iterator[list[NamedTensor]]:
        tap = ChecksumTap() if self.verify else None
        meta_dev = _object_device(self.meta_group, self.device)
        buffer = None
        while True:
            metas, extra = _broadcast_object(None, self.src, self.meta_group, meta_dev)
            if metas is None:
                sent_sums = extra
                break
            size = extra
            if buffer is None or buffer.numel() < size:
                buffer = None
                buffer = self.tracker.track_storage(torch.empty(size, dtype=torch.uint8, device=self.device))
            view = buffer[:size]
            dist.broadcast(view, src=self.src, group=self.group)
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
