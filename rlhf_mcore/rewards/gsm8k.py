"""GSM8K rule reward with veRL's exact semantics (`verl/utils/reward_score/gsm8k.py`), so scores carry over.

- strict: the last `#### <number>` in the last 300 characters of the response. `<number>` is the longest run
  of `-`, digits, `.` and `,` after `#### `; commas are removed (and `$`, which the pattern cannot contain,
  so `#### $18` does not count: the model must write the bare number, as the prompt asks). Equal to the
  ground truth (as text) -> `score`, else `format_score`; no match -> 0.
- flexible: the last number-like run (`-`, digits, `.`, `,`) in the last 300 characters that is not just
  `.`, compared as written (commas are *not* removed, as in veRL).

Ground truths are the text after `#### ` in GSM8K's answer with commas removed (see `rlhf_mcore.data`).
"""
from __future__ import annotations

import re

__all__ = ["CLIP_CHARS", "extract_solution", "compute_score"]

CLIP_CHARS = 300  # only the tail is searched: answers come last, and regexes on long strings are slow
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer string the response commits to, or None (see the module docstring for the two methods)."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"GSM8K extraction method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _NUMBER.findall(tail)
    if not found:
        return None
    for candidate in reversed(found):
        if candidate not in ("", "."):
            return candidate
    return found[0]  # every match was "." (veRL returns the last one it looked at)


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` if the extracted answer equals `ground_truth`, `format_score` if an answer was found but differs,
    0.0 if none was found. veRL's signature."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth) else float(format_score)
