"""The `data` section: files, lengths and batch sizes (prompts)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from rlhf_mcore.config.checks import at_least, checked, unset_or


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024  # prompts per step (each gets rollout.n responses)
    # prompts per generation batch of dynamic sampling (algorithm.filter_groups); None: train_batch_size
    gen_batch_size: Optional[int] = checked(None, ok=unset_or(at_least(1)), what="unset or >= 1")
    # prompts per validation generate call; None: the whole set at once
    val_batch_size: Optional[int] = checked(None, ok=unset_or(at_least(1)), what="unset or >= 1")
    truncation: Literal["error", "left", "right", "filter"] = "error"  # filter: drop over-long prompts, counted
    filter_overlong_prompts: bool = False  # veRL's switch; True is the same as truncation=filter
    on_bad_row: Literal["error", "skip"] = "error"  # skip: count and report malformed rows
    shuffle: bool = True
    seed: int = 1
    max_train_samples: Optional[int] = None  # use only the first N training rows (demos, smoke runs)
    max_val_samples: Optional[int] = None
