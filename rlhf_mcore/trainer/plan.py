"""The coordinator's data plan: which prompts each data-parallel rank handles this step.

All ``n`` samples of a prompt land on one DP rank (group statistics such as GRPO's need them together), and
ranks get near-equal prompt-token counts with the same number of prompts each (equal batch shapes), using the
engine's Karmarkar-Karp partition. Rank 0 computes the plan; every rank receives it as a small Python object over
the CPU group: tensors never travel through the coordinator.
"""
from __future__ import annotations

from typing import Sequence

from rlhf_mcore.engine.balance import partition_balanced


def plan_step(prompt_ids: Sequence[int], prompt_lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Dataset indices per DP rank, balancing prompt tokens (responses are unknown before rollout)."""
    parts = partition_balanced(list(prompt_lengths), dp_size, equal_size=True)
    return [[prompt_ids[i] for i in part] for part in parts]
