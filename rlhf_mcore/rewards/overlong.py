"""Overlong reward shaping (DAPO; veRL's `reward_model.overlong_buffer`): a soft length penalty added to each
response's score.

With `L_max` = `data.max_response_length` and a buffer of `L_buf` tokens, a response of `L` tokens (its
generated tokens, the stop token included) exceeds the expected length `L_max - L_buf` by `L - (L_max - L_buf)`;
its penalty is `min(-exceed / L_buf * penalty_factor, 0)`: 0 up to the expected length, then falling linearly
to `-penalty_factor` at `L_max` (a response cut at the limit gets the full penalty).

Pure Python on lists: importing :mod:`rlhf_mcore.rewards` stays torch-free.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["overlong_penalty", "overlong_metrics"]


def overlong_penalty(response_lengths: Sequence[int], max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> list[float]:
    """The penalty (<= 0) of each response length; `0 < buffer_len <= max_response_length`."""
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(f"overlong buffer len={buffer_len} must be in [1, max_response_length={max_response_length}]")
    expected = max_response_length - buffer_len
    return [min(-(int(n) - expected) / buffer_len * penalty_factor, 0.0) for n in response_lengths]


def overlong_metrics(penalties: Sequence[float]) -> dict[str, float]:
    """`reward/overlong_penalty` (the mean penalty) and `reward/overlong_fraction` (the share of penalised
    responses); veRL logs the same per sample as `overlong_reward` / `overlong`."""
    if not penalties:
        return {}
    return {"reward/overlong_penalty": sum(penalties) / len(penalties),
            "reward/overlong_fraction": sum(p < 0 for p in penalties) / len(penalties)}
