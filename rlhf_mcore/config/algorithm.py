"""The `algorithm` section: advantage estimator, KL in the reward, off-policy correction, dynamic sampling and
PRIME's advantage weights. Names users extend (estimators, KL estimators) are checked against the registries in
:mod:`.cross`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from rlhf_mcore.config.checks import above, at_least, checked, unset_or, within
from rlhf_mcore.config.shared import FINITE

# algorithm.filter_groups.metric: acc / score, the reward function's score; seq_reward, the score after the overlong
# penalty; seq_final_reward, the reward after KL-in-reward (the same as seq_reward when use_kl_in_reward is off)
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = checked(0.001, ok=at_least(0), what=">= 0")
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction with ratio pi_old / pi_rollout (rlhf_mcore.algos.rollout_correction)."""
    # None (off) | token | sequence: IS weights on the policy loss
    rollout_is: Optional[str] = checked(None, ok=lambda v: v in (None, "token", "sequence"),
                                        what="null (off), token or sequence")
    # TIS: IS weights capped at this
    rollout_is_threshold: float = checked(2.0, ok=above(0), what="> 0 (the TIS cap on IS weights, e.g. 2.0)")
    rollout_is_batch_normalize: bool = False  # IS weights divided by their batch mean
    # None (off) | token | sequence | geometric: rejection from the loss
    rollout_rs: Optional[str] = checked(None, ok=lambda v: v in (None, "token", "sequence", "geometric"),
                                        what="null (off), token, sequence or geometric")
    rollout_rs_threshold: Optional[float] = None  # largest ratio kept (required with rollout_rs)
    rollout_rs_threshold_lower: Optional[float] = None  # smallest ratio kept; None: 1 / rollout_rs_threshold
    # a token ratio below this rejects its sequence
    rollout_token_veto_threshold: Optional[float] = checked(None, ok=unset_or(above(0)),
                                                            what="unset or > 0 (e.g. 1e-4)")


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (rlhf_mcore.algos.dynamic_sampling): drop groups whose responses all have the
    same `metric`, generating further data.gen_batch_size prompt batches until data.train_batch_size groups
    remain."""

    enable: bool = False
    # acc | score (the reward function's score) | seq_reward (after shaping) | ...
    metric: Optional[str] = checked(None, ok=lambda v: v is None or v in FILTER_METRICS, what=(
        f"one of {', '.join(FILTER_METRICS)} (acc and score: the reward function's score; seq_reward: after the "
        f"overlong penalty)"))
    max_num_gen_batches: int = 0  # generation batches per step before the run stops; <= 0: no limit


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"  # gae | grpo | rloo | remax | reinforce_plus_plus | reinforce_plus_plus_baseline
    gamma: float = checked(1.0, ok=within(0, 1), what="in [0, 1]")
    lam: float = checked(1.0, ok=within(0, 1), what="in [0, 1]")
    norm_adv_by_std_in_grpo: bool = True  # False is Dr.GRPO
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # kl (k1) | abs | mse (k2) | low_var_kl (k3)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    # PRIME (reward_model.reward_manager=prime): weights of the RLOO advantages of the implicit process rewards and
    # of the outcome (rule) reward
    reward_dpo_coef: float = checked(5.0, **FINITE)
    reward_gt_coef: float = checked(5.0, **FINITE)
