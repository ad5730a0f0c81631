"""Batching prompts: left padding to `[B, T]`, so every prompt ends at the same column and generation
appends to the right of all of them at once."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["LeftPadCollator"]


class LeftPadCollator:
    """Collate `RLDataset` items into tensors plus per-row lists.

    Returns `input_ids` (B, T) int64 left-padded with `pad_token_id`, `attention_mask` (B, T) int64 (1 on
    tokens), `position_ids` (B, T) int64 (0 at each prompt's first token, 0 on padding), and the non-tensor
    fields (`raw_prompt`, `data_source`, `ground_truth`, `extra_info`, `index`, ...) as lists. `T` is the
    longest prompt, rounded up to `pad_to_multiple_of` when given. Picklable (DataLoader workers).
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        if pad_token_id is None:
            raise ValueError("pad_token_id is None: set tokenizer.pad_token (e.g. to the eos token) first")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        if not items:
            raise ValueError("cannot collate an empty batch")
        lengths = [len(item["input_ids"]) for item in items]
        T = max(max(lengths), 1)
        if self.pad_to_multiple_of:
            T = -(-T // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(items), T), self.pad_token_id, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros((len(items), T), dtype=torch.long)  # (B, T)
        for row, (item, n) in enumerate(zip(items, lengths, strict=True)):
            if n:
                input_ids[row, T - n :] = torch.as_tensor(item["input_ids"], dtype=torch.long)
                attention_mask[row, T - n :] = 1
        position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)  # (B, T)
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        for key in items[0]:
            if key != "input_ids":
                batch[key] = [item[key] for item in items]
        return batch
