"""`Row`: one generated sample with its reward, the record every path passes (rollout, scoring, the data bus, the
batch builder), whichever trainer runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["Row"]


@dataclass
class Row:
    """One generated sample with its reward."""

    prompt_pos: int  # position of its prompt in the step's prompt list
    sample: int  # which of the n samples
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    score: float = 0.0
    reward_extra: dict = field(default_factory=dict)
    baseline_ids: Optional[list[int]] = None  # greedy baseline (ReMax): the greedy response to this prompt
    baseline_score: Optional[float] = None  # ... and its reward
    versions: Optional[list[int]] = None  # asynchronous trainers: the policy version that sampled each token
    response_mask: Optional[list[int]] = None  # multi-turn: 1 on model tokens, 0 on tool / environment tokens
    agent: Optional[dict] = None  # multi-turn: the trajectory's stats (rlhf_mcore.agents.rollout.trajectory_info)
    routes: Any = None  # MoE, recorded by the rollout: (prompt + response - 1, n, k) expert ids (Sample.routes)
