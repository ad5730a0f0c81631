"""veRL's RL dataset schema: building rows and checking them.

One row::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "... Let's think step by step ..."}],   # chat messages
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, "question": "...", "answer": "..."}}

`data_source` picks the reward function (`rlhf_mcore.rewards`), `reward_model.ground_truth` is what it
compares against, `extra_info` is passed to the reward function untouched.
"""
from __future__ import annotations

from typing import Any

from rlhf_mcore.errors import UserError

__all__ = ["DataError", "BadRowError", "make_row", "check_row"]


class DataError(UserError, ValueError):
    """Input data a run cannot use (malformed rows, over-long prompts, empty files); the message names the file,
    the row and the field, and the launch scripts print it without a traceback."""


class BadRowError(DataError):
    """A row that does not follow the schema; `field` names the offending field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"field {field!r} {problem}")
        self.field = field
        self.problem = problem


def make_row(
    data_source: str, content: str, ground_truth: str, extra_info: dict[str, Any], ability: str = "math"
) -> dict[str, Any]:
    """A schema row with a single user message."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra_info,
    }


def _check_messages(messages: Any, field: str) -> list[dict[str, str]]:
    if hasattr(messages, "tolist"):  # numpy arrays from pandas-backed readers
        messages = messages.tolist()
    if not isinstance(messages, list) or not messages:
        raise BadRowError(field, f"must be a non-empty list of chat messages, got {type(messages).__name__}")
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRowError(field, f"message {k} must be a dict with 'role' and 'content', got {message!r:.60}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise BadRowError(field, f"message {k} needs a string {key!r}, got {message.get(key)!r:.60}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def check_row(row: dict[str, Any], prompt_key: str = "prompt") -> tuple[list[dict[str, str]], str, Any, dict]:
    """Validate a row; returns `(messages, data_source, ground_truth, extra_info)` or raises BadRowError."""
    messages = _check_messages(row.get(prompt_key), prompt_key)
    data_source = row.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise BadRowError("data_source", f"must be a non-empty string, got {data_source!r:.60}")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict):
        raise BadRowError("reward_model", f"must be a dict with a 'ground_truth', got {reward_model!r:.60}")
    ground_truth = reward_model.get("ground_truth")
    if hasattr(ground_truth, "tolist"):
        ground_truth = ground_truth.tolist()
    if ground_truth is None or not isinstance(ground_truth, (str, int, float, list)) or isinstance(ground_truth, bool):
        raise BadRowError("reward_model.ground_truth", f"must be a string (or number/list), got {ground_truth!r:.60}")
    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, dict):
        raise BadRowError("extra_info", f"must be a dict or missing, got {type(extra_info).__name__}")
    return messages, data_source, ground_truth, extra_info
