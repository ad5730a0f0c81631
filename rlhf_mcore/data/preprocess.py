"""Raw GSM8K / MATH files (jsonl or parquet) -> `train.parquet` / `test.parquet` in veRL's schema.

GSM8K, as veRL does it: prompt = question + ` Let's think step by step and output the final answer after
"####".`; ground truth = the number after the first `#### ` of the reference answer, commas removed;
`extra_info` = {split, index, question, answer}. MATH: prompt = problem + ` Let's think step by step and
output the final answer within \\boxed{}.`; ground truth = the content of the solution's last `\\boxed{}`.

Input discovery in `input_dir` for each split: `<split>.jsonl`, `<split>.json` (JSON lines), `<split>.parquet`,
or Hugging Face hub shards `**/<split>-*.parquet` (all shards, in name order).
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_mcore.data.boxed import last_boxed_content
from rlhf_mcore.data.schema import DataError, make_row

__all__ = [
    "VENDORED_GSM8K_DIR",
    "GSM8K_INSTRUCTION",
    "MATH_INSTRUCTION",
    "find_split_files",
    "read_records",
    "gsm8k_ground_truth",
    "gsm8k_row",
    "math_row",
    "write_parquet",
    "preprocess_gsm8k",
    "preprocess_math",
]

logger = logging.getLogger(__name__)

VENDORED_GSM8K_DIR = Path(__file__).resolve().parent / "raw" / "gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SPLITS = ("train", "test")
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


class RecordError(DataError):
    """A raw record that cannot be converted; the message names the file, the row and the field."""


def find_split_files(input_dir: str | Path, split: str) -> list[Path]:
    """The raw files holding `split` in `input_dir` (see the module docstring); [] if none."""
    root = Path(input_dir)
    for name in (f"{split}.jsonl", f"{split}.json", f"{split}.parquet"):
        if (root / name).is_file():
            return [root / name]
    return sorted(root.glob(f"**/{split}-*.parquet")) or sorted(root.glob(f"**/{split}-*.jsonl"))


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSON-lines or parquet file as dicts."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise RecordError(f"{path}: line {line_no} is not valid JSON ({exc})") from None
    return records


def _text_field(record: dict[str, Any], field: str, where: str) -> str:
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str) or not value.strip():
        raise RecordError(f"{where}: field {field!r} must be a non-empty string, got {value!r:.80}")
    return value


def gsm8k_ground_truth(answer: str) -> str | None:
    """The number after the first `#### ` of a GSM8K reference answer, commas removed; None if absent."""
    match = _GSM8K_ANSWER.search(answer)
    return match.group(1).replace(",", "") if match else None


def gsm8k_row(record: dict[str, Any], split: str, index: int, where: str = "") -> dict[str, Any]:
    """One GSM8K record ({question, answer}) as a schema row."""
    question = _text_field(record, "question", where)
    answer = _text_field(record, "answer", where)
    truth = gsm8k_ground_truth(answer)
    if truth is None:
        raise RecordError(f"{where}: field 'answer' has no '#### <number>' final answer: {answer[-80:]!r}")
    extra = {"split": split, "index": index, "question": question, "answer": answer}
    return make_row("openai/gsm8k", question + " " + GSM8K_INSTRUCTION, truth, extra)


def math_row(
    record: dict[str, Any],
    split: str,
    index: int,
    where: str = "",
    data_source: str = "DigitalLearningGmbH/MATH-lighteval",
) -> dict[str, Any]:
    """One MATH record ({problem, solution}) as a schema row; ground truth = the solution's last boxed answer."""
    problem = _text_field(record, "problem", where)
    solution = _text_field(record, "solution", where)
    truth = last_boxed_content(solution)
    if truth is None:
        raise RecordError(f"{where}: field 'solution' has no \\boxed{{...}} answer: {solution[-80:]!r}")
    extra = {"split": split, "index": index, "question": problem, "answer": solution}
    return make_row(data_source, problem + " " + MATH_INSTRUCTION, truth, extra)


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write schema rows to one parquet file (nested columns as Arrow structs/lists, as veRL's files)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _convert(
    input_dir: str | Path,
    output_dir: str | Path,
    to_row: Callable[..., dict[str, Any]],
    on_bad_row: str,
    task: str,
) -> dict[str, dict[str, Any]]:
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    input_dir = Path(input_dir).expanduser()
    if not input_dir.is_dir():
        raise FileNotFoundError(f"--input-dir {str(input_dir)!r} is not a directory")
    summary: dict[str, dict[str, Any]] = {}
    for split in SPLITS:
        files = find_split_files(input_dir, split)
        if not files:
            continue
        rows, skipped, position = [], 0, 0
        for file in files:
            for i, record in enumerate(read_records(file)):
                where = f"{file}: row {i}"
                position += 1
                try:  # extra_info.index is the record's position in the raw split (as veRL's with_indices)
                    rows.append(to_row(record, split, position - 1, where))
                except RecordError as exc:
                    if on_bad_row == "error":
                        raise RecordError(f"{exc} (pass --on-bad-row skip to drop such rows)") from None
                    skipped += 1
                    logger.warning("skipping %s", exc)
        out = write_parquet(rows, Path(output_dir).expanduser() / f"{split}.parquet")
        summary[split] = {"path": str(out), "rows": len(rows), "skipped": skipped, "inputs": [str(f) for f in files]}
    if not summary:
        raise FileNotFoundError(
            f"no {task} input in {str(input_dir)!r}: expected train/test as .jsonl, .json or .parquet "
            "(or hub shards like data/train-00000-of-00001.parquet)"
        )
    return summary


def preprocess_gsm8k(
    input_dir: str | Path = VENDORED_GSM8K_DIR, output_dir: str | Path = "~/data/gsm8k", on_bad_row: str = "error"
) -> dict[str, dict[str, Any]]:
    """Convert GSM8K; returns {split: {path, rows, skipped, inputs}}. Defaults to the vendored copy."""
    return _convert(input_dir, output_dir, gsm8k_row, on_bad_row, "GSM8K")


def preprocess_math(
    input_dir: str | Path,
    output_dir: str | Path = "~/data/math",
    on_bad_row: str = "error",
    data_source: str = "DigitalLearningGmbH/MATH-lighteval",
) -> dict[str, dict[str, Any]]:
    """Convert MATH ({problem, solution} records); returns {split: {path, rows, skipped, inputs}}."""

    def to_row(record, split, index, where):
        return math_row(record, split, index, where, data_source=data_source)

    return _convert(input_dir, output_dir, to_row, on_bad_row, "MATH")
