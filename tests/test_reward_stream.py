"""RewardLoop: `ScoringStream` scores what has finished while the caller keeps working, and
`generate_and_score` on the native engine scores samples as they finish."""
import time

import pytest

from rlhf_mcore.rewards import RewardScorer
from rlhf_mcore.rewards.stream import ScoringStream


def slow_fn(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.05)
    return float(len(solution_str) % 3)


@pytest.mark.parametrize("workers", [0, 2])
def test_stream_scores_equal_a_batch_call_and_overlap_the_caller(workers):
    texts = [f"answer {i}" * (i % 4 + 1) for i in range(24)]
    with RewardScorer(slow_fn, num_workers=workers, timeout_s=5) as scorer:
        want, _ = scorer.score(["s"] * 24, texts, ["x"] * 24, [None] * 24)
        stream = ScoringStream(scorer)
        t0 = time.monotonic()
        busy = 0.0
        for start in range(0, 24, 4):  # the "engine": 4 items finish every 60 ms
            stream.submit(list(range(start, start + 4)), ["s"] * 4, texts[start:start + 4], ["x"] * 4, [None] * 4)
            b0 = time.monotonic()
            time.sleep(0.06)
            busy += time.monotonic() - b0
        scores, stats = stream.finish()
        total = time.monotonic() - t0
    assert [scores[i] for i in range(24)] == want
    assert stats["num_items"] == 24 and stats["num_failed"] == 0
    if workers:  # scoring (24 x 50 ms over 2 workers) hides behind the caller's 6 x 60 ms
        assert stats["tail_s"] < 0.5
        assert total < busy + 24 * 0.05 / workers + 0.5


def test_stream_raises_the_scorers_error_on_finish():
    def broken(data_source, solution_str, ground_truth, extra_info=None):
        raise ValueError("no")

    with RewardScorer(broken, num_workers=0, timeout_s=5) as scorer:
        stream = ScoringStream(scorer)
        stream.submit([0, 1], ["s", "s"], ["a", "b"], ["x", "x"], [None, None])
        scores, stats = stream.finish()
    assert scores == {0: 0.0, 1: 0.0} and stats["num_exceptions"] == 2  # counted; the caller applies the ratio
