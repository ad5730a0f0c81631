"""The reward pipeline: how a generated row's reward is made, in one place. Every path that scores rows calls it:
the synchronous trainer, both asynchronous modes' rollout pool and, with a reward model, their training pool.

The stages, in order:

1. rule score (:func:`set_rule_scores`): the reward function's score (by `data_source`, or
   `custom_reward_function`); a multi-turn trajectory that scored itself (an environment, `row.agent["reward"]`)
   keeps that reward instead -- the environment's reward stands in for the rule score, so the stages below apply
   to it as to any rule score. Kept in `reward_extra["acc"]` (dynamic sampling's `acc`).
2. learned score (`learned`: a reward model or a judge, `score_rows(rows, items)`): on the rows it covers,
   `reward_weight * learned + rule_weight * rule` (:func:`rlhf_mcore.rewards.reward_model.combine`); the others
   keep the rule score. PRIME's implicit PRM is not a row score: it shapes the advantages (trainer/prime.py).
3. overlong shaping (:class:`OverlongShaping`, DAPO's `reward.reward_model.overlong_buffer`): its penalty (<= 0)
   added, kept in `reward_extra["overlong_penalty"]`.

:func:`compose` runs stages 2-3 from the parts a row keeps, so it may run again where a row travels on (the
rollout pool composes without a learned score; the training pool composes again with its reward model) and
gives the score that one composition of all stages gives.

Pure Python on the rows (no torch): rows are :class:`rlhf_mcore.trainer.rollout_phase.Row`-like (`score`,
`reward_extra`, `response_ids`, `agent`, `baseline_ids` / `baseline_score`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from rlhf_mcore.rewards.overlong import overlong_metrics, overlong_penalty

__all__ = ["OverlongShaping", "set_rule_scores", "compose"]


@dataclass(frozen=True)
class OverlongShaping:
    """Stage 3: DAPO's overlong penalty (`reward.reward_model.overlong_buffer`); off adds 0 to every score."""

    enable: bool = False
    max_response_length: int = 1
    buffer_len: int = 1
    penalty_factor: float = 1.0
    log: bool = False  # reward/overlong_penalty and reward/overlong_fraction in the step's metrics

    @classmethod
    def from_config(cls, cfg) -> "OverlongShaping":
        ob = cfg.reward.reward_model.overlong_buffer
        return cls(enable=ob.enable, max_response_length=cfg.data.max_response_length, buffer_len=ob.len,
                   penalty_factor=ob.penalty_factor, log=ob.log)

    def penalties(self, lengths: Sequence[int]) -> list[float]:
        if not self.enable:
            return [0.0] * len(lengths)
        return overlong_penalty(lengths, self.max_response_length, self.buffer_len, self.penalty_factor)

    def metrics(self, rows: Sequence[Any]) -> dict[str, float]:
        """The logged penalty statistics of shaped rows (`log`), else nothing."""
        return overlong_metrics([r.reward_extra["overlong_penalty"] for r in rows]) if self.log else {}


def set_rule_scores(rows: Sequence[Any], scores: Sequence[float]) -> None:
    """Stage 1, in place: each row's rule score, or its environment's reward when the trajectory has one."""
    for r, s in zip(rows, scores, strict=True):
        own = r.agent.get("reward") if r.agent else None  # an environment's reward
        r.score = float(s) if own is None else float(own)


def compose(rows: Sequence[Any], items: Optional[Sequence[dict]], shaping: OverlongShaping, *, learned=None,
            baseline: bool = False, local: bool = False) -> dict[str, float]:
    """Stages 2-3 on rows whose rule score is set (stage 1), in place: each row's `score` becomes the learned
    score combined with the rule score, plus the overlong penalty. `items[r.prompt_pos]`: the row's dataset item
    (`data_source`, ...; read by `learned` only). `baseline`: the greedy baselines (ReMax) are shaped as the
    samples are (rule-scored only). `local`: each data-parallel replica holds its own rows (the asynchronous
    training pool; see `RewardModelScorer.score_rows`). Returns the learned scorer's metrics (`reward_model/*`,
    `judge/*`)."""
    for r in rows:  # from the rule score: composing again gives the same score
        r.score = r.reward_extra.setdefault("acc", r.score)
        if baseline:
            r.baseline_score = r.reward_extra.setdefault("baseline_acc", r.baseline_score)
    metrics = {}
    if learned is not None:
        metrics = learned.score_rows(rows, items, local=True) if local else learned.score_rows(rows, items)
    for r, p in zip(rows, shaping.penalties([len(r.response_ids) for r in rows])):
        r.reward_extra["overlong_penalty"] = p
        r.score += p
    if baseline:
        for r, p in zip(rows, shaping.penalties([len(r.baseline_ids) for r in rows])):
            r.baseline_score += p
    return metrics
