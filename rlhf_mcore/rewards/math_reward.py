"""MATH-style rule reward: the last `\\boxed{...}` of the response, checked for mathematical equivalence with
the ground truth by `math-verify` (so `\\frac{1}{2}`, `0.5` and `\\dfrac12` all match).

Used for `DigitalLearningGmbH/MATH-lighteval`, `lighteval/MATH` and `HuggingFaceH4/MATH-500`. The box is found
by :func:`rlhf_mcore.data.boxed.last_boxed_content`, which also extracts ground truths from MATH solutions during
preprocessing.
"""
from __future__ import annotations

import threading

from rlhf_mcore.data.boxed import last_boxed_content

__all__ = ["compute_score"]

_VERIFY_TIMEOUT_S = 5  # math-verify's own (signal-based) limit for parsing and for comparing


def _timeout_s() -> int | None:
    # math-verify enforces its limits with SIGALRM, which only the main thread may use.
    return _VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response's last `\\boxed{}` is equivalent to `ground_truth`, else 0.0 (no box: 0.0)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    answer = last_boxed_content(solution_str)
    if answer is None:
        return 0.0
    timeout = _timeout_s()
    try:
        gold = parse("\\boxed{" + str(ground_truth) + "}", [LatexExtractionConfig()], parsing_timeout=timeout)
        pred = parse(
            "\\boxed{" + answer + "}", [LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=timeout
        )
        if not gold or not pred:  # unparsable either side: fall back to exact text, spaces ignored
            return float(answer.replace(" ", "") == str(ground_truth).replace(" ", ""))
        return float(verify(gold, pred, timeout_seconds=timeout))
    except TimeoutException:
        return 0.0
