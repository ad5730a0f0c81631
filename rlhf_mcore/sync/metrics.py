"""Per-sync statistics and their metric names (`sync/seconds`, `sync/bytes`, ...)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .memory import tensor_nbytes


@dataclass
class SyncStats:
    """What one weight sync moved and held.

    bytes: payload bytes of the tensors synced (not counting alignment padding).
    peak_extra_bytes: the largest number of bytes the sync held at once beyond the model (live bucket
      buffers or, in-process, the exported tensors a bucket references: an upper bound when those are views
      of parameters), see `memory.MemoryTracker`.
    cuda_peak_delta_bytes: on GPU, the allocator's peak during the sync minus what was allocated before.
    """

    seconds: float = 0.0
    bytes: int = 0
    buckets: int = 0
    tensors: int = 0
    largest_tensor_bytes: int = 0
    peak_extra_bytes: int = 0
    cuda_peak_delta_bytes: int | None = None
    verify_seconds: float = 0.0
    receive_seconds: float = 0.0  # a staged receive's (broadcast.StagedReceive) background seconds; `seconds` its load

    def add_group(self, group: list[tuple[str, torch.Tensor]]) -> None:
        """Count one bucket."""
        self.buckets += 1
        for _, t in group:
            n = tensor_nbytes(t)
            self.tensors += 1
            self.bytes += n
            self.largest_tensor_bytes = max(self.largest_tensor_bytes, n)

    def as_metrics(self, prefix: str = "sync/") -> dict[str, float]:
        out = {"seconds": self.seconds, "bytes": float(self.bytes), "buckets": float(self.buckets),
               "tensors": float(self.tensors), "largest_tensor_bytes": float(self.largest_tensor_bytes),
               "peak_extra_bytes": float(self.peak_extra_bytes),
               "gbytes_per_s": self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0}
        if self.cuda_peak_delta_bytes is not None:
            out["cuda_peak_delta_bytes"] = float(self.cuda_peak_delta_bytes)
        if self.verify_seconds:
            out["verify_seconds"] = self.verify_seconds
        if self.receive_seconds:
            out["receive_seconds"] = self.receive_seconds
        return {prefix + k: v for k, v in out.items()}
