"""Action chunks as tokens: K bins per action dimension, mapped onto the last K ids of the vocabulary.

The scheme OpenVLA(-OFT) uses, written here from its description: each action dimension is normalised with the
demonstration data's 1st and 99th percentiles (`q01`, `q99`: robust to outlier demonstrations), clipped to that
range and cut into K equal bins; bin `b` is token id `vocab_size - K + b`. A chunk of C steps x A dimensions is
C*A tokens, step-major (`ids[c * A + a]`). De-tokenization returns each bin's centre, so a round trip moves an action
inside `[q01, q99]` by at most half a bin width, `(q99 - q01) / (2K)`; an action outside is clipped first.
A dimension whose `q01 == q99` (constant in the demonstrations, e.g. an unused gripper) always decodes to that value.

Decoding is restricted to action tokens by :meth:`ActionTokenizer.restrict_logits` (every other logit, the padded
vocabulary rows included, set to -inf), so greedy or sampled ids always de-tokenize.

    stats = ActionStats.from_actions(demo_actions)            # (N, A) or (N, C, A) float
    tok = ActionTokenizer(vocab_size=151_643, num_bins=256, chunk=8, action_dim=7, stats=stats)
    ids = tok.tokenize(actions)                               # (..., C, A) -> (..., C*A) int64
    actions = tok.detokenize(ids)                             # (..., C*A) -> (..., C, A) float32
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ActionStats", "ActionTokenizer"]


@dataclass(frozen=True)
class ActionStats:
    """Per-dimension statistics of the demonstration actions (the de-tokenizer needs them: save them with the
    model). `q01`/`q99` bound the bins; mean/std/min/max are kept for reference."""

    q01: np.ndarray  # (A,)
    q99: np.ndarray  # (A,)
    mean: np.ndarray  # (A,)
    std: np.ndarray  # (A,)
    min: np.ndarray  # (A,)
    max: np.ndarray  # (A,)
    count: int  # action steps they were computed from

    @classmethod
    def from_actions(cls, actions: Any) -> "ActionStats":
        """From demonstration actions (..., A): every step of every demonstration, flattened."""
        a = np.asarray(actions, dtype=np.float64)
        if a.ndim < 1 or a.shape[-1] == 0 or a.size == 0:
            raise ValueError(f"action statistics need actions shaped (..., A) with A >= 1, got shape {a.shape}")
        a = a.reshape(-1, a.shape[-1])  # (N, A)
        if not np.isfinite(a).all():
            raise ValueError("action statistics: the demonstration actions contain NaN or inf")
        q01, q99 = np.quantile(a, [0.01, 0.99], axis=0)
        return cls(q01=q01, q99=q99, mean=a.mean(0), std=a.std(0), min=a.min(0), max=a.max(0), count=len(a))

    @property
    def action_dim(self) -> int:
        return int(self.q01.shape[0])

    def to_dict(self) -> dict:
        return {k: (getattr(self, k).tolist() if k != "count" else self.count)
                for k in ("q01", "q99", "mean", "std", "min", "max", "count")}

    @classmethod
    def from_dict(cls, d: dict) -> "ActionStats":
        return cls(**{k: (np.asarray(d[k], dtype=np.float64) if k != "count" else int(d[k]))
                      for k in ("q01", "q99", "mean", "std", "min", "max", "count")})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ActionStats":
        return cls.from_dict(json.loads(Path(path).read_text()))


class ActionTokenizer:
    """Action chunks (..., C, A) <-> token ids (..., C*A) on the last `num_bins` ids of a `vocab_size` vocabulary
    (the tokenizer's size, not the model's padded one: ids at and above `vocab_size` are never produced)."""

    def __init__(self, *, vocab_size: int, num_bins: int, chunk: int, action_dim: int, stats: ActionStats):
        for name, value, low in (("num_bins", num_bins, 2), ("chunk", chunk, 1), ("action_dim", action_dim, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"action tokenizer: {name}={value!r} must be an integer >= {low}")
        if not isinstance(vocab_size, int) or vocab_size <= num_bins:
            raise ValueError(f"action tokenizer: vocab_size={vocab_size!r} must exceed num_bins={num_bins} (the bins "
                             "take the last num_bins ids and the instruction needs the others)")
        if stats.action_dim != action_dim:
            raise ValueError(f"action tokenizer: action_dim={action_dim} but the statistics have {stats.action_dim} "
                             "dimensions; compute them from this task's demonstrations")
        if np.any(stats.q99 < stats.q01):
            raise ValueError("action tokenizer: statistics with q99 < q01 in some dimension")
        self.vocab_size, self.num_bins, self.chunk, self.action_dim = vocab_size, num_bins, chunk, action_dim
        self.stats = stats
        self.first_id = vocab_size - num_bins  # bin b <-> id first_id + b
        self._low = stats.q01.astype(np.float64)  # (A,)
        self._range = (stats.q99 - stats.q01).astype(np.float64)  # (A,), 0 for a constant dimension

    @property
    def tokens_per_chunk(self) -> int:
        return self.chunk * self.action_dim

    @property
    def bin_width(self) -> np.ndarray:
        """(A,) the width of one bin in action units."""
        return self._range / self.num_bins

    def tokenize(self, actions: Any) -> np.ndarray:
        """(..., C, A) float -> (..., C*A) int64 ids in [first_id, vocab_size)."""
        a = np.asarray(actions, dtype=np.float64)
        if a.shape[-2:] != (self.chunk, self.action_dim):
            raise ValueError(f"tokenize: actions shaped {a.shape}, expected (..., {self.chunk}, {self.action_dim})")
        unit = np.clip((a - self._low) / np.where(self._range > 0, self._range, 1.0), 0.0, 1.0)  # (..., C, A)
        bins = np.minimum(np.floor(unit * self.num_bins), self.num_bins - 1).astype(np.int64)
        return (bins + self.first_id).reshape(*a.shape[:-2], self.tokens_per_chunk)

    def detokenize(self, ids: Any) -> np.ndarray:
        """(..., C*A) ids -> (..., C, A) float32: each bin's centre. An id outside the action range is an error:
        decode with :meth:`restrict_logits`."""
        ids = np.asarray(ids)
        if ids.shape[-1:] != (self.tokens_per_chunk,):
            raise ValueError(f"detokenize: ids shaped {ids.shape}, expected (..., {self.tokens_per_chunk})")
        bins = ids.astype(np.int64) - self.first_id
        if bins.size and (bins.min() < 0 or bins.max() >= self.num_bins):
            bad = ids.reshape(-1)[((bins < 0) | (bins >= self.num_bins)).reshape(-1)][0]
            raise ValueError(f"detokenize: id {int(bad)} is not an action token (those are [{self.first_id}, "
                             f"{self.vocab_size})); restrict decoding with ActionTokenizer.restrict_logits")
        bins = bins.reshape(*ids.shape[:-1], self.chunk, self.action_dim)
        return (self._low + (bins + 0.5) / self.num_bins * self._range).astype(np.float32)

    def action_mask(self, width: int | None = None) -> np.ndarray:
        """(width,) bool, True on the action ids; `width` is the logits' last dimension (the model's padded
        vocabulary, default `vocab_size`)."""
        width = self.vocab_size if width is None else width
        if width < self.vocab_size:
            raise ValueError(f"action_mask: logits of width {width} cannot hold the action ids [{self.first_id}, "
                             f"{self.vocab_size})")
        mask = np.zeros(width, dtype=bool)
        mask[self.first_id:self.vocab_size] = True
        return mask

    def restrict_logits(self, logits):
        """A torch tensor (..., V_padded): the same logits with every non-action id at -inf, so that argmax and
        sampling (and log-softmax over the result) see the action ids only."""
        import torch

        mask = torch.from_numpy(self.action_mask(logits.shape[-1])).to(logits.device)
        return logits.masked_fill(~mask, float("-inf"))
