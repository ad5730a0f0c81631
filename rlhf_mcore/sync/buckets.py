"""Buckets: named tensors grouped up to a byte budget, and packed into one flat byte buffer when they travel.

Two steps, kept apart because the in-process transport only needs the first:

1. `group_by_bytes(named_tensors, bucket_bytes)` cuts the stream into consecutive groups whose tensors add
   up to at most `bucket_bytes`; a tensor larger than the budget travels alone. While group k is consumed
   the producer has already pulled (at most) the first tensor of group k+1, so a sync holds at most
   `bucket_bytes + largest tensor` of exported tensors at a time.
2. `FlatBucket.pack(group)` copies a group into one flat `uint8` buffer (offsets aligned to `ALIGN` bytes so
   every dtype can be viewed in place) plus a small metadata list of `TensorMeta(name, dtype, shape,
   offset)`. One buffer means one CUDA IPC handle / shared-memory segment / collective per bucket.
   `FlatBucket.unpack()` returns views into the buffer: no copy on the receiving side. A group of one
   contiguous tensor is wrapped, not copied (`FlatBucket.wrap`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from .memory import tensor_nbytes

ALIGN = 256  # bytes; >= every element size, and the alignment GPU copy kernels like

NamedTensor = tuple[str, torch.Tensor]


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def bucket_bytes_from_mb(bucket_mb: float) -> int:
    """`bucket_mb` (MiB, may be fractional) -> bytes, rounded up to `ALIGN`; ValueError when not positive."""
    if not isinstance(bucket_mb, (int, float)) or bucket_mb <= 0:
        raise ValueError(f"bucket_mb={bucket_mb!r}: the weight-sync bucket size must be a positive number of MiB "
                         "(config key actor_rollout_ref.rollout.sync_bucket_mb; 512 is a good default on GPU).")
    return align_up(max(1, int(bucket_mb * 1024 * 1024)))


def group_by_bytes(named_tensors: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Consecutive groups of (name, tensor) with at most `bucket_bytes` in total (one larger tensor: alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive.")
    group: list[NamedTensor] = []
    size = 0
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight sync got {type(tensor).__name__} for {name!r}; expected (name, torch.Tensor).")
        n = tensor_nbytes(tensor)
        if group and size + n > bucket_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += n
    if group:
        yield group


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a flat bucket buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the buffer

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * torch.empty((), dtype=self.dtype).element_size()


def plan_layout(group: list[NamedTensor]) -> tuple[list[TensorMeta], int]:
    """Metadata for packing `group` back to back at `ALIGN`-ed offsets, and the buffer size in bytes."""
    metas, offset = [], 0
    for name, t in group:
        metas.append(TensorMeta(name, t.dtype, tuple(t.shape), offset))
        offset = align_up(offset + tensor_nbytes(t))
    return metas, offset


def view_in(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The tensor `meta` describes, as a view into the flat uint8 `buffer`."""
    return buffer[meta.offset:meta.offset + meta.nbytes].view(meta.dtype).view(meta.shape)


@dataclass
class FlatBucket:
    """A flat uint8 buffer (N,) and the tensors packed in it."""

    buffer: torch.Tensor  # (N,) uint8
    metas: list[TensorMeta]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @classmethod
    def wrap(cls, name: str, tensor: torch.Tensor) -> "FlatBucket":
        """A one-tensor bucket that shares the tensor's memory (no copy); the tensor must be contiguous."""
        if not tensor.is_contiguous():
            raise ValueError(f"FlatBucket.wrap({name!r}): the tensor is not contiguous; use FlatBucket.pack.")
        return cls(tensor.reshape(-1).view(torch.uint8), [TensorMeta(name, tensor.dtype, tuple(tensor.shape), 0)])

    @classmethod
    def pack(cls, group: list[NamedTensor], buffer: torch.Tensor | None = None,
             device: torch.device | str | None = None) -> "FlatBucket":
        """Copy `group` into `buffer` (uint8, at least the planned size; allocated on `device` when None)."""
        metas, size = plan_layout(group)
        if buffer is None:
            buffer = torch.empty(size, dtype=torch.uint8, device=device or group[0][1].device)
        elif buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < size:
            raise ValueError(f"FlatBucket.pack: buffer must be a 1-D uint8 tensor of >= {size} bytes, got "
                             f"{buffer.dtype} {tuple(buffer.shape)}.")
        buffer = buffer[:size]
        with torch.no_grad():
            for meta, (_, t) in zip(metas, group):
                view_in(buffer, meta).copy_(t, non_blocking=True)
        return cls(buffer, metas)

    def unpack(self) -> list[NamedTensor]:
        """(name, view) for every tensor; the views alias the buffer (valid while the buffer is)."""
        return [(m.name, view_in(self.buffer, m)) for m in self.metas]


class BucketPacker:
    """Packs a (name, tensor) stream into flat buckets, copying each tensor into one reusable buffer as it
    arrives (so the exporter can free it at once): the packer holds about one bucket, never a group of
    references plus a buffer.

    bucket_bytes: the bucket budget. device: where buffers live (None: the first tensor's device).
    share_memory: CPU buffers go to shared memory (handed to another process).
    wrap_large: a tensor larger than the budget travels alone without a copy (`FlatBucket.wrap`) when it is
      contiguous, on `device` and — with share_memory — on a GPU (CUDA IPC) or already shared; otherwise it
      is copied into a buffer of its size.
    tracker: a `MemoryTracker` told about every buffer allocated and every tensor wrapped.

    Each yielded bucket aliases the shared buffer: the transport must be done with it before resuming the
    generator (send, then wait for the receiver's acknowledgement or the collective).
    """

    def __init__(self, bucket_bytes: int, device: torch.device | str | None = None, *, share_memory: bool = False,
                 wrap_large: bool = False, tracker=None):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive.")
        self.capacity = align_up(bucket_bytes)
        self.device = torch.device(device) if device is not None else None
        self.share_memory, self.wrap_large, self.tracker = share_memory, wrap_large, tracker
        self._buffer: torch.Tensor | None = None

    def _buffer_of(self, size: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = None  # free the smaller one first: never two buffers at once
            buf = torch.empty(max(size, self.capacity), dtype=torch.uint8, device=self.device)
            if self.share_memory and buf.device.type == "cpu":
                buf.share_memory_()
            if self.tracker is not None:
                self.tracker.track_storage(buf)
            self._buffer = buf
        return self._buffer

    def _can_wrap(self, t: torch.Tensor) -> bool:
        shareable = not self.share_memory or t.is_cuda or t.is_shared()
        return self.wrap_large and t.is_contiguous() and t.device == self.device and shareable

    def release(self) -> None:
        """Drop the reusable buffer (it is freed once the last bucket view of it is gone)."""
        self._buffer = None

    def buckets(self, named_tensors: Iterable[NamedTensor]) -> Iterator[FlatBucket]:
        metas: list[TensorMeta] = []
        offset = 0
        buf = None
        for name, t in named_tensors:
            if self.device is None:
                self.device = t.device
            n = tensor_nbytes(t)
            if metas and offset + n > self.capacity:
                yield FlatBucket(buf[:offset], metas)
                metas, offset = [], 0
            if not metas and n > self.capacity and self._can_wrap(t):
                if self.tracker is not None:
                    self.tracker.track_reference(t)
                yield FlatBucket.wrap(name, t)
                continue
            buf = None  # the previous bucket's buffer must not outlive a reallocation
            buf = self._buffer_of(max(self.capacity, align_up(n)))
            meta = TensorMeta(name, t.dtype, tuple(t.shape), offset)
            with torch.no_grad():
                view_in(buf, meta).copy_(t)
            metas.append(meta)
            offset = align_up(offset + n)
        if metas:
            yield FlatBucket(buf[:offset], metas)
