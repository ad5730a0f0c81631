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

Nothing here knows about models, process groups or Megatron.
"""
from rlhf_mcore.algos.advantages import (
    AdvEstimator,
    adv_estimator_info,
    get_adv_estimator,
    list_adv_estimators,
    register_adv_estimator,
)
from rlhf_mcore.algos.aggregation import agg_loss, list_loss_agg_modes
from rlhf_mcore.algos.entropy import compute_entropy_loss, entropy_from_logits
from rlhf_mcore.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    compute_kl_loss,
    kl_penalty,
    list_kl_estimators,
)
from rlhf_mcore.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlhf_mcore.algos.policy_loss import get_policy_loss, list_policy_losses, register_policy_loss
from rlhf_mcore.algos.rollout_correction import RolloutCorrection, compute_rollout_correction
from rlhf_mcore.algos.value_loss import compute_value_loss

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
