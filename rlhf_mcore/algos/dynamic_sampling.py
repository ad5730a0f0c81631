"""Dynamic sampling (DAPO; veRL's `algorithm.filter_groups`): train only on informative groups.

A group (the `rollout.n` responses to one prompt) whose filter metric is the same for every response (all
right, all wrong) has zero group-relative advantage and teaches nothing; it is dropped. The trainer keeps
drawing `data.gen_batch_size` prompts until `data.train_batch_size` informative groups are collected, then
trains on the first `train_batch_size` of them (the rest of the drawn prompts are consumed, not returned).
When `max_num_gen_batches` (> 0) generation batches have not filled the step, the run stops with
:class:`DynamicSamplingError`, as veRL's recipe does; `max_num_gen_batches <= 0` means no limit.

"All equal" is tested exactly (`max == min`), not as `std > 0`: a float std of equal non-integer values can
come out as a rounding residue above 0. A group of one response is kept (nothing to compare it with).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

from rlhf_mcore.errors import UserError

__all__ = ["DynamicSamplingError", "GroupPool", "informative_groups"]


class DynamicSamplingError(UserError, RuntimeError):
    """`algorithm.filter_groups.max_num_gen_batches` generation batches did not give a full training batch."""

    kind = "error"


def informative_groups(index: Sequence[Hashable], values: Sequence[float]) -> list[bool]:
    """Per sample: True where the samples sharing its `index` do not all have the same value (or it is alone)."""
    if len(index) != len(values):
        raise ValueError(f"index has {len(index)} entries but values {len(values)}")
    lo: dict[Hashable, float] = {}
    hi: dict[Hashable, float] = {}
    count: dict[Hashable, int] = {}
    for i, v in zip(index, values):
        v = float(v)
        lo[i], hi[i] = min(lo.get(i, v), v), max(hi.get(i, v), v)
        count[i] = count.get(i, 0) + 1
    return [count[i] == 1 or hi[i] > lo[i] for i in index]


@dataclass
class GroupPool:
    """The informative groups collected over one step's generation batches, and when to stop drawing.

    `add` one generation batch at a time; draw another while `wants_more()`; then `take()` the step's groups.
    Groups are opaque objects (the trainer's (prompt id, rows) pairs).
    """

    target: int  # data.train_batch_size
    max_num_gen_batches: int  # <= 0: no limit
    groups: list[Any] = field(default_factory=list)
    num_gen_batches: int = 0
    drawn: int = 0

    def add(self, groups: Sequence[Any], sample_group: Sequence[int], values: Sequence[float]) -> None:
        """One generation batch: `groups[k]`'s samples are those with `sample_group == k`, with their metric
        `values`; the informative groups are kept, in order."""
        keep = informative_groups(sample_group, values)
        kept = {k for k, ok in zip(sample_group, keep) if ok}
        self.groups += [g for k, g in enumerate(groups) if k in kept]
        self.num_gen_batches += 1
        self.drawn += len(groups)

    @property
    def full(self) -> bool:
        return len(self.groups) >= self.target

    def wants_more(self) -> bool:
        """Not full and below the generation-batch limit."""
        limited = self.max_num_gen_batches > 0 and self.num_gen_batches >= self.max_num_gen_batches
        return not self.full and not limited

    def take(self) -> list[Any]:
        """The first `target` groups, or DynamicSamplingError when the pool is short."""
        if not self.full:
            raise DynamicSamplingError(
                f"dynamic sampling found {len(self.groups)} informative groups in {self.drawn} prompts over "
                f"{self.num_gen_batches} generation batches (algorithm.filter_groups.max_num_gen_batches="
                f"{self.max_num_gen_batches}), fewer than data.train_batch_size={self.target}: most groups' "
                f"responses all score the same (the data is too easy or too hard for the model). Raise "
                f"max_num_gen_batches (0: no limit) or data.gen_batch_size, or use other data.")
        return self.groups[:self.target]

    def metrics(self) -> dict[str, float]:
        """`dynamic_sampling/num_gen_batches`, `.../drawn_groups`, `.../informative_groups` (found, before the
        trim to the target) and `.../informative_fraction`."""
        return {"dynamic_sampling/num_gen_batches": float(self.num_gen_batches),
                "dynamic_sampling/drawn_groups": float(self.drawn),
                "dynamic_sampling/informative_groups": float(len(self.groups)),
                "dynamic_sampling/informative_fraction": len(self.groups) / max(self.drawn, 1)}
