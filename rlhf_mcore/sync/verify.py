"""Verification of a weight sync: bitwise checksums of what was sent against what arrived or was loaded.

`checksum(t)` is an integer hash of a tensor's bytes (order-sensitive, exact: integer arithmetic only, so
the same bytes give the same value on any device and in any reduction order). Two checks use it:

  - transport check: the sender records the checksum of every tensor it sends (`ChecksumTap`), the receiver
    of every tensor it received; `compare_checksums` names the first tensor that differs;
  - engine check (`EngineVerifier`): while the exported tensors stream by, record the checksum of the slice
    the rollout engine should hold, cast to the engine's dtype; after the sync, read the engine's weights
    back (`readback.engine_hf_shards`) and compare. A mismatch raises `WeightSyncError` naming the tensor.

Cost: one extra pass over the weights in 32-bit words widened to int64, in slabs of `_SLAB_WORDS` words, so
memory stays bounded; meant for debugging and tests (`actor_rollout_ref.rollout.sync_verify=true`).
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch

from .readback import HeldShard, engine_hf_shards

CHECKSUM_ROW = 1 << 15         # words per row: |word| < 2^31, weights <= 2^15, 2^15 terms -> row sums < 2^61
_SLAB_WORDS = 1 << 23  # words widened to int64 at a time (64 MiB)
CHECKSUM_MOD = (1 << 61) - 1


class WeightSyncError(RuntimeError):
    """A synced tensor differs from what was exported (or is missing); the message names it."""

    def __init__(self, name: str, detail: str):
        self.name = name
        super().__init__(f"weight sync verification failed for {name!r}: {detail}")


def _words(flat: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous 1-D tensor as int32 (4- and 8-byte dtypes), int16 or uint8 words."""
    size = flat.element_size()
    if size >= 4:
        return flat.view(torch.int32)
    return flat.view(torch.int16 if size == 2 else torch.uint8)


def checksum(t: torch.Tensor) -> int:
    """Exact, order-sensitive integer hash of `t`'s bytes (same bytes -> same value on every device)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    words = _words(flat)  # (N,)
    weights = torch.arange(1, CHECKSUM_ROW + 1, dtype=torch.int64, device=words.device)  # (ROW,)
    total = words.numel() % CHECKSUM_MOD
    for start in range(0, words.numel(), _SLAB_WORDS):
        slab = words[start:start + _SLAB_WORDS].to(torch.int64)
        pad = (-slab.numel()) % CHECKSUM_ROW
        if pad:
            slab = torch.cat([slab, slab.new_zeros(pad)])
        rows = (slab.view(-1, CHECKSUM_ROW) * weights).sum(dim=1)  # (R,) exact: < 2^61 in magnitude
        for s in rows.tolist():
            total = (total * 1_000_003 + s) % CHECKSUM_MOD
    return total


def fingerprint(t: torch.Tensor) -> tuple:
    """(dtype, shape, checksum): what two copies of a tensor must share."""
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), checksum(t)


class ChecksumTap:
    """Pass a (name, tensor) stream through unchanged, recording each tensor's fingerprint in `self.sums`."""

    def __init__(self):
        self.sums: dict[str, tuple] = {}

    def wrap(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named_tensors:
            if name in self.sums:
                raise WeightSyncError(name, "sent twice in one sync.")
            self.sums[name] = fingerprint(t)
            yield name, t


def compare_checksums(sent: dict[str, tuple], got: dict[str, tuple], where: str = "received") -> None:
    """Raise WeightSyncError naming the first tensor whose fingerprint differs, is missing or is extra."""
    for name, want in sent.items():
        if name not in got:
            raise WeightSyncError(name, f"sent but not {where}.")
        if got[name] != want:
            raise WeightSyncError(name, f"{where} (dtype, shape, checksum) {got[name]} != sent {want}.")
    extra = sorted(set(got) - set(sent))
    if extra:
        raise WeightSyncError(extra[0], f"{where} but never sent ({len(extra)} such tensors).")


class EngineVerifier:
    """Checks that a rollout engine ends a sync holding exactly (its slice of) the exported tensors.

        verifier = EngineVerifier(engine)
        engine.update_weights(verifier.wrap(exported))   # records what each engine slice should be
        verifier.verify()                                # reads the engine back; raises WeightSyncError
    """

    def __init__(self, engine):
        self.engine = engine
        self.layout: dict[str, HeldShard] = engine_hf_shards(engine)
        self.expected: dict[str, tuple] = {}
        self.seconds = 0.0  # spent fingerprinting the exported stream (inside the sync's wall time)

    def wrap(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, full in named_tensors:
            held = self.layout.get(name)
            if held is None:
                raise WeightSyncError(name, f"exported, but {type(self.engine).__name__} holds no weight of that "
                                            "name (a Hugging Face name mismatch between exporter and engine?).")
            if name in self.expected:
                raise WeightSyncError(name, "exported twice in one sync.")
            t0 = time.perf_counter()
            self.expected[name] = fingerprint(held.expected_from(full).to(held.tensor.dtype))
            self.seconds += time.perf_counter() - t0
            yield name, full

    def verify(self) -> None:
        held = engine_hf_shards(self.engine)  # again: an engine may have re-allocated its weights
        actual = {name: fingerprint(h.tensor) for name, h in held.items()}
        for name in actual:
            if name not in self.expected:
                raise WeightSyncError(name, "the rollout engine holds this weight but the sync never sent it.")
        compare_checksums(self.expected, actual, where=f"held by {type(self.engine).__name__}")
