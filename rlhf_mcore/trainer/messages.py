"""The control messages of the asynchronous trainers: the coordinator (training rank 0) to the rollout replicas
(one mailbox per rollout rank in the launcher's store) and the replicas back to the coordinator (the "coord"
mailbox). Rows never travel here: they go over the data bus (:mod:`rlhf_mcore.trainer.databus`). Receivers
dispatch with `match` on the class; a message of no known class is refused by name."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf_mcore.trainer.databus import GroupMeta


# ------------------------------------------------------------------------------------------- to the rollout pool
@dataclass(frozen=True)
class Weights:
    """Join the weight broadcast from training rank 0: the actor after `version` updates."""

    version: int


@dataclass(frozen=True)
class Generate:
    """one_step_off: generate step `step`'s prompts (dataset indices) over the pool with sampling seed `seed`,
    score them, send group `pos` to the ranks `dsts[pos]` of its DP rank. prefetch: the weights version the
    trainer pushes while this step generates (its Weights message follows this one): receive it in the
    background meanwhile (`async_training.prefetch_weights`); None: no push comes during this step."""

    step: int
    prompts: list[int]
    seed: int
    dsts: list[list[int]]
    prefetch: int | None = None


@dataclass(frozen=True)
class Grant:
    """fully_async: prompts to stream, `(uid, dataset index)` each (all n samples of each)."""

    entries: list[tuple[int, int]]


@dataclass(frozen=True)
class Send:
    """fully_async: groups the trainer takes, `(uid, destination ranks)` each."""

    entries: list[tuple[int, list[int]]]


@dataclass(frozen=True)
class Drop:
    """fully_async: stale groups the trainer will not take."""

    uids: list[int]


@dataclass(frozen=True)
class Validate:
    """Run validation on the current weights; report it (:class:`ValResult`) for step `step`."""

    step: int


@dataclass(frozen=True)
class Stop:
    """The run is over."""


# ------------------------------------------------------------------------------------------- to the coordinator
@dataclass(frozen=True)
class GroupReady:
    """A finished group, kept by its producer until sent or dropped."""

    meta: GroupMeta


@dataclass(frozen=True)
class StepStats:
    """one_step_off: the metrics of step `step`'s generation (rollout rank 0)."""

    step: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class ValResult:
    """Validation of step `step` (rollout rank 0): its metrics and the first samples to log."""

    step: int
    metrics: dict[str, float]
    samples: list[dict[str, Any]] = field(default_factory=list)


def unknown(msg: Any, who: str) -> RuntimeError:
    """The error for a message `who` cannot act on."""
    return RuntimeError(f"{who}: unexpected message {type(msg).__name__} ({msg!r:.200})")
