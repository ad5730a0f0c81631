"""`RLDataset`: prompts from parquet files in veRL's schema, rendered with the tokenizer's chat template.

Construction reads every file with Hugging Face `datasets`, checks every row against the schema, renders
`apply_chat_template(messages, add_generation_prompt=True)` and tokenizes, then applies the length policy,
so problems surface before training starts rather than at step 3,000:

- a malformed row (missing or ill-typed `prompt`, `data_source`, `reward_model.ground_truth`, `extra_info`)
  raises an error naming the file, the row and the field (`on_bad_row="error"`), or is skipped and counted
  (`on_bad_row="skip"`);
- a prompt longer than `max_prompt_length` tokens raises an error naming the row (`truncation="error"`),
  keeps its last / first `max_prompt_length` tokens (`"left"` / `"right"`), or is dropped and counted
  (`"filter"`).

Counts are in `dataset.stats` and logged. Items are dicts::

    {"input_ids": list[int] (unpadded), "raw_prompt": messages, "data_source": str, "ground_truth": ...,
     "extra_info": dict, "index": int, "agent_name": str | None}   # index: the item's position (0..len-1)

A step reads each of its prompts about three times (the plan's lengths, the generation, the batch's scoring
fields): the last `ITEM_CACHE` rows read are kept parsed, so only the first read goes through `datasets` (~40-120 us a
row; 256 prompts a step three times took 30-90 ms of the PPO step's host time). Each read returns a new dict and a new
`input_ids` list; the nested values (messages, ground truth, extra_info) are shared between reads: read-only.

Batch them with :class:`rlhf_mcore.data.collate.LeftPadCollator`, order them with
:class:`rlhf_mcore.data.sampler.ResumableSampler`.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlhf_mcore.data.schema import BadRowError, DataError, check_row

__all__ = ["RLDataset", "TRUNCATION_MODES"]

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "filter")
_READ_CHUNK = 1024  # rows rendered and tokenized per tokenizer call
ITEM_CACHE = 4096  # parsed rows kept, the least recently read out first: a step's prompts between first and last read


def _load(path: Path, cache_dir: str | None):
    import datasets

    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist (data.train_files / data.val_files)")
    if path.suffix not in (".parquet", ".jsonl", ".json"):
        raise DataError(f"data file {str(path)!r}: expected .parquet (or .jsonl) in veRL's schema")
    if path.suffix == ".parquet":
        _check_parquet(path)
        return datasets.Dataset.from_parquet(str(path), cache_dir=cache_dir)
    return datasets.Dataset.from_json(str(path), cache_dir=cache_dir)


def _check_parquet(path: Path) -> None:
    """A truncated or non-parquet file and an empty one, named, before `datasets` reports them as tracebacks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"data file {str(path)!r} is not a readable parquet file ({e}); it may be truncated: "
                        f"write it again (e.g. python launch/preprocess_data.py ...)") from None
    if rows == 0:
        raise DataError(f"data file {str(path)!r} has 0 rows: give a file with prompts (data.train_files / "
                        f"data.val_files)")


class RLDataset:
    """Prompt dataset over one or more parquet files; see the module docstring."""

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        max_prompt_length: int,
        *,
        truncation: str = "error",
        on_bad_row: str = "error",
        prompt_key: str = "prompt",
        max_samples: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        cache_dir: str | None = None,
    ):
        if truncation not in TRUNCATION_MODES:
            raise DataError(f"data.truncation={truncation!r}; choose one of {list(TRUNCATION_MODES)}")
        if on_bad_row not in ("error", "skip"):
            raise DataError(f"data.on_bad_row={on_bad_row!r}; choose 'error' or 'skip'")
        if max_prompt_length <= 0:
            raise DataError(f"data.max_prompt_length must be > 0, got {max_prompt_length}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError("the tokenizer has no chat_template; use an instruct/chat model's tokenizer or set one")
        self.files = [Path(f) for f in ([files] if isinstance(files, (str, Path)) else files)]
        if not self.files:
            raise DataError("no data files given (data.train_files / data.val_files is empty)")
        self.tokenizer = tokenizer
        self.max_prompt_length = int(max_prompt_length)
        self.truncation = truncation
        self.on_bad_row = on_bad_row
        self.prompt_key = prompt_key
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.stats = {"rows_read": 0, "bad_rows": 0, "filtered": 0, "truncated": 0}
        self.bad_row_examples: list[str] = []

        self._tables = [_load(path, cache_dir) for path in self.files]
        self._rows: list[tuple[int, int]] = []  # (file number, row number) of every kept item
        self._input_ids: list[np.ndarray] = []  # (prompt_len,) int32 per kept item
        self._parsed: OrderedDict[int, tuple] = OrderedDict()  # item -> its checked fields (ITEM_CACHE)
        for file_no, table in enumerate(self._tables):
            self._index_file(file_no, table, max_samples)
            if max_samples is not None and len(self._rows) >= max_samples:
                break
        if not self._rows:
            raise DataError(f"no usable rows in {[str(f) for f in self.files]} (stats: {self.stats})")
        dropped_or_cut = self.stats["bad_rows"] + self.stats["filtered"] + self.stats["truncated"]
        log = logger.warning if dropped_or_cut else logger.info
        log("RLDataset: %d prompts from %d file(s); %s", len(self._rows), len(self.files), self.stats)

    # ----------------------------------------------------------------------------------------- building

    def _index_file(self, file_no: int, table, max_samples: int | None) -> None:
        path = self.files[file_no]
        missing = [c for c in (self.prompt_key, "data_source", "reward_model") if c not in table.column_names]
        if missing:
            raise DataError(
                f"{path}: column(s) {missing} missing (columns: {table.column_names}); the file is not in veRL's "
                "schema (run launch/preprocess_data.py) or data.prompt_key is wrong"
            )
        for start in range(0, len(table), _READ_CHUNK):
            chunk = table[start : start + _READ_CHUNK]  # dict: column -> list
            rows = [dict(zip(chunk.keys(), values, strict=True)) for values in zip(*chunk.values(), strict=True)]
            kept, texts = [], []
            for offset, row in enumerate(rows):
                self.stats["rows_read"] += 1
                try:
                    messages = check_row(row, self.prompt_key)[0]
                except BadRowError as exc:
                    self._bad_row(path, start + offset, str(exc))
                    continue
                kept.append(start + offset)
                texts.append(self._render(messages, path, start + offset))
            if not texts:
                continue
            for row_no, ids in zip(kept, self.tokenizer(texts, add_special_tokens=False)["input_ids"], strict=True):
                ids = self._fit(ids, path, row_no)
                if ids is None:
                    continue
                self._rows.append((file_no, row_no))
                self._input_ids.append(np.asarray(ids, dtype=np.int32))
                if max_samples is not None and len(self._rows) >= max_samples:
                    return

    def _render(self, messages: list[dict[str, str]], path: Path, row_no: int) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
            )
        except Exception as exc:
            raise DataError(
                f"{path}: row {row_no}: the chat template failed on field {self.prompt_key!r}: {exc}"
            ) from exc

    def _bad_row(self, path: Path, row_no: int, problem: str) -> None:
        where = f"{path}: row {row_no}: {problem}"
        if self.on_bad_row == "error":
            raise DataError(f"{where}; fix the data or set data.on_bad_row=skip to drop such rows") from None
        self.stats["bad_rows"] += 1
        if len(self.bad_row_examples) < 5:
            self.bad_row_examples.append(where)
        logger.warning("skipping malformed row: %s", where)

    def _fit(self, ids: list[int], path: Path, row_no: int) -> list[int] | None:
        """Apply the length policy: the ids to keep, or None to drop the row."""
        if len(ids) <= self.max_prompt_length:
            return ids
        if self.truncation == "error":
            raise DataError(
                f"{path}: row {row_no}: the prompt is {len(ids)} tokens > data.max_prompt_length="
                f"{self.max_prompt_length}; raise max_prompt_length or set data.truncation to left, right or filter"
            )
        if self.truncation == "filter":
            self.stats["filtered"] += 1
            return None
        self.stats["truncated"] += 1
        return ids[-self.max_prompt_length :] if self.truncation == "left" else ids[: self.max_prompt_length]

    # ----------------------------------------------------------------------------------------- access

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = range(len(self._rows))[index]  # IndexError out of range; a negative index counts from the end
        parsed = self._parsed.pop(index, None)  # pop and put back: the most recent last (each step atomic)
        if parsed is None:
            file_no, row_no = self._rows[index]
            row = self._tables[file_no][row_no]
            parsed = (*check_row(row, self.prompt_key), row.get("agent_name"))
        self._parsed[index] = parsed
        while len(self._parsed) > ITEM_CACHE:
            self._parsed.popitem(last=False)
        messages, data_source, ground_truth, extra_info, agent_name = parsed
        return {
            "input_ids": self._input_ids[index].tolist(),
            "raw_prompt": messages,
            "data_source": data_source,
            "ground_truth": ground_truth,
            "extra_info": extra_info,
            "index": index,
            "agent_name": agent_name,  # multi-turn: the row's agent loop (veRL's column); None: default
        }
