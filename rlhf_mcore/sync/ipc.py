"""Weight sync to another process on the same machine: CUDA IPC for GPU buffers, shared memory for CPU ones.

The sender packs the stream into one reusable flat buffer (`buckets.BucketPacker`; in shared memory on CPU)
and puts `(buffer, metadata)` on a `torch.multiprocessing` queue. torch's multiprocessing reductions turn a
CUDA tensor into an IPC handle and a shared CPU tensor into a file descriptor, so no tensor bytes go through
the queue. The receiver rebuilds the buffer (mapping the same memory), yields views of the bucket's tensors,
and acknowledges once its consumer is done; only then does the sender overwrite the buffer with the next
bucket. So about one bucket is alive on each side, and each bucket costs one handle, not one per tensor.

This is the mechanism an out-of-process inference server (SGLang's `update_weights_from_tensor`) relies on;
`serialize_bucket` / `deserialize_bucket` give the same handles as bytes for channels other than a queue.

    channel = IpcChannel()                      # in the parent, before starting the rollout process
    Process(target=rollout_main, args=(channel,)).start()
    channel.sender(bucket_bytes).send(exported) # training process
    for group in channel.receiver().receive_buckets(): engine.update_weights(group)   # rollout process
"""
from __future__ import annotations

import io
import pickle
import queue as queue_mod
from typing import Iterable, Iterator

import torch
import torch.multiprocessing as mp

from .buckets import BucketPacker, FlatBucket, NamedTensor
from .memory import MemoryTracker
from .metrics import SyncStats
from .transport import WeightReceiver, WeightSender
from .verify import ChecksumTap, compare_checksums

_BUCKET, _END, _ACK = "bucket", "end", "ack"


def serialize_bucket(bucket: FlatBucket) -> bytes:
    """Bytes carrying a CUDA IPC handle (or shared-memory descriptor) of the bucket's buffer, plus metadata.
    The sender must keep the buffer alive until the receiver has used it."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump((bucket.buffer, bucket.metas))
    return buf.getvalue()


def deserialize_bucket(data: bytes) -> FlatBucket:
    buffer, metas = pickle.loads(data)
    return FlatBucket(buffer, metas)


class IpcChannel:
    """Two queues (buckets one way, acknowledgements the other); picklable into a spawned process.

    Create it before starting the other process, from the multiprocessing context that starts it
    (default: "spawn", required for CUDA).
    """

    def __init__(self, context=None, timeout_s: float = 600.0):
        ctx = context or mp.get_context("spawn")
        self.data = ctx.Queue()
        self.acks = ctx.Queue()
        self.timeout_s = timeout_s

    def sender(self, bucket_bytes: int, device=None, tracker: MemoryTracker | None = None,
               checksums: bool = False) -> "IpcSender":
        return IpcSender(self, bucket_bytes, device, tracker, checksums)

    def receiver(self, verify: bool = False) -> "IpcReceiver":
        return IpcReceiver(self, verify)


def _get(q, timeout_s: float, waiting_for: str):
    try:
        return q.get(timeout=timeout_s)
    except queue_mod.Empty:
        raise TimeoutError(f"weight sync over IPC: no {waiting_for} within {timeout_s:.0f} s; is the other "
                           "process alive and running its side of the sync?") from None


class IpcSender(WeightSender):
    """Training side. device: where the buffer lives (cuda: IPC handles; cpu: shared memory; None: the
    tensors' device). checksums: send each tensor's checksum along, for a receiver with verify=True."""

    def __init__(self, channel: IpcChannel, bucket_bytes: int, device=None, tracker: MemoryTracker | None = None,
                 checksums: bool = False):
        self.channel, self.checksums = channel, checksums
        self.tracker = tracker or MemoryTracker(device)
        self.stats = SyncStats()
        self.device = torch.device(device) if device is not None else None
        self.bucket_bytes = bucket_bytes

    def send(self, named_tensors: Iterable[NamedTensor]) -> SyncStats:
        tap = ChecksumTap() if self.checksums else None
        stream = tap.wrap(named_tensors) if tap else named_tensors
        packer = BucketPacker(self.bucket_bytes, self.device, share_memory=True, wrap_large=True,
                              tracker=self.tracker)
        for bucket in packer.buckets(stream):
            if bucket.buffer.is_cuda:
                torch.cuda.current_stream(bucket.buffer.device).synchronize()  # the receiver reads on its stream
            self.stats.add_group(bucket.unpack())
            self.channel.data.put((_BUCKET, bucket.buffer, bucket.metas))
            if _get(self.channel.acks, self.channel.timeout_s, "acknowledgement from the receiver") != _ACK:
                raise RuntimeError("weight sync over IPC: unexpected message on the acknowledgement queue.")
            del bucket
        packer.release()
        self.channel.data.put((_END, tap.sums if tap else None))
        self.stats.peak_extra_bytes = self.tracker.peak
        return self.stats


class IpcReceiver(WeightReceiver):
    """Rollout side. verify: compare the checksums of what arrived with the sender's (needs checksums=True
    on the sender); raises `verify.WeightSyncError` naming the first tensor that differs."""

    def __init__(self, channel: IpcChannel, verify: bool = False):
        self.channel, self.verify = channel, verify
        self.stats = SyncStats()
        self.sent_sums: dict | None = None

    def receive_buckets(self) -> Iterator[list[NamedTensor]]:
        tap = ChecksumTap() if self.verify else None
        while True:
            kind, *payload = _get(self.channel.data, self.channel.timeout_s, "bucket from the sender")
            if kind == _END:
                self.sent_sums = payload[0]
                break
            buffer, metas = payload
            group = FlatBucket(buffer, metas).unpack()
            self.stats.add_group(group)
            if tap is not None:
                group = list(tap.wrap(group))
            yield group
            del group, buffer
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the consumer's copies out of the shared buffer are complete
            self.channel.acks.put(_ACK)
        if tap is not None:
            if self.sent_sums is None:
                raise RuntimeError("IpcReceiver(verify=True) but the sender sent no checksums; create the sender "
                                   "with checksums=True.")
            compare_checksums(self.sent_sums, tap.sums)
