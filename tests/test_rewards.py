"""Rule rewards (GSM8K, MATH), the data_source registry, custom reward files and the batch scorer.

The GSM8K cases are hand-written against veRL's semantics (strict: last `#### <number>` in the last 300
characters; flexible: last number). The scorer tests use a custom reward file whose behaviour depends on the
response text (hang, raise, NaN, garbage, worker death), so one pool sees every failure in one batch.
"""
import logging
import pickle
import textwrap

import pytest

from rlhf_mcore.data.boxed import last_boxed_content
from rlhf_mcore.rewards import (
    RewardFileError,
    RewardScorer,
    default_compute_score,
    get_reward_fn,
    gsm8k,
    list_reward_sources,
    load_custom_reward_fn,
    normalize_reward,
    register_reward,
    score_batch,
)
from rlhf_mcore.rewards.math_reward import compute_score as math_score

# (response, ground_truth, method, expected score) with default format_score=0.0, score=1.0
GSM8K_CASES = [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", "strict", 1.0),
    ("#### 1,234", "1234", "strict", 1.0),  # commas stripped
    ("#### 1,000,000", "1000000", "strict", 1.0),
    ("She earns $18 a day.\n#### 18$", "18", "strict", 1.0),  # a trailing $ is outside the number
    ("#### $18", "18", "strict", 0.0),  # veRL: the number pattern cannot start with $, so no match
    ("#### -5", "-5", "strict", 1.0),  # negative
    ("#### 5", "-5", "strict", 0.0),
    ("#### 3.5", "3.5", "strict", 1.0),  # decimal
    ("#### 3.50", "3.5", "strict", 0.0),  # compared as text, as in veRL
    ("#### 72.", "72", "strict", 0.0),  # veRL quirk: the trailing period is part of the match
    ("first #### 10, then #### 12", "12", "strict", 1.0),  # several ####: the last counts
    ("#### 12\nwait, no\n#### 10", "12", "strict", 0.0),
    ("####12", "12", "strict", 0.0),  # the space after #### is required
    ("**#### 72**", "72", "strict", 1.0),
    ("#### 72" + "x" * 293, "72", "strict", 1.0),  # exactly 300 characters: still inside the window
    ("#### 72" + "x" * 294, "72", "strict", 0.0),  # one more: the first '#' falls outside the last 300
    ("no digits here at all", "72", "strict", 0.0),  # no number
    ("#### -", "72", "strict", 0.0),
    ("The total is 72 apples", "72", "strict", 0.0),  # strict needs ####
    ("The total is 72 apples", "72", "flexible", 1.0),
    ("3 boxes of 4 makes 12 in all", "12", "flexible", 1.0),  # the last number
    ("Answer: -7", "-7", "flexible", 1.0),
    ("It costs 1,000", "1000", "flexible", 0.0),  # flexible keeps commas (veRL)
    ("It costs 1,000", "1,000", "flexible", 1.0),
    ("so 2 + 2 = 4.", "4", "flexible", 0.0),  # veRL quirk: "4." is the last run
    ("42" + "x" * 400, "42", "flexible", 0.0),  # the number is outside the last 300 characters
    ("no digits here at all", "72", "flexible", 0.0),
    ("#### 72", 72, "strict", 1.0),  # an int ground truth is compared as text
]


@pytest.mark.parametrize("response,truth,method,expected", GSM8K_CASES)
def test_gsm8k_cases(response, truth, method, expected):
    assert gsm8k.compute_score(response, truth, method=method) == expected


def test_gsm8k_format_score_and_custom_score():
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1  # found but wrong
    assert gsm8k.compute_score("no answer", "72", format_score=0.1) == 0.0  # none found -> 0
    assert gsm8k.compute_score("#### 72", "72", score=2.0) == 2.0
    assert gsm8k.compute_score("Only a period.", "72", method="flexible", format_score=0.5) == 0.5  # "." found
    assert gsm8k.extract_solution("#### 1,234 and #### 5,6", "strict") == "56"
    with pytest.raises(ValueError, match="strict"):
        gsm8k.extract_solution("#### 1", method="loose")


@pytest.mark.parametrize(
    "response,truth,expected",
    [
        ("so x = \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("first \\boxed{1}, finally \\boxed{2}", "2", 1.0),  # the last box counts
        ("\\boxed{3}", "4", 0.0),
        ("the answer is 4", "4", 0.0),  # no box
        ("\\boxed{4", "4", 0.0),  # unclosed
        ("\\boxed{x^2+2x}", "x(x+2)", 1.0),
    ],
)
def test_math_reward(response, truth, expected):
    assert math_score(response, truth) == expected


def test_last_boxed_content_handles_nesting_and_forms():
    assert last_boxed_content("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed_content("$\\boxed 7$") == "7"
    assert last_boxed_content("\\fbox{10}") == "10"
    assert last_boxed_content("nothing") is None


def test_registry_dispatch_by_data_source():
    assert {"openai/gsm8k", "synthetic/arithmetic", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
            "HuggingFaceH4/MATH-500"} <= set(list_reward_sources())
    assert default_compute_score("openai/gsm8k", "#### 72", "72") == 1.0
    assert default_compute_score("synthetic/arithmetic", "3 + 5 = 8\n#### 8", "8") == 1.0
    assert default_compute_score("synthetic/arithmetic", "8", "8") == 0.0  # strict: needs ####
    assert default_compute_score("HuggingFaceH4/MATH-500", "\\boxed{0.5}", "\\frac12") == 1.0
    with pytest.raises(ValueError, match="custom_reward_function"):
        get_reward_fn("my/unknown")


def _length_reward(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": len(solution_str) / 10, "length": len(solution_str)}


def test_register_reward_and_score_through_the_pool():
    register_reward("test/length")(_length_reward)
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test/length")(lambda **_: 0.0)
    scores, stats = score_batch(["test/length", "openai/gsm8k"], ["abcde", "#### 3"], [None, "3"], num_workers=1)
    assert scores == [0.5, 1.0]
    assert stats["extra"][0] == {"length": 5}


def test_unknown_data_source_stops_the_batch_with_an_actionable_error():
    with pytest.raises(ValueError, match="register_reward"):
        score_batch(["openai/gsm8k", "nope/none"], ["#### 1", "x"], ["1", "1"])


# --------------------------------------------------------------------------------------------- custom files

CUSTOM_FILE = textwrap.dedent(
    """
    import math, os, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            time.sleep(1000)
        if solution_str == "raise":
            raise RuntimeError("scorer bug")
        if solution_str == "nan":
            return math.nan
        if solution_str == "text":
            return "1.0"
        if solution_str == "nodict":
            return {"acc": 1.0}
        if solution_str == "die":
            os._exit(3)
        if solution_str == "dict":
            return {"score": 0.25, "acc": True}
        return float(solution_str == ground_truth)

    def two_args(solution_str, ground_truth):
        return 1.0

    NOT_A_FUNCTION = 3
    """
)


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_FILE)
    return path


def test_load_custom_reward_fn_float_and_dict_returns(custom_file):
    fn = load_custom_reward_fn(str(custom_file), "compute_score")
    assert fn("ds", "42", "42") == 1.0
    assert fn(data_source="ds", solution_str="dict", ground_truth="x", extra_info={"a": 1}) == {"score": 0.25,
                                                                                                 "acc": True}
    clone = pickle.loads(pickle.dumps(fn))  # pickles as (path, name) for worker processes
    assert clone("ds", "7", "7") == 1.0 and clone.path == str(custom_file)


def test_load_custom_reward_fn_errors(custom_file, tmp_path):
    with pytest.raises(RewardFileError, match="custom_reward_function.path.*does not exist"):
        load_custom_reward_fn(str(tmp_path / "missing.py"))
    with pytest.raises(RewardFileError, match="no function 'score_fn'.*two_args"):
        load_custom_reward_fn(str(custom_file), "score_fn")
    with pytest.raises(RewardFileError, match="Did you mean 'compute_score'"):
        load_custom_reward_fn(str(custom_file), "compute_scores")
    with pytest.raises(RewardFileError, match="not a function"):
        load_custom_reward_fn(str(custom_file), "NOT_A_FUNCTION")
    with pytest.raises(RewardFileError, match="data_source, solution_str, ground_truth, extra_info=None"):
        load_custom_reward_fn(str(custom_file), "two_args")


def test_reward_file_that_cannot_be_imported_names_the_file_and_line(tmp_path):
    syntax = tmp_path / "syntax.py"
    syntax.write_text("import math\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None:\n"
                      "    return 1.0\n")
    with pytest.raises(RewardFileError) as info:
        load_custom_reward_fn(str(syntax))
    message = str(info.value)
    assert f"SyntaxError at {syntax}, line 3" in message and "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained traceback to print

    broken = tmp_path / "broken.py"
    broken.write_text("import os\nimport not_a_real_module_xyz\n")
    with pytest.raises(RewardFileError, match=f"ModuleNotFoundError at {broken}, line 2: .*not_a_real_module_xyz"):
        load_custom_reward_fn(str(broken))

    failing = tmp_path / "failing.py"
    failing.write_text("X = 1\nY = {}['missing']\n")
    with pytest.raises(RewardFileError, match=f"KeyError at {failing}, line 2"):
        load_custom_reward_fn(str(failing))
    # A fixed file loads afterwards (the failed import left no half-initialised module behind).
    failing.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                       "    return 2.0\n")
    assert load_custom_reward_fn(str(failing))("ds", "x", "y") == 2.0


def test_normalize_reward_accepts_numbers_and_rejects_garbage():
    import numpy as np

    assert normalize_reward(1)[0] == 1.0
    assert normalize_reward(True)[0] == 1.0
    assert normalize_reward(np.float32(0.5))[0] == 0.5
    assert normalize_reward({"score": 2, "x": 1})[:2] == (2.0, {"x": 1})
    for garbage in [float("nan"), float("inf"), "1.0", None, [1.0], {"acc": 1}, {"score": "1"}]:
        value, _, problem = normalize_reward(garbage)
        assert value is None and problem


# --------------------------------------------------------------------------------------------- batch scorer


def test_pool_survives_hang_raise_nan_garbage_and_worker_death(custom_file, caplog):
    fn = load_custom_reward_fn(str(custom_file))
    responses = ["7", "hang", "raise", "nan", "text", "nodict", "die", "dict", "8", "9"]
    truths = ["7", "0", "0", "0", "0", "0", "0", "0", "8", "0"]
    with RewardScorer(fn, num_workers=2, timeout_s=1.5, max_failure_ratio=1.0) as scorer:
        with caplog.at_level(logging.WARNING, logger="rlhf_mcore.rewards.scorer"):
            scores, stats = scorer.score(["ds"] * len(responses), responses, truths, [None] * len(responses))
        assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.25, 1.0, 0.0]
        assert stats["num_timeouts"] == 1  # hang
        assert stats["num_exceptions"] == 2  # raise, die
        assert stats["num_invalid"] == 3  # nan, text, nodict
        assert stats["num_failed"] == 6 and stats["num_items"] == 10
        assert any("RuntimeError: scorer bug" in e for e in stats["examples"])
        assert "6 of 10 items scored 0" in caplog.text
        # The same pool keeps working after killing and replacing workers.
        scores, stats = scorer.score(["ds"] * 3, ["1", "2", "dict"], ["1", "0", "x"])
        assert scores == [1.0, 0.0, 0.25] and stats["num_failed"] == 0


def test_inline_scoring_catches_errors_and_garbage(custom_file):
    fn = load_custom_reward_fn(str(custom_file))
    scores, stats = score_batch(["ds"] * 4, ["raise", "nan", "5", "nodict"], ["0", "0", "5", "0"], num_workers=0,
                                fn=fn, max_failure_ratio=1.0)
    assert scores == [0.0, 0.0, 1.0, 0.0]
    assert (stats["num_exceptions"], stats["num_invalid"], stats["num_timeouts"]) == (1, 2, 0)


def test_scorer_rejects_unpicklable_functions_and_bad_settings():
    with pytest.raises(TypeError, match="load_custom_reward_fn"):
        RewardScorer(lambda **_: 1.0, num_workers=1)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardScorer(num_workers=0, timeout_s=0)
    with pytest.raises(ValueError, match="max_failure_ratio"):
        RewardScorer(num_workers=0, max_failure_ratio=1.5)
    with pytest.raises(ValueError, match="one entry per item"):
        score_batch(["openai/gsm8k"], ["a", "b"], ["1"])
