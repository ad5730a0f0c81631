"""RL math as pure tensor functions on padded `[batch, response_len]` grids with a response mask.

- :mod:`.advantages` — advantage estimators by name (`gae`, `grpo`, `rloo`, `remax`, `reinforce_plus_plus`,
  `reinforce_plus_plus_baseline`), a registry users extend with :func:`register_adv_estimator`;
- :mod:`.policy_loss` — policy losses by name (`vanilla` PPO clip with clip-higher and dual-clip, `gspo`);
- :mod:`.value_loss` — the clipped value loss; :mod:`.entropy` — entropy and the entropy bonus;
- :mod:`.kl` — KL estimators, fixed/adaptive KL controllers, KL in the reward, KL as a loss;
- :mod:`.aggregation` — loss aggregation modes with global normalisers for micro-batch invariance;
- :mod:`.masked` — masked mean/var/whiten;
- :mod:`.rollout_correction` — IS weights and rejection masks for off-policy rollouts.
- :mod:`.dynamic_sampling` — DAPO's group filter and the refill bookkeeping (`algorithm.filter_groups`).

Nothing here knows about models, process groups or Megatron. The names are imported on first use;
:mod:`.names` lists the built-in ones without torch.
"""
import importlib

# name -> the module defining it; imported on first use (PEP 562), so that `rlhf_mcore.algos.names` (the built-in
# names, read by the config) imports no torch
_EXPORTS = {
    "advantages": ("AdvEstimator", "adv_estimator_info", "get_adv_estimator", "list_adv_estimators",
                   "register_adv_estimator"),
    "aggregation": ("agg_loss", "list_loss_agg_modes"),
    "entropy": ("compute_entropy_loss", "entropy_from_logits"),
    "kl": ("AdaptiveKLController", "FixedKLController", "apply_kl_penalty", "build_kl_controller", "compute_kl_loss",
           "kl_penalty", "list_kl_estimators"),
    "masked": ("masked_mean", "masked_sum", "masked_var", "masked_whiten"),
    "policy_loss": ("get_policy_loss", "list_policy_losses", "register_policy_loss"),
    "rollout_correction": ("RolloutCorrection", "compute_rollout_correction"),
    "value_loss": ("compute_value_loss",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"rlhf_mcore.algos.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module 'rlhf_mcore.algos' has no attribute {name!r}")


__all__ = [
    "AdvEstimator",
    "adv_estimator_info",
    "get_adv_estimator",
    "list_adv_estimators",
    "register_adv_estimator",
    "agg_loss",
    "list_loss_agg_modes",
    "compute_entropy_loss",
    "entropy_from_logits",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_kl_loss",
    "kl_penalty",
    "list_kl_estimators",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "get_policy_loss",
    "list_policy_losses",
    "register_policy_loss",
    "RolloutCorrection",
    "compute_rollout_correction",
    "compute_value_loss",
]
