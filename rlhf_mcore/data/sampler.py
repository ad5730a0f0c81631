"""A deterministic, resumable sampler over dataset indices: the data cursor the coordinator owns.

Epoch `e` visits a permutation drawn from `numpy.random.default_rng([seed, e])` (or 0..n-1 in order without
shuffling), so the order depends only on (seed, epoch), never on process history. The state is
(epoch, position); restoring it continues mid-epoch with exactly the same indices.

Two ways to draw: `next_batch(batch_size)` (what the trainer uses: a full batch, starting a new epoch when
the current one cannot fill it, i.e. drop_last), or iterating it as a `torch.utils.data.Sampler`. Iteration
advances the state as indices are *yielded*: a DataLoader with worker processes prefetches ahead, so take
`state_dict()` from a sampler driven by `next_batch` (or a DataLoader with num_workers=0).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["ResumableSampler"]


class ResumableSampler:
    """Deterministic per-epoch order over `num_samples` indices with (epoch, position) state."""

    def __init__(self, num_samples: int, *, shuffle: bool = True, seed: int = 0):
        if num_samples <= 0:
            raise ValueError(f"the dataset is empty (num_samples={num_samples}); check data.train_files")
        self.num_samples = int(num_samples)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._cached: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """The index order of `epoch`: (num_samples,) int64."""
        if self._cached is None or self._cached[0] != epoch:
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                perm = np.arange(self.num_samples)
            self._cached = (epoch, perm)
        return self._cached[1]

    def next_batch(self, batch_size: int) -> list[int]:
        """The next `batch_size` indices; a remainder too small for a batch is dropped (a new epoch starts)."""
        if not 0 < batch_size <= self.num_samples:
            raise ValueError(
                f"batch_size={batch_size} must be in [1, {self.num_samples}] (the dataset size); lower "
                "data.train_batch_size or add data"
            )
        if self.position + batch_size > self.num_samples:
            self.epoch, self.position = self.epoch + 1, 0
        batch = self.order(self.epoch)[self.position : self.position + batch_size]
        self.position += batch_size
        return [int(i) for i in batch]

    def __iter__(self) -> Iterator[int]:
        """The rest of the current epoch, then the state moves to the start of the next one."""
        order = self.order(self.epoch)
        while self.position < self.num_samples:
            index = int(order[self.position])
            self.position += 1
            yield index
        self.epoch, self.position = self.epoch + 1, 0

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`. The dataset size, seed and shuffle flag must match the saved run."""
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data order: the checkpoint has {key}={state[key]!r} but this run has "
                    f"{getattr(self, key)!r} (same data files, filtering and data.seed/data.shuffle are needed)"
                )
        if not 0 <= state["position"] <= self.num_samples:
            raise ValueError(f"checkpointed position {state['position']} is outside [0, {self.num_samples}]")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
