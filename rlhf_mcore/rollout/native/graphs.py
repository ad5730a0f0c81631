"""CUDA-graph capture of the decode step, one graph per (batch bucket, attention-length bucket, sampler).

A decode step is a few hundred small kernels; replaying them as one graph removes the per-kernel launch
cost, which otherwise bounds a step for a small model. Graphs read and write the engine's persistent row buffers, so
the batch is padded up to its bucket with rows pointing at a scratch cache slot. All graphs share one memory
pool (they never run concurrently and keep no outputs outside the persistent buffers).
"""

from __future__ import annotations

from typing import Callable

import torch


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, 16, 32, then multiples of 32, and max_batch itself."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32) if b < max_batch]
    sizes += list(range(64, max_batch, 32))
    return sorted(set(sizes + [max_batch]))


def bucket_for(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"batch {n} exceeds the largest bucket {buckets[-1]}")


class DecodeGraphs:
    """Captures `step_fn(batch)` lazily per key and replays it."""

    def __init__(self):
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.captures = 0  # graphs captured so far, across clear() (the engine's `graph_captures` per stream)

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None

    def run(self, key: tuple, step_fn: Callable[[], None], prepare: Callable[[], Callable[[], None]]) -> None:
        """Replay the graph for `key`, capturing it first if needed.

        prepare() is called before capture and must point the batch at scratch state; it returns a function
        that restores the real state (capture runs the step for real, twice for warm-up plus once captured).
        """
        graph = self.graphs.get(key)
        if graph is None:
            restore = prepare()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton autotuning/compilation and cuBLAS handles stay out of the graph
                    step_fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                step_fn()
            torch.cuda.synchronize()
            restore()
            self.graphs[key] = graph
            self.captures += 1
        graph.replay()
