"""Vision-language-action (VLA) training pieces: action tokens, vectorized environments, rollouts, training rows.

Issue 37, in progress. What exists: :mod:`rlhf_mcore.vla.actions` (action chunks <-> the last K vocabulary ids),
:mod:`rlhf_mcore.vla.envs` (the vectorized chunk interface, subprocess workers with shared-memory observations, the
built-in reach-and-push task, ManiSkill / LIBERO adapters), :mod:`rlhf_mcore.vla.rollout` (one rollout over one or
two env stages, the two-stage overlap), :mod:`rlhf_mcore.vla.rows` (rollouts -> one training row per trajectory and
chunk step) and :mod:`rlhf_mcore.vla.gae` (chunk-level GAE over those rows, for PPO with a value head). The policy
is rlhf_mcore.models.vision (+ rlhf_mcore.trainer.vla_policy), the trainer rlhf_mcore.trainer.vla.

Everything in this package imports numpy only (torch lazily, where a function takes tensors): env workers import it.
"""
