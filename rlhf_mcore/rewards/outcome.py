"""One reward-function call and what came of it: a score, or a failure that says what went wrong and where.

An outcome is `(status, payload)`: `("ok", (score, extra))`, or `(kind, failure)` with kind "exception",
"invalid" or "timeout" and `failure` a plain dict (it crosses process boundaries): `type` (the exception's
class name, or None), `message` (one line), `where` ("file:line in function" of the innermost frame, or
None) and `traceback` (the formatted traceback, or None).
"""
from __future__ import annotations

import math
import numbers
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["ScoringInterrupted", "normalize_reward", "call_reward_fn", "failure", "FAILURE_KINDS"]

FAILURE_KINDS = ("exception", "invalid", "timeout")
_MAX_MESSAGE = 300  # characters of an exception message kept
_MAX_TRACEBACK = 4000  # characters of a traceback kept (its end: the innermost frames)


class ScoringInterrupted(BaseException):
    """Raised inside an in-process reward call that passed its timeout. A BaseException, so that the
    `except Exception` of reward code (math-verify's, sympy's) does not swallow it."""


def normalize_reward(result: Any) -> tuple[float | None, dict | None, str | None]:
    """`(score, extra, problem)` from a reward function's return value.

    A finite real number (bools, numpy scalars and 0-dim tensors included) or a dict whose "score" is one is
    valid; anything else gives `score=None` and a `problem` description.
    """
    extra = None
    if isinstance(result, dict):
        if "score" not in result:
            return None, None, f"returned a dict without a 'score' key (keys: {sorted(result)[:8]})"
        extra = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    if isinstance(result, (str, bytes)) or not (isinstance(result, numbers.Real) or hasattr(result, "__float__")):
        return None, None, f"returned {type(result).__name__} {result!r:.80}, not a number"
    try:
        value = float(result)
    except (TypeError, ValueError) as exc:
        return None, None, f"returned {type(result).__name__} that float() rejects: {exc}"
    if not math.isfinite(value):
        return None, None, f"returned a non-finite score {value}"
    return value, extra, None


def failure(message: str, type_name: str | None = None, where: str | None = None,
            traceback_text: str | None = None) -> dict[str, Any]:
    """A failure payload (see the module docstring)."""
    return {"type": type_name, "message": _one_line(message), "where": where, "traceback": traceback_text}


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def _exception_failure(exc: BaseException) -> dict[str, Any]:
    """A failure payload for `exc` raised in a reward call: its type and message, the innermost frame as
    `where`, and the traceback below the frame that made the call."""
    try:
        message = str(exc)
    except Exception:  # a broken __str__ must not turn into a second failure
        message = f"<{type(exc).__name__} whose str() failed>"
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # drop the calling frame
    summary = traceback.TracebackException(type(exc), exc, tb, limit=None)
    frames = summary.stack
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else None
    text = "".join(summary.format())
    return failure(message, type(exc).__name__, where, text[-_MAX_TRACEBACK:])


def call_reward_fn(fn: Callable[..., Any], args: dict[str, Any]) -> tuple[str, Any]:
    """Call `fn(**args)` and return its outcome; only KeyboardInterrupt and ScoringInterrupted propagate."""
    try:
        result = fn(**args)
    except (KeyboardInterrupt, ScoringInterrupted):
        raise
    except BaseException as exc:  # noqa: B036 - math-verify's TimeoutException (and sys.exit) are BaseExceptions
        return "exception", _exception_failure(exc)
    value, extra, problem = normalize_reward(result)
    if problem is not None:
        return "invalid", failure(problem)
    return "ok", (value, extra)
