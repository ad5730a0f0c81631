"""The built-in algorithm names and what each advantage estimator needs, readable without importing torch.

The registries (names -> functions) live beside the math (:mod:`.advantages`, :mod:`.policy_loss`,
:mod:`.aggregation`, :mod:`.kl`), which imports torch. The config checks names before anything is built, and
asks here: a registry whose module is imported answers itself (a ``trainer.plugins`` file that registers a name has
imported it); otherwise nothing can have been registered beyond the built-in names below, which are then the
whole registry. ``tests/test_config_imports.py`` checks these tables against the registries.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

# name -> what the trainer has to provide (the needs_* flags its decorator in .advantages registers)
ADV_ESTIMATOR_NEEDS: dict[str, dict[str, bool]] = {
    "gae": {"needs_critic": True, "lam1_returns_free_of_values": True},
    "grpo": {"needs_group_index": True},
    "rloo": {"needs_group_index": True},
    "remax": {"needs_greedy_baseline": True},
    "reinforce_plus_plus": {},
    "reinforce_plus_plus_baseline": {"needs_group_index": True},
}
POLICY_LOSSES = ("gspo", "sft", "vanilla")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("abs", "k1", "k2", "k3", "kl", "low_var_kl", "mse")


@dataclass(frozen=True)
class Needs:
    """What an estimator needs, as :class:`~rlhf_mcore.algos.advantages.AdvEstimator` says it."""

    needs_critic: bool = False
    needs_greedy_baseline: bool = False
    needs_group_index: bool = False
    lam1_returns_free_of_values: bool = False


def _loaded(module: str):
    return sys.modules.get(f"rlhf_mcore.algos.{module}")


def adv_estimator_names() -> list[str]:
    mod = _loaded("advantages")
    return mod.list_adv_estimators() if mod else sorted(ADV_ESTIMATOR_NEEDS)


def adv_estimator_needs(name: str) -> Optional[Needs]:
    """What the estimator `name` needs; None when no estimator has that name."""
    if name not in adv_estimator_names():
        return None
    mod = _loaded("advantages")
    if mod is None:
        return Needs(**ADV_ESTIMATOR_NEEDS[name])
    info = mod.adv_estimator_info(name)
    return Needs(info.needs_critic, info.needs_greedy_baseline, info.needs_group_index,
                 info.lam1_returns_free_of_values)


def policy_loss_names() -> list[str]:
    mod = _loaded("policy_loss")
    return mod.list_policy_losses() if mod else list(POLICY_LOSSES)


def loss_agg_mode_names() -> list[str]:
    mod = _loaded("aggregation")
    return mod.list_loss_agg_modes() if mod else list(LOSS_AGG_MODES)


def kl_estimator_names() -> list[str]:
    mod = _loaded("kl")
    return mod.list_kl_estimators() if mod else list(KL_ESTIMATORS)
