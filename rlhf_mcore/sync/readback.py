"""A rollout engine's weights read back in Hugging Face layout, for verifying a sync.

`engine_hf_shards(engine)` returns, for every HF tensor name the engine holds, a `HeldShard`: the tensor the
engine actually holds for it (a view into its storage, e.g. the q rows of a fused QKV matrix) and which slice
of the full HF tensor that should be (`dim`, `rank`, `size`: an even split along `dim`; `dim=None` for a
replicated tensor).

Any engine with a method `hf_weight_shards() -> Iterable[HeldShard-like (name, tensor, dim, rank, size)]` can be
read back (the protocol extension of `RolloutEngine`); this module knows no concrete engine. The native engine
implements it from its `ModelWeights` with the slicing rules written out independently of its loader
(:mod:`rlhf_mcore.rollout.native.hf_shards`), so a slicing bug in the loader shows up as a verification failure;
the Hugging Face engine gives its model's parameters (full tensors).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeldShard:
    """The engine's copy of one HF tensor: `tensor` should equal `expected_from(full)`."""

    name: str
    tensor: torch.Tensor
    dim: int | None = None  # None: replicated (the whole tensor)
    rank: int = 0
    size: int = 1

    def expected_from(self, full: torch.Tensor) -> torch.Tensor:
        """This engine's slice of the full HF tensor `full`."""
        if self.dim is None or self.size == 1:
            return full
        n = full.shape[self.dim]
        if n % self.size:
            raise ValueError(f"{self.name!r}: dim {self.dim} of size {n} does not split evenly over {self.size} "
                             "rollout TP ranks.")
        part = n // self.size
        return full.narrow(self.dim, self.rank * part, part)


def engine_hf_shards(engine) -> dict[str, HeldShard]:
    """name -> HeldShard for every HF tensor `engine` holds (its `hf_weight_shards()`); TypeError for an engine
    without that method."""
    shards = getattr(engine, "hf_weight_shards", None)
    if shards is not None:
        return {s[0] if isinstance(s, tuple) else s.name: s if isinstance(s, HeldShard) else HeldShard(*s)
                for s in shards()}
    raise TypeError(f"weight-sync verification cannot read the weights of {type(engine).__name__}: give it a "
                    "`hf_weight_shards()` method, or turn verification off "
                    "(actor_rollout_ref.rollout.sync_verify=false).")
