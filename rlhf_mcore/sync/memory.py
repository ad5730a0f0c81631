"""How much memory a weight sync holds beyond the model: live bucket bytes, tracked by actual lifetime.

A `MemoryTracker` counts the bytes of what the sync engine takes hold of and uncounts them when they are
really gone, not when the code says it is done with them:

  - `track_storage(buffer)`: a buffer the sync allocated itself (a flat bucket). It counts until its storage
    is freed, i.e. until no view of it is alive anywhere (`StorageWeakRef`, checked at every `track*` call —
    the only moments live bytes can grow — and when read);
  - `track_reference(tensor)`: an exported tensor the sync merely holds (the in-process transport groups
    references, it does not copy). It counts in full until that tensor object is garbage
    (`weakref.finalize`). This is an upper bound: where the exporter yields views of live parameters
    (TP = PP = 1, no vocabulary padding) holding them costs nothing; the GPU number below is exact.

A consumer that keeps received tensors alive therefore shows up as a growing peak, which the memory tests
assert against (bucket size + the largest single tensor).

On GPU, `cuda_peak_delta()` adds the allocator's view: `torch.cuda.max_memory_allocated` during the sync minus
what was allocated when it started (`start()` resets the device's peak statistics). The peak reached before that
reset is carried over, so :func:`device_peak_bytes` (what the trainer logs as its step's peak memory) still sees it.
"""
from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_CARRIED_PEAK: dict[int, int] = {}  # device index -> the allocator's peak before a MemoryTracker reset it


def _cuda_index(device) -> int:
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    return device.index if device.index is not None else torch.cuda.current_device()


def device_peak_bytes(device=None) -> int:
    """`torch.cuda.max_memory_allocated(device)`, including any peak a sync's `MemoryTracker.start()` reset."""
    index = _cuda_index(device)
    return max(torch.cuda.max_memory_allocated(index), _CARRIED_PEAK.get(index, 0))


def reset_device_peak(device=None) -> None:
    """Start a new peak window (the carried peak too)."""
    index = _cuda_index(device)
    _CARRIED_PEAK.pop(index, None)
    torch.cuda.reset_peak_memory_stats(index)


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MemoryTracker:
    """Live and peak bytes of the buffers and references registered with it."""

    def __init__(self, device: torch.device | str | None = None):
        self._ref_bytes = 0
        self._storages: list[tuple[StorageWeakRef, int]] = []
        self.peak = 0
        self.device = torch.device(device) if device is not None else None
        self._cuda_base: int | None = None

    @property
    def live(self) -> int:
        self._sweep()
        return self._ref_bytes + sum(n for _, n in self._storages)

    def _sweep(self) -> None:
        self._storages = [(ref, n) for ref, n in self._storages if not ref.expired()]

    def _grew(self) -> None:
        self.peak = max(self.peak, self.live)

    def track_storage(self, buffer: torch.Tensor) -> torch.Tensor:
        """Count `buffer`'s bytes until its storage is freed; returns `buffer`."""
        self._storages.append((StorageWeakRef(buffer.untyped_storage()), tensor_nbytes(buffer)))
        self._grew()
        return buffer

    def track_reference(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count `tensor`'s bytes until the tensor object is garbage; returns `tensor`."""
        n = tensor_nbytes(tensor)
        self._ref_bytes += n
        weakref.finalize(tensor, self._release_reference, n)
        self._grew()
        return tensor

    def _release_reference(self, nbytes: int) -> None:
        self._ref_bytes -= nbytes

    # ----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Begin a measurement: the peak restarts from what is live now; on GPU, so does the allocator's."""
        self.peak = self.live
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            index = _cuda_index(self.device)
            _CARRIED_PEAK[index] = device_peak_bytes(index)  # the outer peak survives the reset below
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)

    def cuda_peak_delta(self) -> int | None:
        """Peak device bytes allocated since `start()` beyond what was allocated then (None off GPU)."""
        if self._cuda_base is None:
            return None
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - self._cuda_base)
