"""KL between the policy and the reference policy: estimators, controllers, KL-in-reward and KL-as-loss.

Two ways to keep the policy near the reference (veRL's names):

- KL in the reward (`algorithm.use_kl_in_reward`, `algorithm.kl_penalty`, `algorithm.kl_ctrl.*`):
  :func:`apply_kl_penalty` subtracts `beta * KL_t` from every token's reward before advantages are computed;
  `beta` comes from a :class:`FixedKLController` or an :class:`AdaptiveKLController` (Ziegler et al. 2019)
  that the trainer updates once a step and checkpoints with `state_dict()`.
- KL as a loss (`actor.use_kl_loss`, `actor.kl_loss_coef`, `actor.kl_loss_type`): :func:`compute_kl_loss`
  adds `coef * agg(KL_t)` to the actor loss (GRPO's choice, usually with `low_var_kl`).

Estimators of KL(pi || pi_ref) from samples of pi (http://joschu.net/blog/kl-approx.html), per token with
`d = log pi - log pi_ref`:

- `k1` / `kl`: `d` (unbiased, high variance, can be negative);
- `abs`: `|d|`;
- `k2` / `mse`: `0.5 d^2`;
- `k3` / `low_var_kl`: `exp(-d) + d - 1` (unbiased, >= 0); `-d` is clamped to [-20, 20] before exp and the
  result to [-10, 10], exactly as veRL does.

Appending `+` (e.g. `k3+`, `low_var_kl+`) keeps that estimator's value but takes the gradient of `k2`
(straight-through), whose expected gradient is that of KL. veRL 0.7 documents these names but its
`kl_penalty_forward` rejects them (NotImplementedError); here they work.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlhf_mcore.algos.aggregation import agg_loss
from rlhf_mcore.algos.masked import masked_mean
from rlhf_mcore.registry import Registry

__all__ = [
    "list_kl_estimators",
    "kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "build_kl_controller",
    "apply_kl_penalty",
    "compute_kl_loss",
]

# name -> fn(diff = log pi - log pi_ref (B, T)) -> per-token estimate (B, T); the aliases are veRL's names.
_KL_ESTIMATORS: Registry = Registry("KL estimator", "A '+' suffix (e.g. k3+) takes k2's gradient. Config keys: "
                                                     "algorithm.kl_penalty / actor.kl_loss_type")


def _k1(diff: torch.Tensor) -> torch.Tensor:
    return diff


def _k2(diff: torch.Tensor) -> torch.Tensor:
    return 0.5 * diff.square()


def _k3(diff: torch.Tensor) -> torch.Tensor:
    neg = torch.clamp(-diff, -20.0, 20.0)
    return torch.clamp(torch.exp(neg) - neg - 1, -10.0, 10.0)


for _names, _fn in ((("k1", "kl"), _k1), (("abs",), torch.abs), (("k2", "mse"), _k2), (("k3", "low_var_kl"), _k3)):
    for _name in _names:
        _KL_ESTIMATORS.add(_name, _fn)


def list_kl_estimators() -> list[str]:
    """Every KL estimator name (each also takes a '+' suffix: the k2 gradient, straight-through)."""
    return _KL_ESTIMATORS.names()


def _kl_forward(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    return _KL_ESTIMATORS.get(kind, key="KL estimator")(log_prob - ref_log_prob)  # (B, T)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "kl") -> torch.Tensor:
    """Per-token KL estimate (B, T) of KL(pi || pi_ref) by estimator `kind` (see the module docstring)."""
    straight_through = kind.endswith("+")
    value = _kl_forward(log_prob, ref_log_prob, kind[:-1] if straight_through else kind)
    if not straight_through:
        return value
    k2 = 0.5 * (log_prob - ref_log_prob).square()
    return k2 - k2.detach() + value.detach()


class FixedKLController:
    """A constant KL coefficient `value` (`algorithm.kl_ctrl.type=fixed`)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593) steering the measured KL to `target_kl`.

    After each step: `e = clip(current_kl / target_kl - 1, -0.2, 0.2)`, `value *= 1 + e * n_steps / horizon`,
    where `n_steps` is the number of samples in the step (veRL passes the batch size).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl must be > 0 for the adaptive controller, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))


def build_kl_controller(
    type: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000, **_: Any
) -> FixedKLController | AdaptiveKLController:
    """The controller named by `algorithm.kl_ctrl.type` (`fixed` | `adaptive`), from the `kl_ctrl` fields."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown algorithm.kl_ctrl.type={type!r}; choose 'fixed' or 'adaptive'")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    kl_penalty_type: str = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level rewards with the KL penalty: `scores - kl_coef * KL_t * mask`, all (B, T).

    Returns `(token_level_rewards, metrics)`; `metrics["reward_kl_penalty"]` is the batch mean of the
    per-sequence mean KL — what veRL feeds to `kl_ctrl.update(current_kl, n_steps=batch_size)`, which the
    trainer calls after this (reduce it over data-parallel ranks first). `reward_kl_penalty_coeff` is `kl_coef`.
    """
    mask = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type) * mask  # (B, T)
    rewards = token_level_scores - kl_coef * kld  # (B, T)
    per_seq_kl = masked_mean(kld, mask, dim=-1)  # (B,)
    metrics = {
        "reward_kl_penalty": per_seq_kl.mean().detach(),
        "reward_kl_penalty_coeff": torch.tensor(float(kl_coef)),
    }
    return rewards, metrics


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_loss_coef: float,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_tokens: Any = None,
    global_seqs: Any = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL to the reference as a term to *add* to the actor loss: `kl_loss_coef * agg(KL_t)`.

    `log_prob` (B, T) carries gradients; `ref_log_prob` (B, T) does not. Metrics: `kl_loss` (the aggregated
    KL, before the coefficient) and `kl_coef`.
    """
    kld = kl_penalty(log_prob, ref_log_prob, kl_loss_type)  # (B, T)
    kl = agg_loss(
        kld,
        response_mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    return kl_loss_coef * kl, {"kl_loss": kl.detach(), "kl_coef": torch.tensor(float(kl_loss_coef))}
