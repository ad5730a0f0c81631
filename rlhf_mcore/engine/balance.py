"""Sequence-length balancing: split sequences into groups of near-equal token counts.

Two users:
- the trainer's coordinator spreads a batch over DP ranks (`equal_size=True`: every rank gets the same number
  of sequences, so per-rank mini-batch sizes stay equal) — attention and MLP cost grow with tokens, and the
  slowest rank sets the step time;
- the train engine forms micro-batches under a token budget (`use_dynamic_bsz`, `ppo_max_token_len_per_gpu`):
  :func:`split_by_token_budget`.

:func:`karmarkar_karp` is the largest differencing method generalised to k parts (Karmarkar & Karp 1982;
multi-way form as in Korf's "complete Karmarkar-Karp"): start from one partial solution per item (or per
k-tuple of items when sizes must be equal), repeatedly merge the two partial solutions with the largest
spread by pairing the heaviest part of one with the lightest of the other. The equal-size variant starts
from tuples of neighbouring lengths and can leave a visible gap between its heaviest and lightest parts on
long-tailed lengths, so a local search follows (:func:`_refine`: exchanges between the heaviest and the
lightest part while that narrows them). The result beats greedy longest-processing-time
(:func:`greedy_partition`, kept as the simple reference) on long-tailed length distributions.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from rlhf_mcore.parallel.dist import collective_device

__all__ = ["karmarkar_karp", "greedy_partition", "partition_balanced", "split_by_token_budget", "partition_spread"]


class _Partial:
    """A partial k-way solution: k parts (each a list of item indices) with their sums, heaviest first."""

    __slots__ = ("parts", "sums")

    def __init__(self, parts: list[list[int]], sums: list[int]):
        order = sorted(range(len(sums)), key=lambda i: (-sums[i], i))
        self.parts = [parts[i] for i in order]
        self.sums = [sums[i] for i in order]

    @property
    def spread(self) -> int:
        return self.sums[0] - self.sums[-1]

    def merge(self, other: "_Partial") -> "_Partial":
        # heaviest part of self with the lightest of other, and so on: the spreads cancel out
        k = len(self.sums)
        parts = [self.parts[i] + other.parts[k - 1 - i] for i in range(k)]
        sums = [self.sums[i] + other.sums[k - 1 - i] for i in range(k)]
        return _Partial(parts, sums)

    def key(self, tiebreak: int):
        # max-heap on spread (heapq is a min-heap), then on the heaviest part, then insertion order
        return (-self.spread, -self.sums[0], tiebreak)


def karmarkar_karp(seqlens: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Partition item indices `0..n-1` into `k` lists whose `seqlens` sums are nearly equal.

    `equal_size=True` also makes every part hold exactly `n / k` items (n must be divisible by k). Each part
    comes back sorted ascending; deterministic for a given input.
    """
    n = len(seqlens)
    _check_k(n, k, equal_size)
    heap: list = []
    counter = 0
    if equal_size:
        # k-tuples of consecutive items in sorted order become one initial partial solution each, one item
        # per part: merging keeps the part sizes equal
        order = sorted(range(n), key=lambda i: (seqlens[i], i))
        for start in range(0, n, k):
            group = order[start:start + k]
            partial = _Partial([[i] for i in group], [int(seqlens[i]) for i in group])
            heapq.heappush(heap, (partial.key(counter), counter, partial))
            counter += 1
    else:
        for i in range(n):
            partial = _Partial([[i]] + [[] for _ in range(k - 1)], [int(seqlens[i])] + [0] * (k - 1))
            heapq.heappush(heap, (partial.key(counter), counter, partial))
            counter += 1
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = a.merge(b)
        heapq.heappush(heap, (merged.key(counter), counter, merged))
        counter += 1
    result = heapq.heappop(heap)[2]
    return [sorted(p) for p in _refine(seqlens, result.parts, equal_size)]


def _refine(seqlens: Sequence[int], parts: list[list[int]], equal_size: bool, max_rounds: Optional[int] = None
            ) -> list[list[int]]:
    """Local search: between the heaviest and the lightest part, apply the exchange of two items (or, without
    the equal-size constraint, the move of one item) that best narrows their gap, while one narrows it.

    Each step lowers the sum of squared part sums, so it ends; `max_rounds` (default 4n) bounds the work.
    """
    parts = [list(p) for p in parts]
    sums = [sum(int(seqlens[i]) for i in p) for p in parts]
    for _ in range(max_rounds if max_rounds is not None else 4 * len(seqlens)):
        h = max(range(len(parts)), key=lambda j: (sums[j], -j))
        lo = min(range(len(parts)), key=lambda j: (sums[j], j))
        gap = sums[h] - sums[lo]
        if gap <= 1:
            break
        best_gap, best = gap, None  # the new |gap - 2d| must beat the current gap
        light = sorted(parts[lo], key=lambda i: int(seqlens[i]))
        light_lens = [int(seqlens[i]) for i in light]
        for a in parts[h]:
            sa = int(seqlens[a])
            if not equal_size and 0 < sa < gap and abs(gap - 2 * sa) < best_gap:
                best_gap, best = abs(gap - 2 * sa), (a, None)
            # the partner b with s[a] - s[b] closest to gap / 2
            target = sa - gap / 2
            pos = _bisect(light_lens, target)
            for q in (pos - 1, pos):
                if 0 <= q < len(light):
                    d = sa - light_lens[q]
                    if 0 < d < gap and abs(gap - 2 * d) < best_gap:
                        best_gap, best = abs(gap - 2 * d), (a, light[q])
        if best is None:
            break
        a, b = best
        parts[h].remove(a)
        parts[lo].append(a)
        moved = int(seqlens[a])
        if b is not None:
            parts[lo].remove(b)
            parts[h].append(b)
            moved -= int(seqlens[b])
        sums[h] -= moved
        sums[lo] += moved
    return parts


def _bisect(values: list[int], target: float) -> int:
    """First index whose value is >= target (values ascending)."""
    lo, hi = 0, len(values)
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


def greedy_partition(seqlens: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Longest-processing-time greedy: each item, longest first, goes to the lightest part that has room."""
    n = len(seqlens)
    _check_k(n, k, equal_size)
    cap = n // k if equal_size else n
    parts: list[list[int]] = [[] for _ in range(k)]
    sums = [0] * k
    for i in sorted(range(n), key=lambda i: (-seqlens[i], i)):
        j = min((j for j in range(k) if len(parts[j]) < cap), key=lambda j: (sums[j], j))
        parts[j].append(i)
        sums[j] += int(seqlens[i])
    return [sorted(p) for p in parts]


def _check_k(n: int, k: int, equal_size: bool) -> None:
    if k < 1:
        raise ValueError(f"number of parts must be >= 1, got {k}")
    if equal_size and n % k:
        raise ValueError(f"cannot split {n} sequences into {k} equal-size parts: use a batch size divisible by {k} "
                         "(e.g. data.train_batch_size × rollout.n divisible by the data-parallel size)")


def partition_balanced(seqlens: Sequence[int], k: int, equal_size: bool = True,
                       method: str = "karmarkar_karp") -> list[list[int]]:
    """`karmarkar_karp` or `greedy` partition by name (what the coordinator calls to balance DP ranks)."""
    if method == "karmarkar_karp":
        return karmarkar_karp(seqlens, k, equal_size)
    if method == "greedy":
        return greedy_partition(seqlens, k, equal_size)
    raise ValueError(f"unknown balancing method {method!r}; choose 'karmarkar_karp' or 'greedy'")


def partition_spread(seqlens: Sequence[int], parts: list[list[int]]) -> int:
    """Heaviest minus lightest part (in tokens): the imbalance a partition leaves."""
    sums = [sum(int(seqlens[i]) for i in p) for p in parts]
    return max(sums) - min(sums)


def split_by_token_budget(seqlens: Sequence[int], max_tokens: int, *, min_parts: int = 1, multiple_of: int = 1,
                          group: Optional[dist.ProcessGroup] = None,
                          budget_key: str = "ppo_max_token_len_per_gpu") -> list[list[int]]:
    """Micro-batches (lists of item indices) of at most `max_tokens` tokens each, balanced, in few parts.

    Starts from `ceil(total / max_tokens)` parts (at least `min_parts`) and adds parts until Karmarkar-Karp
    keeps every one within budget. With `group` (the DP group), all ranks use the largest count among them,
    so data-parallel ranks run the same number of micro-batches (capped at this rank's sequence count: a
    micro-batch is never empty). `multiple_of` rounds the count up to a multiple (the interleaved pipeline
    schedule needs a multiple of the pipeline size). Every sequence must fit the budget alone. Parts come
    back ordered by their smallest item index. `budget_key`: the config key errors name.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens ({budget_key}) must be >= 1, got {max_tokens}")
    longest = max((int(s) for s in seqlens), default=0)
    if longest > max_tokens:
        raise ValueError(f"a sequence of {longest} tokens exceeds {budget_key}={max_tokens}: raise it "
                         "to at least max_prompt_length + max_response_length")
    n = len(seqlens)
    if n < multiple_of:
        raise ValueError(f"{n} sequences cannot fill a multiple of {multiple_of} micro-batches (the interleaved "
                         "pipeline schedule needs at least PP micro-batches): give each rank more sequences")
    k = max(min_parts, math.ceil(sum(int(s) for s in seqlens) / max_tokens), 1)
    k = min(k, max(n, 1))
    while True:
        parts = karmarkar_karp(seqlens, k)
        if all(sum(int(seqlens[i]) for i in p) <= max_tokens for p in parts) or k >= n:
            break
        k += 1
    target = k
    if group is not None and dist.get_world_size(group) > 1:
        # every DP rank runs the same number of micro-batches (the largest any rank needs)
        count = torch.tensor([k], dtype=torch.long, device=collective_device(group))  # CUDA for NCCL
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        target = int(count)
    target = -(-target // multiple_of) * multiple_of
    while target > n:
        target -= multiple_of
    if target != k:
        parts = karmarkar_karp(seqlens, target)
        heaviest = max(sum(int(seqlens[i]) for i in p) for p in parts)
        if heaviest > max_tokens:
            raise ValueError(f"{n} sequences cannot be split into a multiple of {multiple_of} micro-batches within "
                             f"{budget_key}={max_tokens} (a micro-batch needs {heaviest}): raise it")
    return sorted((p for p in parts if p), key=lambda p: p[0])
