"""Errors a run stops with that are not bugs: the launch scripts print them as one line (exit 2)."""
from rlhf_mcore.errors import UserError


class RolloutMismatchError(UserError, RuntimeError):
    """The rollout's log-probs left `trainer.max_rollout_logprob_gap` (see `trainer.run.check_rollout_gap`)."""

    kind = "error"
