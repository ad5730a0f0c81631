"""Seeing a run, in process (no launch): the trace's spans, parts and merge (rlhf_mcore/trace.py), the curves'
plot (launch/plot_metrics.py). The end-to-end
trace checks run inside existing launches: tests/test_dapo.py (2 processes, colocated), tests/test_async.py (2 and 3
processes, both asynchronous modes)."""
import json
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
from e2e_helpers import spans_in, step_phases, trace_tracks

from rlhf_mcore import trace
from rlhf_mcore.trainer.hooks import PhaseTimer

pytestmark = pytest.mark.cost(8)

ROOT = Path(__file__).resolve().parents[1]


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


def test_each_item_of_a_stream_is_a_span_and_is_not_held_after_its_turn(tracing):
    """`trace.each` (the weight sync's buckets): one span per item from its pull (the stream's own work) to the end
    of the loop's body, numbered, with what the body added; an item is not referenced by the loop once its turn
    ended (a sync holds one bucket at a time); a loop left early ends its span there; no span for the pull that
    found the stream empty. Mutation: `each` keeps its `item` across the next pull (no `del item`) -> fails."""
    import weakref

    class Bucket:
        pass

    alive = []

    def stream(n):
        for _ in range(n):
            assert all(r() is None for r in alive), "an earlier bucket still held while the next one is made"
            time.sleep(0.002)  # the export's work: inside the item's span
            yield Bucket()

    with trace.span("sync", step=1):
        for s, b in trace.each("weight bucket", stream(3), version=7):
            alive.append(weakref.ref(b))
            s.args["bytes"] = 100
            del b
    with trace.span("sync", step=2):
        for _s, _b in trace.each("weight bucket", stream(3)):
            break
    del s, _s, _b
    track = trace_tracks(trace.close_trace(wait_s=0))[(0, 0)]  # (tracks nest)
    buckets = [e for e in track if e["name"] == "weight bucket"]
    assert [e["args"] for e in buckets] == [{"index": 0, "version": 7, "bytes": 100},
                                             {"index": 1, "version": 7, "bytes": 100},
                                             {"index": 2, "version": 7, "bytes": 100}, {"index": 0}]
    assert all(e["dur"] >= 2000 for e in buckets)  # the pull's work counted
    assert [len(spans_in(track, e, "weight bucket")) for e in track if e["name"] == "sync"] == [3, 1]


def test_the_reference_and_critic_passes_are_spans_inside_old_log_prob(tracing):
    """The learner's forward passes on the trace (no launched test runs a reference or a critic with the trace on):
    the reference's log-probs and the critic's values, each a span inside the step's `old_log_prob` phase. Mutation:
    the critic's pass not timed (`forward_passes`' `with span("values")` removed) -> fails."""
    from rlhf_mcore.config import load_config
    from rlhf_mcore.trainer.learner import Learner

    class Engine:
        def compute_log_probs(self, batch):
            return "log-probs", "entropy"

        def compute_values(self, batch):
            return "values"

    learner = Learner(load_config(None, ["actor_rollout_ref.model.path=/m"]), None, Engine(), critic=Engine(),
                      ref=Engine())
    t, batch = PhaseTimer(4), {}
    with t("step"):
        with t("old_log_prob"):
            learner.forward_passes(batch)
    assert batch == {"old_log_probs": "log-probs", "old_entropy": "entropy", "ref_log_prob": "log-probs",
                     "values": "values"}
    track = trace_tracks(trace.close_trace(wait_s=0))[(0, 0)]
    assert step_phases(track) == {4: ["old_log_prob"]}
    olp = next(e for e in track if e["name"] == "old_log_prob")
    assert [e["name"] for e in track if e["name"] in ("reference", "values") and e in spans_in(track, olp, e["name"])] \
        == ["reference", "values"]


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
    """The trace is cheap enough to leave on: a span costs microseconds recorded and written (a step has ~10-30;
    BENCHMARKS.md quotes the printed figures, ~17 us on the dev machine). The bound is loose (a loaded 2-core CI
    machine), there to catch a span that does synchronous I/O of its own. Mutation: `Tracer.record` flushes and
    fsyncs each event (`self.flush(); os.fsync(self.file.fileno())`) -> fails (690 us a span on the dev machine)."""
    n = 2000

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
    assert on + flush_us < 500, (on, flush_us)


# ------------------------------------------------------------------------------------------------ plots
def _plot_metrics():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_metrics", ROOT / "launch" / "plot_metrics.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plot_metrics_draws_the_panels_of_a_recorded_run(tmp_path, capsys):
    """launch/plot_metrics.py on a recorded metrics.jsonl (tests/data/metrics_fully_async.jsonl: the fully
    asynchronous learning run of tests/test_trainer.py, 8 steps, two validations): one PNG of the eight default
    panels (3 x 3 grid), the held-out curves one per data source, the staleness histogram the run's sum; `--keys`
    draws the metrics it names; without matplotlib one line says how to install it. Mutation: the histogram reads
    `<mode>/stale/<k>` instead of `<mode>/staleness/<k>` -> fails."""
    import matplotlib.image

    pm = _plot_metrics()
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(ROOT / "tests" / "data" / "metrics_fully_async.jsonl", run / "metrics.jsonl")
    assert pm.main([str(run)]) == 0
    out = run / "plots" / "curves.png"
    assert f"plots at {out} (training reward, held-out accuracy, response length, KL, entropy, grad norm, " \
           "throughput, staleness (trained groups))" in capsys.readouterr().out
    img = matplotlib.image.imread(out)
    assert img.shape[:2] == (round(3 * 3.4 * 90), round(3 * 5.2 * 90))  # 3 rows x 3 columns of panels
    assert (img[..., :3] < 0.9).mean() > 0.02  # drawn on, not blank
    train, val = pm.read_records(run / "metrics.jsonl")
    panels = dict((p[0], p[1:]) for p in pm.panels_for(train, val, None))
    assert [label for _, _, label in panels["held-out accuracy"][0]] == ["synthetic/arithmetic", "openai/gsm8k"]
    want = {}
    for r in train:
        for k in (0, 1):
            want[k] = want.get(k, 0) + r.get(f"fully_async/staleness/{k}", 0)
    assert panels["staleness (trained groups)"][0] == want and sum(want.values()) == 8 * 16  # 16 groups a step

    assert pm.main([str(run), "--keys", "timing_s/*", "--out", str(tmp_path / "t.png")]) == 0
    assert "timing_s/update" in capsys.readouterr().out and (tmp_path / "t.png").is_file()
    assert pm.main([str(tmp_path / "nowhere")]) == 1
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_plot_metrics_without_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    pm = _plot_metrics()
    shutil.copy(ROOT / "tests" / "data" / "metrics_fully_async.jsonl", tmp_path / "metrics.jsonl")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert pm.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"error: {pm.MISSING}" and "pip install" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------ logs
def test_console_lines_put_agent_metrics_on_their_own_line_and_cut_long_text_in_the_middle():
    """A validation's `val/agent/*` metrics get a line of their own (the agent demo's line was ~900 characters);
    a validation sample's question is shown whole up to 400 characters, a longer one keeps its start and its end
    (the question is at the end of a chat-templated prompt). Mutation: middle_cut keeps the last `limit`
    characters (the old `prompt[-120:]`) -> fails."""
    from rlhf_mcore.trainer.logging import console_lines, middle_cut

    metrics = {"val/acc": 0.5, "val/agent/turns": 2.0, "val/agent/tool_calls": 1.0, "val/gsm8k/acc": 0.25}
    assert console_lines(3, 10, metrics, "val") == [
        "[val @ step 3] | val/acc 0.5000 | val/gsm8k/acc 0.2500",  # the line as before, less the agent's
        "[val/agent @ step 3] | val/agent/tool_calls 1.0000 | val/agent/turns 2.0000"]
    assert console_lines(3, 10, {"val/acc": 0.5}, "val") == ["[val @ step 3] | val/acc 0.5000"]
    assert console_lines(3, 10, {"critic/score/mean": 0.25, "timing_s/step": 1.5}, "train") == [
        "step 3/10 | reward 0.250 | s 1.5"]
    assert middle_cut("x" * 400) == "x" * 400
    prompt = "<|system|>" + "s" * 500 + "<|user|>What is 2 + 3?<|assistant|>"
    cut = middle_cut(prompt)
    assert len(cut) <= 400 and cut.startswith("<|system|>") and cut.endswith("<|user|>What is 2 + 3?<|assistant|>")
    assert " ... " in cut


def test_ranks_other_than_0_say_only_their_errors():
    """Under torchrun (RANK set) rank 1 prints no warning nor logged warning, only errors; rank 0 prints all; a
    non-terminal stderr turns the Hugging Face progress bars off (their frames in a log file). A fresh interpreter
    each (the filters are process-wide); quiet.py imports no torch, so each takes well under a second."""
    import subprocess

    from subprocess_env import child_env

    code = ("import logging, os, warnings\nfrom rlhf_mcore.quiet import silence_known_warnings\n"
            "silence_known_warnings()\nwarnings.warn('a warning', FutureWarning)\n"
            "logging.getLogger('rlhf_mcore.data').warning('a logged warning')\n"
            "logging.getLogger('rlhf_mcore.data').error('an error')\n"
            "print(os.environ.get('HF_HUB_DISABLE_PROGRESS_BARS'))\n")
    out = {}
    for rank in ("0", "1"):
        env = {k: v for k, v in child_env(RANK=rank).items()
               if k not in ("PYTHONWARNINGS", "HF_HUB_DISABLE_PROGRESS_BARS")}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        out[rank] = proc
    assert "a warning" in out["0"].stderr and "a logged warning" in out["0"].stderr
    assert "a warning" not in out["1"].stderr and "a logged warning" not in out["1"].stderr
    assert "an error" in out["1"].stderr
    assert out["0"].stdout.strip() == out["1"].stdout.strip() == "1"  # stderr is a pipe here


def test_a_terminals_bar_names_the_steps_phase_and_the_tokens_so_far(tmp_path, monkeypatch, capsys):
    """In a terminal the console's bar names the step's phase running now and, while the rollout generates, its
    tokens so far (the rollout engines report them: tests/test_reward_stream.py checks the native engine's count);
    spans inside a phase (scoring, a bucket) and other threads leave it alone; redrawn at most 4 times a second.
    Not a terminal: no bar and no indicator (tests/e2e_helpers.check_plain_log checks the launched runs' logs).
    Mutation: `_show_phase` without its `step is not None` filter (the inner `score` span takes the bar) -> fails."""
    import io

    from rlhf_mcore.trainer.logging import MetricLogger

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    logger = MetricLogger(["console"], tmp_path, total_steps=2)
    bar = logger._bar
    try:
        with trace.span("gen", step=1):
            assert bar.postfix == "gen (step 1) ..."
            with trace.span("score", items=4):
                pass
            worker = threading.Thread(target=lambda: trace.progress(tokens=5))
            worker.start()
            worker.join()
            assert bar.postfix == "gen (step 1) ..."
            trace.progress(tokens=1234)
            assert bar.postfix == "gen (step 1) ... 1,234 tokens"
            trace.progress(tokens=1300)  # within a quarter of a second: not redrawn
            assert bar.postfix == "gen (step 1) ... 1,234 tokens"
            logger._shown_at -= 0.25
            trace.progress(tokens=2048)
            assert bar.postfix == "gen (step 1) ... 2,048 tokens"
        logger.log(1, {"critic/score/mean": 0.5, "timing_s/step": 2.0})
        assert capsys.readouterr().out == "step 1/2 | reward 0.500 | s 2.0\n" and bar.n == 1  # above the bar
    finally:
        logger.close()
    assert trace._ON_PHASE is None and trace._ON_PROGRESS is None
    monkeypatch.undo()
    plain = MetricLogger(["console"], tmp_path, total_steps=2)  # pytest's stderr is no terminal
    assert plain._bar is None and trace._ON_PHASE is None
    plain.close()


# ------------------------------------------------------------------------------------------------ summary
def test_end_of_run_summary_says_what_metrics_jsonl_says(tmp_path):
    """The summary of the recorded fully asynchronous run (8 steps, validations at steps 0 and 8): its numbers
    are the log's (checked by e2e_helpers.check_summary, which the 2-process resume launch in tests/test_async.py
    also runs on train.py's own output) and, literally, the values read off the file by hand. Mutation: the best
    held-out accuracy taken as the last one (`best = pts[-1]`) -> fails."""
    from e2e_helpers import check_summary

    from rlhf_mcore.trainer.summary import summary_lines

    out = tmp_path / "run"
    (out / "checkpoints" / "global_step_8").mkdir(parents=True)
    (out / "checkpoints" / "global_step_10").mkdir()
    (out / "hf_final").mkdir()
    shutil.copy(ROOT / "tests" / "data" / "metrics_fully_async.jsonl", out / "metrics.jsonl")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "kind": "tr')  # a record cut by a kill: skipped
    lines = summary_lines(out, 61.4, plots=str(out / "metrics.jsonl"))
    shutil.copy(ROOT / "tests" / "data" / "metrics_fully_async.jsonl", out / "metrics.jsonl")  # for check_summary
    assert check_summary("noise\n" + "\n".join(lines) + "\n", out) == lines
    assert lines[:5] == [
        "run summary: 8 steps, 61 s",
        "  training reward     first 0.2031 (step 1), last 0.4844 (step 8)",
        "  held-out accuracy   synthetic/arithmetic: best 0.5625 (step 8), last 0.5625 (step 8)",
        "  held-out accuracy   openai/gsm8k: best 0.0000 (step 0), last 0.0000 (step 8)",
        "  held-out accuracy   all: best 0.5070 (step 8), last 0.5070 (step 8)"]
    assert f"  checkpoints         {out / 'checkpoints'} (newest global_step_10)" in lines
    assert f"  final actor (HF)    {out / 'hf_final'}" in lines
    assert f"  metrics             {out / 'metrics.jsonl'}" in lines
