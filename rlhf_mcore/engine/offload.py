"""Moving a training engine's parameters, gradients and optimizer state off the device and back.

Colocated RL shares one GPU between training and generation: while the rollout runs, the trainer's optimizer
state (12 bytes a parameter with fp32 master weights and Adam) and gradients (4 bytes) — and, when asked,
its parameters — must leave the GPU.

How: every tensor involved lives in some storage (Megatron's DDP keeps all parameters in one contiguous
`param_data` buffer and all gradients in one `grad_data` buffer per dtype; parameters and `main_grad`s are
views into them). Offloading copies a storage's bytes to host memory (pinned on CUDA, so the copy back runs
at full PCIe speed) and then resizes the device storage to zero bytes; every view keeps its shape, stride
and identity, so the optimizer's references and the autograd hooks stay valid. Onloading re-grows the
storage and copies the bytes back. Gradient buffers hold nothing between updates (each update starts by
zeroing them), so they are freed without a copy and come back zeroed.

Host memory: one arena per name (params / grads / optimizer), sized exactly to the storages it holds, allocated
once and reused on every later offload of the same storages. On CUDA it is ordinary host memory page-locked with
`cudaHostRegister`, not torch's pinned caching allocator, which rounds every block up to a power of two (a 2.2 GB
tensor takes 4 GiB): at 7B the optimizer state alone is 85 GiB, and rounded it would not fit a 128 GiB host.

On CPU machines the same code runs (host "device" = CPU): storages really are released and restored, so
tests check the round trip; the reported numbers are then bytes moved, not GPU memory.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

__all__ = ["StorageOffloader", "HostArena", "param_storages", "grad_storages", "optimizer_storages", "torch_optimizers"]

_ALIGN = 512  # bytes: every slot of an arena starts aligned (fast DMA, any dtype view)


def _unique(tensors, exclude: set[int] = frozenset()) -> list[torch.UntypedStorage]:
    seen, out = set(exclude), []
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if s.nbytes() == 0 or ptr in seen:
            continue
        seen.add(ptr)
        out.append(s)
    return out


def _ddp_buffers(chunk):
    # Megatron's DDP keeps lists `buffers` / `expert_parallel_buffers`; on a bare module (the frozen reference)
    # `buffers` is nn.Module's method
    return [b for name in ("buffers", "expert_parallel_buffers")
            if isinstance(getattr(chunk, name, None), (list, tuple)) for b in getattr(chunk, name)]


def param_storages(chunks: list[torch.nn.Module]) -> list[torch.UntypedStorage]:
    """Storages of the model parameters: the DDP param buffers where they exist, else each parameter."""
    tensors = []
    for chunk in chunks:
        covered = set()
        for buf in _ddp_buffers(chunk):
            if getattr(buf, "param_data", None) is not None:
                tensors.append(buf.param_data)
                covered.add(buf.param_data.untyped_storage().data_ptr())
        tensors += [p for p in chunk.parameters() if p.untyped_storage().data_ptr() not in covered]
    return _unique(tensors)


def grad_storages(chunks: list[torch.nn.Module]) -> list[torch.UntypedStorage]:
    """Storages of the DDP gradient buffers (plain `.grad`s where a parameter has no buffer)."""
    tensors = []
    for chunk in chunks:
        tensors += [buf.grad_data for buf in _ddp_buffers(chunk) if getattr(buf, "grad_data", None) is not None]
        tensors += [p.grad for p in chunk.parameters() if p.grad is not None]
    return _unique(tensors)


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (a chained one holds several; `None` holds none)."""
    if optimizer is None:
        return []
    if hasattr(optimizer, "chained_optimizers"):
        return [inner for o in optimizer.chained_optimizers for inner in torch_optimizers(o)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if inner is not None else []


def optimizer_storages(optimizer, exclude: set[int]) -> list[torch.UntypedStorage]:
    """Storages of the optimizer: master weights and state (Adam moments), minus `exclude` (model params)."""
    tensors = []
    for opt in torch_optimizers(optimizer):
        for group in opt.param_groups:
            tensors += list(group["params"])
        for state in opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return _unique(tensors, exclude)


class HostArena:
    """Exact-size host memory for a list of byte counts: one allocation, one aligned slot per entry.

    `pin=True` page-locks it with `cudaHostRegister` (asynchronous, full-speed copies) and unregisters it when
    the arena is freed; if registering fails it warns and stays pageable (copies are then synchronous)."""

    def __init__(self, sizes: list[int], pin: bool):
        self.sizes = list(sizes)
        self.offsets, total = [], 0
        for n in self.sizes:
            self.offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        self.buffer = torch.empty(max(total, 1), dtype=torch.uint8)  # (total,) pageable, exact size
        self.pinned = False
        if pin and total:
            err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
            code = getattr(err, "value", err)
            if code == 0:
                self.pinned = True
            else:
                warnings.warn(f"cudaHostRegister of {total / 2**30:.1f} GiB failed (cudaError {code}); offloading "
                              "through pageable host memory (slower copies)", stacklevel=3)

    def slot(self, i: int) -> torch.Tensor:
        """(sizes[i],) uint8 view of slot i."""
        return self.buffer.narrow(0, self.offsets[i], self.sizes[i])

    def __del__(self):
        if getattr(self, "pinned", False):
            try:
                torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to clean up
                pass


@dataclass
class _Parked:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # uint8 copy of the bytes (a slot of the name's arena); None: restore as zeros


@dataclass
class StorageOffloader:
    """Parks storages on the host by name ("params", "grads", "optimizer") and brings them back."""

    device: torch.device
    parked: dict[str, list[_Parked]] = field(default_factory=dict)
    arenas: dict[str, HostArena] = field(default_factory=dict)  # kept across offloads: allocated (and pinned) once

    def offload(self, name: str, storages: list[torch.UntypedStorage], keep_data: bool = True) -> int:
        """Release `storages` from the device (keeping a host copy when `keep_data`); returns bytes released."""
        if name in self.parked:
            return 0  # already offloaded
        pin = self.device.type == "cuda"
        storages = [s for s in storages if s.nbytes() and not (pin and s.device.type != "cuda")]
        sizes = [s.nbytes() for s in storages]
        arena = None
        if keep_data:
            arena = self.arenas.get(name)
            if arena is None or arena.sizes != sizes:
                self.arenas.pop(name, None)  # free the old one before allocating its replacement
                arena = self.arenas[name] = HostArena(sizes, pin)
        parked, total = [], 0
        for i, s in enumerate(storages):
            host = None
            if arena is not None:
                host = arena.slot(i)
                host.copy_(torch.empty(0, dtype=torch.uint8, device=s.device).set_(s), non_blocking=arena.pinned)
            parked.append(_Parked(s, s.nbytes(), host))
            total += s.nbytes()
        if pin:
            torch.cuda.synchronize(self.device)  # the copies must land before the device memory is reused
        for p in parked:
            p.storage.resize_(0)
        self.parked[name] = parked
        return total

    def onload(self, name: str) -> int:
        """Re-allocate the storages parked as `name` and restore their bytes (or zeros); returns bytes."""
        parked = self.parked.pop(name, [])
        total = 0
        for p in parked:
            p.storage.resize_(p.nbytes)
            if p.host is not None:
                torch.empty(0, dtype=torch.uint8, device=p.storage.device).set_(p.storage).copy_(
                    p.host, non_blocking=True)
            else:
                torch.empty(0, dtype=torch.uint8, device=p.storage.device).set_(p.storage).zero_()
            total += p.nbytes
        if self.device.type == "cuda" and parked:
            torch.cuda.synchronize(self.device)
        return total

    def is_offloaded(self, name: str) -> bool:
        return name in self.parked
