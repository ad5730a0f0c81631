"""Errors that mean "fix your reward function or its config": their message is one line the entry point prints
without a traceback.

- :class:`RewardFileError` — `reward.custom_reward_function.path`/`.name` cannot be loaded (missing file, syntax
  error, failing import, missing function, wrong signature); the message names the file and, where there is
  one, the line.
- :class:`RewardFunctionError` — too many items of one batch failed (raised, returned no valid number, timed
  out): more than `reward.max_failure_ratio`. It carries the first failure's exception type, message, location
  and traceback text (`traceback_text`, from the worker process when there is one).
"""
from __future__ import annotations

from typing import Any

from rlhf_mcore.errors import UserError

__all__ = ["RewardError", "RewardFileError", "RewardFunctionError"]


class RewardError(UserError):
    """A reward problem the user must fix; the message says what, where, and what to change."""

    kind = "reward error"


class RewardFileError(RewardError):
    """The custom reward file or function cannot be loaded."""


class RewardFunctionError(RewardError):
    """The reward function failed on more than `max_failure_ratio` of a batch's items.

    Attributes: `num_items`, `counts` (`{"exceptions": n, "invalid": n, "timeouts": n}`), `max_failure_ratio`,
    `first_failure` (a dict: `item`, `data_source`, `kind` — "exception" | "invalid" | "timeout" —, `type`,
    `message`, `where`, `traceback`) and `traceback_text` (the first failure's traceback, or "").
    """

    def __init__(self, message: str, *, num_items: int, counts: dict[str, int], max_failure_ratio: float,
                 first_failure: dict[str, Any] | None):
        super().__init__(message)
        self.num_items = num_items
        self.counts = dict(counts)
        self.max_failure_ratio = max_failure_ratio
        self.first_failure = first_failure
        self.traceback_text = (first_failure or {}).get("traceback") or ""

    def __reduce__(self):  # keeps the keyword-only fields through pickling (all_gather_object, worker results)
        return _rebuild, (self.args[0], self.num_items, self.counts, self.max_failure_ratio, self.first_failure)


def _rebuild(message, num_items, counts, max_failure_ratio, first_failure) -> RewardFunctionError:
    return RewardFunctionError(message, num_items=num_items, counts=counts, max_failure_ratio=max_failure_ratio,
                               first_failure=first_failure)
