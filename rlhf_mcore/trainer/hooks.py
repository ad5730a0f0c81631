"""What observes the loop: the phase timer and the step hooks (benchmarks, profilers, test observers).

Hooks get the parts they observe (:class:`StepParts`), never the loop: they read, never steer."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

from rlhf_mcore.trace import span


class PhaseTimer:
    """Seconds per named phase of one step (`timing_s/<name>` in the metrics), each phase a span of the run's
    trace (:mod:`rlhf_mcore.trace`) with the step's number in its arguments."""

    def __init__(self, step: Optional[int] = None):
        self.seconds: dict[str, float] = {}
        self.spans: dict[str, Any] = {}  # the last span of each phase (its args may be added to until flushed)
        self.step = step

    @contextmanager
    def __call__(self, name: str, **args: Any):
        with span(name, **({"step": self.step} if self.step is not None else {}), **args) as s:
            self.spans[name] = s
            yield s
        self.seconds[name] = self.seconds.get(name, 0.0) + s.seconds


@dataclass
class StepParts:
    """The parts of a run a hook may read: the parallel state, the training engines, the rollout (None on the
    asynchronous training pool), the scorers and data, the logger; on the asynchronous training pool also the
    step's rows as they came off the data bus (`rows`: (dataset index, row)) and the policy version they were
    taken at (`version`: updates done before the step's)."""

    state: Any
    actor: Any
    critic: Any
    ref: Any
    prime: Any
    reward_model: Any
    rollout: Any
    scorer: Any
    train_set: Any
    logger: Any = None
    rows: list = field(default_factory=list)
    version: Optional[int] = None


class StepHooks:
    """Observers of the loop, called on every rank. The default does nothing; pass a subclass as
    ``train(cfg, hooks=...)`` or ``RLTrainer(cfg, hooks=...)``."""

    def step_start(self, parts: StepParts, step: int) -> None:
        pass

    def step_end(self, parts: StepParts, step: int, batch: dict[str, Any], metrics: dict[str, float],
                 timer: PhaseTimer) -> None:
        pass
