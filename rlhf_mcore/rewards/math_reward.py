"""MATH-style rule reward: the last `\\boxed{...}` of the response, checked for mathematical equivalence with
the ground truth by `math-verify` (so `\\frac{1}{2}`, `0.5` and `\\dfrac12` all match).

Used for `DigitalLearningGmbH/MATH-lighteval`, `lighteval/MATH` and `HuggingFaceH4/MATH-500`. The same
`last_boxed_content` extracts ground truths from MATH solutions during preprocessing.
"""
from __future__ import annotations

import threading

__all__ = ["last_boxed_only_string", "last_boxed_content", "compute_score"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_VERIFY_TIMEOUT_S = 5  # math-verify's own (signal-based) limit for parsing and for comparing


def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) of `text` including the command, or None.

    Braces are matched, so nested groups such as `\\boxed{\\frac{1}{2}}` come out whole; an unclosed box
    gives None.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + len(cmd) :]
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):  # "\boxed 5$" form
        return cmd + " " + rest.lstrip().split("$")[0].strip()
    open_at = start + len(cmd) + (len(rest) - len(rest.lstrip()))
    if open_at >= len(text) or text[open_at] != "{":
        return None
    depth = 0
    for pos in range(open_at, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return text[start : pos + 1]
    return None


def last_boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}` of `text` (without the command and braces), or None."""
    boxed = last_boxed_only_string(text)
    if boxed is None:
        return None
    cmd = next(c for c in _BOX_COMMANDS if boxed.startswith(c))
    body = boxed[len(cmd) :].strip()
    return body[1:-1] if body.startswith("{") else body


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
