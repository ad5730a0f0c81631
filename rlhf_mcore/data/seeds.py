"""The sampling seed of a training step, the one formula every trainer uses.

A step's rollout draws its random streams from `step_seed(trainer.seed, step, gen_batch)`; the same run seed, step
and generation batch give the same samples whichever mode runs them (the one-step-off trainer generates step `k`
with the synchronous trainer's seed of step `k`), and a resumed run draws what the uninterrupted run would have.
The multipliers are primes larger than any step count, so (run seed, step, generation batch) do not collide.
"""
from __future__ import annotations

__all__ = ["step_seed"]


def step_seed(seed: int, step: int, gen_batch: int = 0) -> int:
    """The rollout seed of `step` under run seed `seed` (`trainer.seed`); `gen_batch` counts the extra generation
    batches of one step (dynamic sampling draws more prompts until enough groups are kept)."""
    return seed * 100_003 + step + 1_000_003 * gen_batch
