"""Fault injection into reward scoring, in both scorer modes (in-process, `num_workers=0`, and a worker pool):
a hanging function times out (scores 0, counted, its worker replaced or its call interrupted) and later items
still score; raising and NaN-returning functions are counted below `max_failure_ratio` and stop the run with
the function's own error above it. Calls that cannot be interrupted in-process end the process (exit 1, stack on
stderr) instead of hanging it. Also: the config check of the ratio and the CLI's one-line report."""
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from subprocess_env import child_env

from rlhf_mcore.config import ConfigError, load_config, validate_config
from rlhf_mcore.rewards import (
    RewardFunctionError,
    RewardScorer,
    failure_error,
    load_custom_reward_fn,
    reward_metrics,
)

pytestmark = pytest.mark.cost(15)

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 0.5

REWARD_FILE = textwrap.dedent(
    """
    import math, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            time.sleep(1000)  # HANG LINE
        if solution_str == "spin":
            while True:
                pass
        if solution_str == "raise":
            raise ValueError(f"broken reward for {ground_truth!r}")  # RAISE LINE
        if solution_str == "nan":
            return math.nan
        return float(solution_str == ground_truth)
    """
)


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(REWARD_FILE.splitlines(), 1) if marker in text)


@pytest.fixture(scope="module")
def reward_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "faulty_reward.py"
    path.write_text(REWARD_FILE)
    return path


@pytest.fixture(scope="module", params=[0, 2], ids=["inline", "workers"])
def scorer(request, reward_path):
    """One scorer per mode for the whole module (workers are started once); tests set max_failure_ratio."""
    with RewardScorer(load_custom_reward_fn(str(reward_path)), num_workers=request.param, timeout_s=TIMEOUT_S) as s:
        yield s


def _score(scorer, responses, truths, ratio):
    scorer.max_failure_ratio = ratio
    return scorer.score(["test/faults"] * len(responses), responses, truths)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --------------------------------------------------------------------------------------------- hangs


def test_hanging_item_times_out_scores_zero_and_later_items_score(scorer, reward_path):
    pids = scorer.worker_pids()
    start = time.monotonic()
    scores, stats = _score(scorer, ["1", "hang", "2", "x", "3"], ["1", "0", "2", "0", "3"], ratio=0.5)
    elapsed = time.monotonic() - start
    assert scores == [1.0, 0.0, 1.0, 0.0, 1.0]  # items after the hang score normally
    assert (stats["num_timeouts"], stats["num_exceptions"], stats["num_invalid"]) == (1, 0, 0)
    assert stats["first_failure"]["item"] == 1 and stats["first_failure"]["kind"] == "timeout"
    assert "reward.timeout_s=0.5" in stats["first_failure"]["message"]
    assert elapsed < TIMEOUT_S + 4.0  # one timeout, not the 1000 s sleep
    if scorer.num_workers:
        replaced = set(pids) - set(scorer.worker_pids())
        assert len(replaced) == 1 and len(scorer.worker_pids()) == 2  # the hung worker, and only it
        assert not _alive(replaced.pop())
    else:  # the interrupted call says where it was stuck
        assert stats["first_failure"]["where"] == f"{reward_path}:{_line('HANG LINE')} in compute_score"
    # The next batch runs on the same scorer at full health.
    scores, stats = _score(scorer, ["4", "5"], ["4", "0"], ratio=0.5)
    assert scores == [1.0, 0.0] and stats["num_failed"] == 0


def test_busy_looping_item_times_out(scorer):
    scores, stats = _score(scorer, ["spin", "7"], ["0", "7"], ratio=0.5)
    assert scores == [0.0, 1.0] and stats["num_timeouts"] == 1


def test_too_many_timeouts_fail_the_batch(scorer):
    with pytest.raises(RewardFunctionError, match=r"failed on 2 of 3 items .*2 timed out") as info:
        _score(scorer, ["hang", "spin", "1"], ["0", "0", "1"], ratio=0.5)
    assert info.value.counts == {"exceptions": 0, "invalid": 0, "timeouts": 2}
    scores, _ = _score(scorer, ["1"], ["1"], ratio=0.5)  # still usable afterwards
    assert scores == [1.0]


def test_worker_stuck_loading_the_function_fails_loudly(tmp_path, monkeypatch):
    from rlhf_mcore.rewards import scorer as scorer_module

    path = tmp_path / "slow_import.py"
    path.write_text("import sys, time\n"
                    "if sys.argv[0] == '-c' and sys.argv[1:2] and sys.argv[1].isdigit():  # reward workers only\n"
                    "    time.sleep(1000)\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return 1.0\n")
    monkeypatch.setattr(scorer_module, "_STARTUP_S", 1.0)
    with RewardScorer(load_custom_reward_fn(str(path)), num_workers=1, timeout_s=TIMEOUT_S) as scorer:
        pids = scorer.worker_pids()
        with pytest.raises(RewardFunctionError, match="did not load the reward function .* importing it hangs"):
            scorer.score(["d"], ["x"], ["x"])
        assert not _alive(pids[0])


def test_inline_timeout_from_a_thread_other_than_main(reward_path):
    """Not the main thread: no signal; the watchdog raises in the calling thread instead."""
    out = {}
    with RewardScorer(load_custom_reward_fn(str(reward_path)), num_workers=0, timeout_s=TIMEOUT_S) as scorer:
        worker = threading.Thread(target=lambda: out.update(result=scorer.score(["d"] * 3, ["spin", "1", "2"],
                                                                                ["0", "1", "0"])))
        worker.start()
        worker.join(30)
    assert not worker.is_alive()
    scores, stats = out["result"]
    assert scores == [0.0, 1.0, 0.0] and stats["num_timeouts"] == 1


# --------------------------------------------------------------------------------------------- raise / NaN


def test_raising_below_the_ratio_counts_and_scores_zero(scorer):
    scores, stats = _score(scorer, ["1", "raise", "2", "3"], ["1", "a", "2", "0"], ratio=0.5)
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert (stats["num_exceptions"], stats["num_invalid"], stats["num_timeouts"]) == (1, 0, 0)
    assert stats["first_failure"]["type"] == "ValueError"
    assert stats["first_failure"]["message"] == "broken reward for 'a'"


def test_raising_above_the_ratio_raises_the_functions_own_error(scorer, reward_path):
    with pytest.raises(RewardFunctionError) as info:
        _score(scorer, ["raise", "raise", "1"], ["a", "b", "1"], ratio=0.5)
    error = info.value
    message = str(error)
    assert "\n" not in message  # the entry point prints it as one line
    assert "failed on 2 of 3 items" in message and "reward.max_failure_ratio=0.5" in message
    assert f"ValueError: broken reward for 'a' (at {reward_path}:{_line('RAISE LINE')} in compute_score)" in message
    assert f"compute_score from {reward_path}" in message
    assert error.counts == {"exceptions": 2, "invalid": 0, "timeouts": 0} and error.num_items == 3
    # The traceback text comes from where the function ran (the worker process, with workers).
    assert 'raise ValueError(f"broken reward for {ground_truth!r}")' in error.traceback_text
    assert error.traceback_text.rstrip().endswith("ValueError: broken reward for 'a'")


def test_nan_below_the_ratio_counts_and_scores_zero(scorer):
    scores, stats = _score(scorer, ["nan", "1", "2"], ["0", "1", "2"], ratio=0.5)
    assert scores == [0.0, 1.0, 1.0]
    assert (stats["num_invalid"], stats["num_exceptions"], stats["num_timeouts"]) == (1, 0, 0)


def test_nan_above_the_ratio_raises(scorer):
    with pytest.raises(RewardFunctionError, match=r"2 returned no valid number.*returned a non-finite score nan"):
        _score(scorer, ["nan", "nan", "1"], ["0", "0", "1"], ratio=0.5)


def test_ratio_bounds_exactly_at_zero_and_one(scorer):
    # Exactly at the ratio passes; any failure fails at 0.0; nothing fails at 1.0.
    _, stats = _score(scorer, ["raise", "1"], ["0", "1"], ratio=0.5)
    assert stats["num_failed"] == 1
    with pytest.raises(RewardFunctionError, match="failed on 1 of 3 items"):
        _score(scorer, ["nan", "1", "2"], ["0", "1", "2"], ratio=0.0)
    scores, stats = _score(scorer, ["raise", "nan"], ["0", "0"], ratio=1.0)
    assert scores == [0.0, 0.0] and stats["num_failed"] == 2


# --------------------------------------------------------------------------------------------- trainer API


def test_metrics_and_a_check_over_summed_stats():
    """With several scoring ranks the trainer can score with check=False, sum the counts, and check once."""
    fn = lambda data_source, solution_str, ground_truth, extra_info=None: (  # noqa: E731
        1.0 if solution_str == "ok" else float("nan"))
    with RewardScorer(fn, num_workers=0, timeout_s=TIMEOUT_S, max_failure_ratio=0.5) as scorer:
        _, a = scorer.score(["d"] * 2, ["bad", "bad"], [0, 0], check=False)  # 100% on this rank: not raised
        _, b = scorer.score(["d"] * 2, ["ok", "ok"], [0, 0])
    assert reward_metrics(a) == {"reward/num_timeouts": 0.0, "reward/num_exceptions": 0.0, "reward/num_invalid": 2.0}
    assert reward_metrics({}) == {"reward/num_timeouts": 0.0, "reward/num_exceptions": 0.0, "reward/num_invalid": 0.0}
    total = {k: a[k] + b[k] for k in ("num_items", "num_failed", "num_timeouts", "num_exceptions", "num_invalid")}
    total.update(first_failure=a["first_failure"], reward_fn=a["reward_fn"])
    assert failure_error(total, 0.5) is None  # 2 of 4
    error = failure_error(total, 0.25)
    assert isinstance(error, RewardFunctionError) and "failed on 2 of 4 items" in str(error)


# --------------------------------------------------------------------------------------------- no silent hang

STUCK_SCRIPT = textwrap.dedent(
    """
    import re, sys, time
    from rlhf_mcore.rewards import RewardScorer

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "swallow":  # catches the interrupt and carries on
            while True:
                try:
                    time.sleep(100)
                except BaseException:
                    pass
        if solution_str == "regex":  # catastrophic backtracking: native code holding the GIL
            re.match(r"(a+)+$", "a" * 60 + "b")
        return 1.0

    scorer = RewardScorer(compute_score, num_workers=0, timeout_s=0.3)
    print("first", scorer.score(["d"], ["ok"], [0])[0], flush=True)
    scorer.score(["d"], [sys.argv[1]], [0])
    print("returned", flush=True)
    """
)


@pytest.mark.parametrize("behaviour,expected", [
    ("swallow", "still running 2 s later"),  # the watchdog explains, then ends the process
    ("regex", "Timeout ("),  # the GIL is held: faulthandler's timer thread dumps the stacks and exits
])
def test_inline_call_that_cannot_be_interrupted_ends_the_process(tmp_path, behaviour, expected):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_SCRIPT)
    env = child_env()
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), behaviour], capture_output=True, text=True, timeout=60,
                          env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "first [1.0]" in proc.stdout and "returned" not in proc.stdout
    assert expected in proc.stderr
    assert "compute_score" in proc.stderr  # the stuck frame is shown
    assert time.monotonic() - start < 30


# --------------------------------------------------------------------------------------------- config and CLI


MODEL = ["actor_rollout_ref.model.path=/models/m", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
         "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]


@pytest.mark.parametrize("value", ["-0.1", "1.5"])
def test_max_failure_ratio_is_checked_at_config_time(value):
    with pytest.raises(ConfigError, match=rf"reward.max_failure_ratio' has value {value}; it must be in \[0, 1\]"):
        load_config(None, MODEL + [f"reward.max_failure_ratio={value}"])


def test_default_ratio_validates_and_reaches_the_scorer():
    from rlhf_mcore.trainer.roles import build_scorer

    cfg = load_config(None, MODEL + ["reward.max_failure_ratio=0.25"])
    validate_config(cfg, world_size=1)
    assert load_config(None, MODEL).reward.max_failure_ratio == 0.5
    with build_scorer(cfg) as scorer:
        assert scorer.max_failure_ratio == 0.25 and scorer.num_workers == 0


def test_cli_reports_reward_errors_as_one_line(tmp_path, capsys, monkeypatch):
    from rlhf_mcore.cli import main

    def run(cfg):
        with RewardScorer(lambda **_: float("nan"), num_workers=0) as scorer:
            scorer.score(["d"], ["x"], [0])

    assert main(run, MODEL) == 2
    err = capsys.readouterr().err
    assert err.startswith("reward error: reward function") and err.count("\n") == 1

    monkeypatch.setenv("RANK", "3")  # raised on a rank other than 0: still reported, with the rank
    assert main(run, MODEL) == 2
    err = capsys.readouterr().err
    assert err.startswith("[rank 3] reward error:")

    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")

    def load(cfg):
        load_custom_reward_fn(str(broken))

    monkeypatch.setenv("RANK", "0")
    assert main(load, MODEL) == 2
    err = capsys.readouterr().err
    assert err.startswith("reward error: ") and f"SyntaxError at {broken}, line 1" in err and err.count("\n") == 1
