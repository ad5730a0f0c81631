"""Pairwise preference data (veRL's / TRL's schema: `prompt`, `chosen`, `rejected`) for reward-model training.

Reading (:func:`read_preference_rows`): `prompt` is a list of chat messages (veRL's RL schema) or a string (one
user turn); `chosen` / `rejected` are strings or message lists (TRL's conversational form; the last message's
content is the response). A missing column or a malformed row is a :class:`DataError` naming the file, the row
and the fix.

Synthetic preferences (:func:`write_synthetic_preferences`) come from the synthetic arithmetic task
(:mod:`rlhf_mcore.data.synthetic`): the prompt is the RL prompt, `chosen` the worked solution in the format the
strict GSM8K reward accepts ("... #### 47") and `rejected` one the reward scores 0, in equal shares of the
`rejected_kinds` (all three by default, cycling row by row): `wrong_number` ("#### 48"), `full_stop` (the right
number with a full stop, "#### 47.", the warm start's habit in the demo) and `both` ("#### 48."). A reward
model that learns these preferences ranks responses as the rule reward does, without being told the rule; a tiny
model learns the full stop at once and the wrong number much later (it must compare digits across the
conversation).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rlhf_mcore.data.preprocess import write_parquet
from rlhf_mcore.data.schema import DataError
from rlhf_mcore.data.synthetic import make_synthetic_rows

REJECTED_KINDS = ("wrong_number", "full_stop", "both")
__all__ = ["PREFERENCE_COLUMNS", "REJECTED_KINDS", "read_preference_rows", "make_synthetic_preferences",
           "write_synthetic_preferences"]

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")


def _messages(value: Any, path: str, row: int) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) and "content" in m for m in value):
        return [{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in value]
    raise DataError(f"{path}, row {row}: 'prompt' must be a string or a list of chat messages "
                    f"({{'role', 'content'}}), got {type(value).__name__}")


def _response(value: Any, key: str, path: str, row: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and isinstance(value[-1], dict) and "content" in value[-1]:
        return str(value[-1]["content"])
    raise DataError(f"{path}, row {row}: '{key}' must be a string or a list of chat messages, got "
                    f"{type(value).__name__}")


def read_preference_rows(path: str | Path) -> list[tuple[list[dict[str, str]], str, str]]:
    """(prompt messages, chosen response, rejected response) per row of a parquet file."""
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise DataError(f"preference file {str(path)!r} does not exist (write one with `python "
                        f"launch/preprocess_data.py synthetic-preferences --output-dir DIR`)")
    table = pq.read_table(p)
    missing = [c for c in PREFERENCE_COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(f"preference file {str(path)!r} lacks column(s) {missing}: it has {table.column_names}. "
                        f"Pairwise data needs {list(PREFERENCE_COLUMNS)} (veRL's / TRL's schema); rename the columns "
                        f"or convert the file.")
    rows = []
    for i, r in enumerate(table.select(list(PREFERENCE_COLUMNS)).to_pylist()):
        rows.append((_messages(r["prompt"], str(path), i), _response(r["chosen"], "chosen", str(path), i),
                     _response(r["rejected"], "rejected", str(path), i)))
    if not rows:
        raise DataError(f"preference file {str(path)!r} has no rows")
    return rows


def _rejected_answer(solution: str, answer: int, kind: str, rng: random.Random) -> str:
    """The worked solution with its final line made wrong (`wrong_number`), given a full stop (`full_stop`), or
    both."""
    head = solution.rsplit("####", 1)[0]
    wrong = answer + rng.choice([-3, -2, -1, 1, 2, 3])
    if wrong < 0:
        wrong = answer + rng.randint(1, 3)
    final = {"wrong_number": f"#### {wrong}", "full_stop": f"#### {answer}.", "both": f"#### {wrong}."}[kind]
    return head + final


def make_synthetic_preferences(n: int, seed: int = 0, split: str = "train", difficulty: int = 0,
                               exclude_questions: set[str] | None = None, max_operand: int | None = None,
                               rejected_kinds: tuple[str, ...] = REJECTED_KINDS) -> list[dict[str, Any]]:
    """`n` preference rows from the synthetic task (module docstring); deterministic in its arguments."""
    bad = [k for k in rejected_kinds if k not in REJECTED_KINDS]
    if bad or not rejected_kinds:
        raise ValueError(f"rejected kinds {list(rejected_kinds)}: choose from {list(REJECTED_KINDS)}")
    rng = random.Random(f"rlhf_mcore.preferences:{seed}:{split}:{difficulty}:{max_operand}")
    rows = []
    for k, row in enumerate(make_synthetic_rows(n, difficulty, seed, split, exclude_questions=exclude_questions,
                                                max_operand=max_operand)):
        solution = row["extra_info"]["answer"]  # "... #### 47", the format the strict reward accepts
        answer = int(row["reward_model"]["ground_truth"])
        rows.append({"prompt": row["prompt"], "chosen": solution,
                     "rejected": _rejected_answer(solution, answer, rejected_kinds[k % len(rejected_kinds)], rng),
                     "data_source": row["data_source"], "ground_truth": str(answer)})
    return rows


def write_synthetic_preferences(output_dir: str | Path, n: int, seed: int = 0, n_test: int | None = None,
                                difficulty: int = 0, max_operand: int | None = None,
                                rejected_kinds: tuple[str, ...] = REJECTED_KINDS) -> dict[str, dict[str, Any]]:
    """`train.parquet` (n pairs) and `test.parquet` (`n_test`, default max(n // 10, 1); questions disjoint from
    train) under `output_dir`. Returns {split: {path, rows}}."""
    n_test = max(n // 10, 1) if n_test is None else n_test
    kw = dict(max_operand=max_operand, rejected_kinds=tuple(rejected_kinds))
    train = make_synthetic_preferences(n, seed, "train", difficulty, **kw)
    seen = {r["prompt"][0]["content"].split(" Let's think")[0] for r in train}
    test = make_synthetic_preferences(n_test, seed, "test", difficulty, exclude_questions=seen, **kw)
    out = Path(output_dir).expanduser()
    return {split: {"path": str(write_parquet(rows, out / f"{split}.parquet")), "rows": len(rows)}
            for split, rows in (("train", train), ("test", test))}
