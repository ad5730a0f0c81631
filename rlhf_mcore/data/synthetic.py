"""A synthetic arithmetic task in the GSM8K schema, small enough for a tiny model to learn on CPU.

Problems are short templated questions — "What is 3 + 5?" or "Mia has 3 apples. Then she gets 5 more. How
many apples does Mia have now?" — with an exact integer answer. Difficulty `d` sets the number of operations
(`d`; d=0 asks to read a number back: "What is 47?", "Mia has 47 apples. How many ...") and the operands' size
(0-99 at d=0, 0-9 at d=1, 0-20 at d=2, 0-50 at d=3, 0-100 beyond; `max_operand` overrides it). Only `+`
and `-` are used and running totals never go negative. d=0 is what a 2-layer model learns quickly on CPU (the
demo and the learning tests); d=1 already takes far longer. Rows carry a GSM8K-style worked
solution in `extra_info.answer` (an SFT target, e.g. "3 + 5 = 8\\n#### 8") and `reward_model.ground_truth` =
the answer, so the GSM8K strict scorer (registered for `synthetic/arithmetic`) grades them. Generation is
deterministic in (seed, split, max_operand, period_answers).

`period_answers` (0 to 1) is the fraction of rows whose SFT target ends with a full stop, "#### 8." instead of
"#### 8": the strict scorer reads the answer as "8." and scores it 0. A warm start on such rows only half
follows the format the reward accepts, which is what the CPU demo gives RL to fix. Questions and ground truths
are the same whatever the fraction.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rlhf_mcore.data.preprocess import GSM8K_INSTRUCTION, write_parquet
from rlhf_mcore.data.schema import make_row

__all__ = ["DATA_SOURCE", "make_synthetic_rows", "write_synthetic_parquet"]

DATA_SOURCE = "synthetic/arithmetic"  # scored by rlhf_mcore.rewards (GSM8K strict)

_NAMES = [("Mia", "she"), ("Tom", "he"), ("Ana", "she"), ("Ben", "he"), ("Zoe", "she"), ("Sam", "he")]
_ITEMS = ["apples", "books", "coins", "marbles", "pens", "cards", "stickers", "shells"]


def _max_operand(difficulty: int) -> int:
    return {0: 99, 1: 9, 2: 20, 3: 50}.get(difficulty, 100)


def _draw_problem(rng: random.Random, difficulty: int, top: int) -> tuple[list[int], list[str]]:
    """Operands in 0..top and operators, evaluated left to right, never going below zero."""
    operands = [rng.randint(0, top)]
    ops: list[str] = []
    total = operands[0]
    for _ in range(difficulty):
        x = rng.randint(0, top)
        op = "-" if x <= total and rng.random() < 0.5 else "+"
        total = total + x if op == "+" else total - x
        operands.append(x)
        ops.append(op)
    return operands, ops


def _worked_solution(operands: list[int], ops: list[str], period: bool = False) -> tuple[str, int]:
    """GSM8K-style steps ("3 + 5 = 8" per line) and the final `#### answer` line (`period`: "#### 8.")."""
    lines, total = [], operands[0]
    for op, x in zip(ops, operands[1:], strict=True):
        result = total + x if op == "+" else total - x
        lines.append(f"{total} {op} {x} = {result}")
        total = result
    lines.append(f"#### {total}." if period else f"#### {total}")
    return "\n".join(lines), total


def _question(rng: random.Random, operands: list[int], ops: list[str]) -> str:
    if rng.random() < 0.5:
        expr = " ".join([str(operands[0])] + [f"{op} {x}" for op, x in zip(ops, operands[1:], strict=True)])
        return f"What is {expr}?"
    (name, pronoun), item = rng.choice(_NAMES), rng.choice(_ITEMS)
    steps = [f"gets {x} more" if op == "+" else f"gives away {x}" for op, x in zip(ops, operands[1:], strict=True)]
    then = f"Then {pronoun} {', then '.join(steps)}. " if steps else ""
    return f"{name} has {operands[0]} {item}. {then}How many {item} does {name} have now?"


def make_synthetic_rows(
    n: int, difficulty: int = 1, seed: int = 0, split: str = "train", *, exclude_questions: set[str] | None = None,
    max_operand: int | None = None, period_answers: float = 0.0,
) -> list[dict[str, Any]]:
    """`n` schema rows of difficulty `difficulty`, the same for the same (seed, split, max_operand, period_answers).

    `exclude_questions` (e.g. the training questions, when making a test split) are never produced.
    `period_answers`: the fraction of rows whose `extra_info.answer` ends "#### N." (module docstring).
    """
    if not isinstance(difficulty, int) or difficulty < 0:
        raise ValueError(f"difficulty must be an integer >= 0 (number of operations), got {difficulty!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if max_operand is not None and (not isinstance(max_operand, int) or max_operand < 1):
        raise ValueError(f"max_operand must be an integer >= 1, got {max_operand!r}")
    if not isinstance(period_answers, (int, float)) or not 0.0 <= period_answers <= 1.0:
        raise ValueError(f"period_answers must be a fraction in [0, 1], got {period_answers!r}")
    top = _max_operand(difficulty) if max_operand is None else max_operand
    key = f"{seed}:{split}:{difficulty}" + ("" if max_operand is None else f":{max_operand}")
    rng = random.Random(f"rlhf_mcore.synthetic:{key}")  # str seeds hash stably
    style_rng = random.Random(f"rlhf_mcore.synthetic.style:{key}")  # apart, so questions never depend on the mix
    exclude = exclude_questions or set()
    rows: list[dict[str, Any]] = []
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 100 * max(n, 1) + 1000:
            raise ValueError(
                f"could not draw {n} problems outside exclude_questions at difficulty {difficulty}; "
                "raise the difficulty or ask for fewer rows"
            )
        operands, ops = _draw_problem(rng, difficulty, top)
        question = _question(rng, operands, ops)
        if question in exclude:
            continue
        solution, answer = _worked_solution(operands, ops, period=style_rng.random() < period_answers)
        extra = {"split": split, "index": len(rows), "question": question, "answer": solution}
        rows.append(make_row(DATA_SOURCE, question + " " + GSM8K_INSTRUCTION, str(answer), extra))
    return rows


def write_synthetic_parquet(
    output_dir: str | Path, n: int, difficulty: int = 1, seed: int = 0, n_test: int | None = None,
    max_operand: int | None = None, period_answers: float = 0.0,
) -> dict[str, dict[str, Any]]:
    """Write `train.parquet` (n rows) and `test.parquet` (`n_test`, default max(n // 10, 1) rows, questions
    disjoint from train). Returns {split: {path, rows}}."""
    n_test = max(n // 10, 1) if n_test is None else n_test
    train = make_synthetic_rows(n, difficulty, seed, "train", max_operand=max_operand, period_answers=period_answers)
    seen = {row["extra_info"]["question"] for row in train}
    test = make_synthetic_rows(n_test, difficulty, seed, "test", exclude_questions=seen, max_operand=max_operand,
                               period_answers=period_answers)
    out = Path(output_dir).expanduser()
    return {
        split: {"path": str(write_parquet(rows, out / f"{split}.parquet")), "rows": len(rows)}
        for split, rows in (("train", train), ("test", test))
    }
