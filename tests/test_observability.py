"""Seeing a run, in process (no launch): the trace's spans, parts and merge (rlhf_mcore/trace.py). The end-to-end
trace checks run inside existing launches: tests/test_dapo.py (2 processes, colocated), tests/test_async.py (2 and 3
processes, both asynchronous modes)."""
import json
import threading
import time

import pytest
from e2e_helpers import step_phases, trace_tracks

from rlhf_mcore import trace
from rlhf_mcore.trainer.hooks import PhaseTimer

pytestmark = pytest.mark.cost(3)


@pytest.fixture
def tracing(tmp_path):
    path = tmp_path / "trace.json"
    trace.open_trace(path, rank=0, role="test", world_size=1)
    yield path
    trace.close_trace(wait_s=0)


def test_phase_timer_spans_nest_in_order_with_their_arguments(tracing):
    """PhaseTimer's phases are the trace's spans: the same seconds as `timing_s/*` (one clock read), nested inside
    the step, in order, with the step's number; a thread's spans go on their own named track; a span's arguments
    added after it ended (the step's sizes) are written at the next flush. Mutation: PhaseTimer's span opened
    without the step's number (`Span(name, args)`) -> fails."""
    for step in (1, 2):
        t = PhaseTimer(step)
        with t("step"):
            with t("gen"):
                time.sleep(0.002)
            with t("update", micro_batches=2):
                pass
        t.spans["step"].args["tokens"] = 10 * step
        trace.flush()
    worker = threading.Thread(target=_score_once, name="reward-stream")
    worker.start()
    worker.join()
    out = trace.close_trace(wait_s=0)
    assert out == tracing
    tracks = trace_tracks(out)
    assert step_phases(tracks[(0, 0)]) == {1: ["gen", "update"], 2: ["gen", "update"]}
    steps = [e for e in tracks[(0, 0)] if e["name"] == "step"]
    assert [e["args"] for e in steps] == [{"step": 1, "tokens": 10}, {"step": 2, "tokens": 20}]
    gen = [e for e in tracks[(0, 0)] if e["name"] == "gen"][-1]
    assert gen["dur"] == pytest.approx(t.seconds["gen"] * 1e6, abs=0.1) and gen["dur"] >= 2000
    assert [e for e in tracks[(0, 0)] if e["name"] == "update"][0]["args"] == {"step": 1, "micro_batches": 2}
    meta = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "M"]
    assert {"pid": 0, "tid": 1, "name": "reward-stream"} in [
        {"pid": e["pid"], "tid": e["tid"], "name": e["args"]["name"]} for e in meta if e["name"] == "thread_name"]
    assert [e["name"] for e in tracks[(0, 1)]] == ["score"]


def _score_once():
    with trace.span("score", items=3):
        pass


def test_a_killed_rank_leaves_a_part_that_merges(tmp_path):
    """A rank that never closed its part (killed) is merged from what it flushed, and named unfinished; a line cut
    by the kill is skipped; parts of ranks beyond this run's world size (an earlier, larger run) are removed."""
    path = tmp_path / "t.json"
    parts = trace.parts_dir(path)
    parts.mkdir()
    (parts / "rank5.jsonl").write_text('{"name": "old"}\n')  # an earlier 8-rank run's
    tr = trace.open_trace(path, rank=0, role="train", world_size=2)
    with trace.span("step", step=1):
        pass
    trace.flush()
    (parts / "rank1.jsonl").write_text(json.dumps({"name": "gen", "ph": "X", "pid": 1, "tid": 0, "ts": 2e15,
                                                   "dur": 5.0}) + '\n{"name": "cut')
    assert not (parts / "rank5.jsonl").exists() and tr is not None
    out = trace.close_trace(world_size=2, wait_s=0.2)
    doc = json.loads(out.read_text())
    assert doc["otherData"]["ranks"] == [0, 1] and doc["otherData"]["unfinished_ranks"] == [1]
    assert sorted(e["name"] for e in doc["traceEvents"] if e["ph"] == "X") == ["gen", "step"]


def test_span_cost_without_and_with_a_trace(tmp_path, capsys):
    """The trace is cheap enough to leave on: a span costs a few microseconds recorded (a step has ~10-30), under
    50 us even on a loaded CI core; without a trace open, only its two clock reads. Prints the measured costs
    (BENCHMARKS.md quotes them)."""
    n = 5000

    def cost() -> float:
        t0 = time.perf_counter()
        for i in range(n):
            with trace.span("phase", step=i):
                pass
        return (time.perf_counter() - t0) / n * 1e6

    off = min(cost() for _ in range(3))
    trace.open_trace(tmp_path / "t.json", rank=0, role="bench")
    on = min(cost() for _ in range(3))
    t0 = time.perf_counter()
    trace.flush()
    flush_us = (time.perf_counter() - t0) / (3 * n) * 1e6
    trace.close_trace(wait_s=0)
    with capsys.disabled():
        print(f"\nspan: {off:.2f} us untraced, {on:.2f} us traced + {flush_us:.2f} us to write it")
    assert on + flush_us < 50
