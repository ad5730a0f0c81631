"""Advantage estimators: token-level rewards -> (advantages, returns), chosen by `algorithm.adv_estimator`.

Every estimator is a plain function registered by name and called with keyword arguments only::

    fn = get_adv_estimator("grpo")
    advantages, returns = fn(token_level_rewards=r, response_mask=m, index=uids, gamma=1.0, lam=1.0,
                             norm_adv_by_std_in_grpo=True, values=None, reward_baselines=None)

Inputs are right-padded `[B, T]` response grids: `token_level_rewards` (B, T) (outcome rewards usually sit on
the last valid token), `response_mask` (B, T) with 1 on generated tokens, `values` (B, T) from the critic,
`index` (B,) a group id per row (all samples of one prompt share it; any hashable: int, str, uuid),
`reward_baselines` (B,) for ReMax. Each estimator takes what it needs and ignores the rest (`**_`), so the
trainer can pass one uniform set of keywords. Both outputs are (B, T) float32 and zero outside the mask.

The definitions follow veRL 0.7 (`verl/trainer/ppo/core_algos.py`) so results carry over: GRPO uses the
unbiased group std and `eps = 1e-6`; a group of one keeps its raw score (mean 0, std 1); RLOO uses the
leave-one-out mean; REINFORCE++ whitens discounted returns over the whole batch. Group statistics are
computed in float64, which makes a group of equal rewards give exactly zero advantage.

Users add estimators the same way the built-ins are defined::

    @register_adv_estimator("my_estimator", needs_group_index=True)
    def my_estimator(*, token_level_rewards, response_mask, index, **_):
        ...
        return advantages, returns

What an estimator needs from the trainer is registered with it (:class:`AdvEstimator`): a critic's values
(`needs_critic`, GAE), the reward of a greedy response per prompt (`needs_greedy_baseline`, ReMax), several
samples per prompt grouped by `index` (`needs_group_index`, GRPO/RLOO); and whether, at `lam=1`, its returns do not
read the values (`lam1_returns_free_of_values`, GAE: the discounted rewards-to-go), so that a critic's update may
compute some rows' values itself before the advantages read them (rlhf_mcore.trainer.learner.Learner.
values_from_update). The trainer and the config checks read these facts; nothing outside this module names an
estimator.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlhf_mcore.algos.masked import masked_whiten
from rlhf_mcore.registry import Registry

__all__ = [
    "AdvEstimatorFn",
    "AdvEstimator",
    "register_adv_estimator",
    "get_adv_estimator",
    "adv_estimator_info",
    "list_adv_estimators",
    "group_ids",
    "compute_gae",
    "compute_grpo",
    "compute_rloo",
    "compute_remax",
    "compute_reinforce_plus_plus",
    "compute_reinforce_plus_plus_baseline",
]

AdvEstimatorFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AdvEstimator:
    """A registered estimator and what the trainer has to provide for it."""

    fn: AdvEstimatorFn
    needs_critic: bool = False  # `values` (B, T) from a critic
    needs_greedy_baseline: bool = False  # `reward_baselines` (B,): the reward of a greedy response to each prompt
    needs_group_index: bool = False  # `index` (B,) groups the n samples of a prompt; n >= 2 to mean anything
    # with lam=1 the returns equal those of any other values (the values enter the advantages only)
    lam1_returns_free_of_values: bool = False

    def returns_free_of_values(self, lam: float) -> bool:
        """Whether this estimator's returns at `lam` do not depend on the values it is given."""
        return self.lam1_returns_free_of_values and lam == 1


_ADV_ESTIMATORS: Registry[AdvEstimator] = Registry(
    "advantage estimator", "Register a new one with @rlhf_mcore.algos.register_adv_estimator(name).")

GRPO_EPS = 1e-6  # veRL's epsilon in (score - mean) / (std + eps)


def register_adv_estimator(name: str, *, needs_critic: bool = False, needs_greedy_baseline: bool = False,
                           needs_group_index: bool = False, lam1_returns_free_of_values: bool = False,
                           override: bool = False) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator: make `fn` available as `algorithm.adv_estimator=<name>`, with what it needs (see
    :class:`AdvEstimator`).

    Registering a different function under a taken name raises unless `override=True`, so two plugins
    cannot silently replace each other.
    """

    def decorator(fn: AdvEstimatorFn) -> AdvEstimatorFn:
        _ADV_ESTIMATORS.add(name, AdvEstimator(fn, needs_critic, needs_greedy_baseline, needs_group_index,
                                               lam1_returns_free_of_values), override=override)
        return fn

    return decorator


def adv_estimator_info(name: str) -> AdvEstimator:
    """The estimator registered as `name` with its needs; a ValueError lists the known names otherwise."""
    return _ADV_ESTIMATORS.get(name, key="algorithm.adv_estimator")


def get_adv_estimator(name: str) -> AdvEstimatorFn:
    """The estimator function registered as `name`; a ValueError lists the known names otherwise."""
    return adv_estimator_info(name).fn


def list_adv_estimators() -> list[str]:
    """Names of all registered advantage estimators."""
    return _ADV_ESTIMATORS.names()


# --------------------------------------------------------------------------------------------- helpers


def group_ids(index: Any, batch_size: int, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Map per-row group labels (ints, strings, uuids; list, numpy array or tensor) to dense ids.

    Returns `(ids, num_groups)` with `ids` (B,) int64 in order of first appearance.
    """
    if index is None:
        raise ValueError("this advantage estimator groups samples by prompt: pass index=<group id per row>")
    labels = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(labels) != batch_size:
        raise ValueError(f"index has {len(labels)} entries but the batch has {batch_size} rows")
    dense: dict[Any, int] = {}
    ids = [dense.setdefault(label, len(dense)) for label in labels]
    return torch.tensor(ids, dtype=torch.long, device=device), len(dense)


def _group_mean_std(scores: torch.Tensor, ids: torch.Tensor, num_groups: int):
    """Per-row group size, mean and unbiased std of `scores` (B,), in float64. Groups of one get mean 0, std 1."""
    x = scores.to(torch.float64)  # (B,)
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=x.device)
    counts = zeros.index_add(0, ids, torch.ones_like(x))  # (G,)
    mean = zeros.index_add(0, ids, x) / counts  # (G,)
    sq_dev = zeros.index_add(0, ids, (x - mean[ids]) ** 2)  # (G,)
    std = (sq_dev / (counts - 1).clamp(min=1)).sqrt()  # (G,)
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return counts[ids], mean[ids], std[ids]  # each (B,)


def _outcome_scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    """One scalar per response: the sum of its token rewards. (B, T) -> (B,)"""
    return token_level_rewards.float().sum(dim=-1)


# --------------------------------------------------------------------------------------------- estimators


def _gae_recursion(rewards: np.ndarray, values: np.ndarray, valid: np.ndarray, gamma: float, lam: float) -> np.ndarray:
    """GAE's unwhitened advantages (B, T) float32 by the backward recursion over valid tokens (compute_gae's doc)."""
    r, v, ok = (np.ascontiguousarray(x.T) for x in (rewards, values, valid))  # (T, B): one row a step
    next_value = np.zeros(r.shape[1], dtype=np.float32)  # (B,)
    next_adv = np.zeros_like(next_value)  # (B,)
    adv = np.empty_like(r)  # (T, B)
    g, gl = np.float32(gamma), np.float32(gamma * lam)  # torch's rule for a Python scalar times a float32 tensor
    for t in range(r.shape[0] - 1, -1, -1):
        adv_t = (r[t] + g * next_value - v[t]) + gl * next_adv  # delta_t + gamma * lam * A_next
        np.copyto(next_value, v[t], where=ok[t])
        np.copyto(next_adv, adv_t, where=ok[t])
        adv[t] = next_adv
    return np.ascontiguousarray(adv.T)  # (B, T) row-major, as the batch's tensors: the whitening's sums in their order


@register_adv_estimator("gae", needs_critic=True, lam1_returns_free_of_values=True)
def compute_gae(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016) with a critic; advantages whitened over the batch.

    Backward recursion over valid tokens: `delta_t = r_t + gamma * V_next - V_t`, `A_t = delta_t + gamma *
    lam * A_next`; masked positions (padding, or tool/observation tokens inside a response) are skipped:
    they neither contribute a TD error nor break the chain. `returns = A + V` (before whitening) is the
    critic's regression target; `advantages` is `A` whitened over all valid tokens of the batch. With `lam=1`
    the sum telescopes: `A_t = G_t - V_t` (`G` the discounted reward-to-go over valid tokens), so the returns are
    `G` whatever the values (to fp32 rounding).
    """
    if values is None:
        raise ValueError("adv_estimator='gae' needs critic values (values=...); enable a critic or use 'grpo'")
    # The recursion runs on the host in numpy: T sequential steps of (B,)-vector ops are bound by kernel launches on a
    # GPU (~0.1 s for 512 tokens on an H200, BENCHMARKS.md) and by torch's per-op dispatch on the CPU (17.6 ms at
    # 256 x 512 here); numpy's float32 ops on time-major rows give the same bits (tests/test_advantages.py) in 4.1 ms.
    device = token_level_rewards.device
    values = values.detach().float()
    adv = torch.from_numpy(_gae_recursion(token_level_rewards.detach().float().cpu().numpy(),
                                          values.cpu().numpy(), response_mask.bool().cpu().numpy(), gamma, lam))
    adv = adv.to(device)
    mask = response_mask.float()
    returns = (adv + values) * mask  # (B, T)
    advantages = masked_whiten(adv, mask) * mask  # (B, T)
    return advantages, returns


@register_adv_estimator("grpo", needs_group_index=True)
def compute_grpo(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | Any = None,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = GRPO_EPS,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: `(score - group mean) / (group std + eps)`, broadcast over the response.

    `norm_adv_by_std_in_grpo=False` drops the division (Dr.GRPO, arXiv:2503.20783). The std is unbiased; a
    group of one sample keeps its raw score. Returns `(advantages, advantages)` as veRL does.
    """
    scores = _outcome_scores(token_level_rewards)  # (B,)
    ids, num_groups = group_ids(index, scores.shape[0], scores.device)
    _, mean, std = _group_mean_std(scores, ids, num_groups)  # (B,) each, float64
    centered = scores.double() - mean
    adv = centered / (std + epsilon) if norm_adv_by_std_in_grpo else centered  # (B,)
    advantages = adv.float().unsqueeze(-1) * response_mask.float()  # (B, T)
    return advantages, advantages


@register_adv_estimator("rloo", needs_group_index=True)
def compute_rloo(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): score minus the mean of the *other* samples of its group.

    `A_i = r_i - (sum_j r_j - r_i) / (n - 1)`; a group of one keeps its raw score (as veRL's `rloo`).
    """
    scores = _outcome_scores(token_level_rewards)  # (B,)
    ids, num_groups = group_ids(index, scores.shape[0], scores.device)
    counts, mean, _ = _group_mean_std(scores, ids, num_groups)  # (B,) each
    x = scores.double()
    loo = (counts * x - counts * mean) / (counts - 1).clamp(min=1)  # (B,)  == x - mean of the others
    adv = torch.where(counts > 1, loo, x)
    advantages = adv.float().unsqueeze(-1) * response_mask.float()  # (B, T)
    return advantages, advantages


@register_adv_estimator("remax", needs_greedy_baseline=True)
def compute_remax(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): reward-to-go minus the reward of the greedy response to the same prompt.

    `reward_baselines` (B,) holds, per row, the score of a greedy (temperature 0) rollout of its prompt.
    """
    if reward_baselines is None:
        raise ValueError("adv_estimator='remax' needs reward_baselines=<greedy-rollout score per row> (B,)")
    mask = response_mask.float()
    returns = (token_level_rewards.float() * mask).flip(-1).cumsum(-1).flip(-1)  # (B, T) reward-to-go
    advantages = returns - reward_baselines.float().unsqueeze(-1) * mask  # (B, T)
    return advantages, returns


@register_adv_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted returns whitened over all valid tokens of the batch.

    The running return restarts after every masked position (the end of a response). Returns are the
    un-whitened discounted returns.
    """
    rewards = token_level_rewards.float()  # (B, T)
    mask = response_mask.float()  # (B, T)
    returns = torch.zeros_like(rewards)  # (B, T)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    advantages = masked_whiten(returns, mask) * mask  # (B, T)
    return advantages, returns * mask


@register_adv_estimator("reinforce_plus_plus_baseline", needs_group_index=True)
def compute_reinforce_plus_plus_baseline(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: `score - group mean` on every token, whitened over the batch.

    A group of one keeps its raw score before whitening. Returns `(advantages, advantages)` as veRL does.
    """
    scores = _outcome_scores(token_level_rewards)  # (B,)
    ids, num_groups = group_ids(index, scores.shape[0], scores.device)
    _, mean, _ = _group_mean_std(scores, ids, num_groups)  # (B,)
    mask = response_mask.float()  # (B, T)
    centered = (scores.double() - mean).float().unsqueeze(-1) * mask  # (B, T)
    advantages = masked_whiten(centered, mask) * mask  # (B, T)
    return advantages, advantages
