"""RewardLoop: scoring samples as they finish, while the rollout engine keeps generating the rest.

    stream = ScoringStream(scorer)
    for finished in ...:                       # the engine's loop
        stream.submit(keys, data_sources, responses, ground_truths, extra_infos)
    scores, stats = stream.finish()            # {key: score}, the scorer's counters summed + tail seconds

With reward workers (`reward.num_workers >= 1`) a background thread hands each submitted batch to the scorer's
worker pool, so scoring overlaps generation and what is left after the last sample is about one item's time
(logged as `timing_s/reward_tail`). Without workers (`num_workers=0`) the reward function runs in the calling
thread (its timeout interrupts through a signal, which only the main thread receives): each `submit` scores its
batch at once,
between engine steps — still overlapping the rest of the generation, but holding the engine meanwhile.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Hashable, Sequence

from rlhf_mcore.rewards.scorer import RewardScorer


def _merge_stats(total: dict, stats: dict) -> None:
    for k, v in stats.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            total[k] = total.get(k, 0) + v
        elif k in ("first_failure", "reward_fn") and v is not None:
            total.setdefault(k, v)


class ScoringStream:
    def __init__(self, scorer: RewardScorer):
        self.scorer = scorer
        self.scores: dict[Hashable, float] = {}
        self.extras: dict[Hashable, Any] = {}
        self.stats: dict[str, Any] = {}
        self.last_submit = None
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.new_scores: dict[Hashable, float] = {}  # scored since the last take()
        self.new_stats: dict[str, Any] = {}
        self.threaded = scorer.num_workers >= 1
        if self.threaded:
            self.queue: queue.Queue = queue.Queue()
            self.thread = threading.Thread(target=self._run, name="reward-stream", daemon=True)
            self.thread.start()

    def submit(self, keys: Sequence[Hashable], data_sources: Sequence[str], responses: Sequence[str],
               ground_truths: Sequence[Any], extra_infos: Sequence[Any]) -> None:
        """Score these items (one key each) as soon as possible."""
        if not keys:
            return
        self.last_submit = time.monotonic()
        batch = (list(keys), list(data_sources), list(responses), list(ground_truths), list(extra_infos))
        if self.threaded:
            self.queue.put(batch)
        else:
            self._score(batch)

    def _score(self, batch) -> None:
        keys, *inputs = batch
        scores, stats = self.scorer.score(*inputs, check=False)
        with self.lock:
            for k, s, e in zip(keys, scores, stats.get("extra") or [None] * len(keys)):
                self.scores[k] = self.new_scores[k] = s
                self.extras[k] = e
            _merge_stats(self.stats, stats)
            _merge_stats(self.new_stats, stats)

    def _run(self) -> None:
        while True:
            batch = self.queue.get()
            if batch is None:
                return
            more = [batch]
            while True:  # everything that arrived meanwhile goes to the pool as one batch
                try:
                    nxt = self.queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.queue.put(None)
                    break
                more.append(nxt)
            merged = tuple(sum((list(b[i]) for b in more), []) for i in range(5))
            try:
                self._score(merged)
            except BaseException as e:  # raised again by finish(), on the caller's thread
                self.error = e
                return

    def take(self) -> tuple[dict[Hashable, float], dict[str, Any]]:
        """What was scored since the last call (scores by key, the scorer's counters over them), without waiting:
        for a caller that streams forever (the fully asynchronous rollout)."""
        if self.error is not None:
            raise self.error
        with self.lock:
            scores, stats = self.new_scores, self.new_stats
            self.new_scores, self.new_stats = {}, {}
        return scores, stats

    def finish(self) -> tuple[dict[Hashable, float], dict[str, Any]]:
        """Wait for every submitted item; returns the scores by key and the summed stats, with `tail_s`: the
        seconds from the last submit to the last score."""
        if self.threaded:
            self.queue.put(None)
            self.thread.join()
            if self.error is not None:
                raise self.error
        self.stats["tail_s"] = time.monotonic() - self.last_submit if self.last_submit is not None else 0.0
        return self.scores, self.stats
