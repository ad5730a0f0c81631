"""The synchronous PPO/GRPO trainer (async_training.mode=off) as one object, for launchers and benchmarks that hold
it; the loop itself is :func:`rlhf_mcore.trainer.loops.run_off`, one method per step: plan, generate + score,
forward passes, advantages, update, sync, then metrics / validation / checkpoint.

Simplifications, on purpose: one synchronous step at a time (generation of step k+1 does not overlap training of
step k); all training models share one process layout; the rollout engine is rebuilt from the actor's weights at
start (and after a resume) rather than from its own checkpoint.
"""
from __future__ import annotations

from typing import Optional

from rlhf_mcore.config import RLConfig
from rlhf_mcore.trainer.colocated import ColocatedRollout
from rlhf_mcore.trainer.errors import RolloutMismatchError
from rlhf_mcore.trainer.hooks import PhaseTimer, StepHooks, StepParts
from rlhf_mcore.trainer.loops import build_learner, run_off, step_parts, train
from rlhf_mcore.trainer.run import RunContext


class RLTrainer:
    """The synchronous trainer's parts: `run` (:class:`RunContext`), `learner` (:class:`Learner`) and `rollout`
    (:class:`ColocatedRollout`); `fit` runs the loop, `close` ends the run."""

    def __init__(self, cfg: RLConfig, hooks: Optional[StepHooks] = None):
        self.run = RunContext.open(cfg, hooks)
        with self.run.building():  # e.g. a model that fails to load: the next run must not find this run's lock
            self.learner, reward_model, engine, agents = build_learner(self.run, colocated=True)
        self.rollout = ColocatedRollout(self.run, self.learner, engine, agents, reward_model)
        self.run_parts = step_parts(self.run, self.learner, reward_model, engine)

    @property
    def hooks(self) -> StepHooks:
        return self.run.hooks

    @hooks.setter
    def hooks(self, hooks: StepHooks) -> None:
        self.run.hooks = hooks

    def parts(self) -> StepParts:
        """What the step hooks observe (the same object the loop hands them)."""
        return self.run_parts

    def fit(self) -> dict[str, float]:
        return run_off(self.run, self.learner, self.rollout, self.run_parts)

    def close(self) -> None:
        self.run.close()


__all__ = ["RLTrainer", "StepHooks", "StepParts", "PhaseTimer", "RolloutMismatchError", "train"]
