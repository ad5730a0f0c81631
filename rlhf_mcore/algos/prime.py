"""PRIME (implicit process rewards, Cui et al. 2025) as pure functions on `[batch, response_len]` grids.

An implicit process reward model (PRM) is a causal LM initialised from the SFT / policy model and trained only on
outcome labels. Its token-level "Q-difference" is

    q_t = log pi_prm(y_t | y_<t) - log pi_ref(y_t | y_<t)                      (0 past the response)

and its process reward `r_t = beta * q_t` (`beta`: veRL's `reward_model.model.beta_train`, 0.05).

- :func:`implicit_process_rewards` — `q` and the token-level scores: `prime_granularity=token` puts `r_t` on each
  response token; `whole` puts `sum_t r_t` on the last one. (veRL's `token` branch leaves the last token's
  `r_t` out; here every response token carries its own reward, as the PRIME paper writes it.)
- :func:`prime_norm` — `prime_norm=batch_norm`: the scores divided by the largest |return-to-go| of the batch,
  `max_{i,t} |sum_{t' >= t} r_{i,t'}|` (+1e-6); `none`: unchanged.
- :func:`masked_rloo` — the leave-one-out baseline of one reward source within each prompt's group of `n`
  samples: with `m_j` sample j's mean reward over its masked positions,
  `r'_{i,t} = r_{i,t} * n / (n - 1) - sum_j m_j / (n - 1)`; for an outcome reward (one position per sample)
  this is `r_i - mean_{j != i} r_j`.
- :func:`prime_advantages` — RLOO on both sources, separately: the process scores (mask: the response) times
  `algorithm.reward_dpo_coef` plus the outcome `acc` at the last response token (mask: that token) times
  `algorithm.reward_gt_coef`; returns are the reverse cumulative sum over the response, and advantages the returns
  whitened over the batch's response tokens.
- :func:`prime_ce_loss` — the PRM's online objective: binary cross-entropy between
  `sigmoid(beta * sum_t q_t)` and the outcome label `acc` in [0, 1].
- :func:`prime_dpo_accuracy` — within each group, the share of sample pairs whose summed `q` orders them as
  their outcomes do, weighted by |acc_i - acc_j| (0.5 for a group whose outcomes are all equal), averaged over
  groups.
"""
from __future__ import annotations

import torch

__all__ = ["implicit_process_rewards", "prime_norm", "masked_rloo", "prime_advantages", "prime_ce_loss",
           "prime_dpo_accuracy", "GRANULARITIES", "NORMS"]

GRANULARITIES = ("token", "whole")
NORMS = ("batch_norm", "none")


def _last_token(mask: torch.Tensor) -> torch.Tensor:
    """(B,) column of each row's last valid response token (rows need at least one)."""
    lengths = mask.sum(-1).long()
    if bool((lengths == 0).any()):
        raise ValueError("a response has no valid token; PRIME places rewards on response tokens")
    return lengths - 1


def implicit_process_rewards(prm_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, response_mask: torch.Tensor,
                             beta: float, granularity: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """(token-level scores (B, R), q (B, R)); see the module docstring. Differentiable in `prm_log_probs`
    through `q` only (the scores are detached)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"reward_model.prime_granularity={granularity!r}; choose one of {GRANULARITIES}")
    mask = response_mask.to(prm_log_probs.dtype)
    q = (prm_log_probs - ref_log_probs) * mask  # (B, R)
    r = beta * q.detach()
    if granularity == "token":
        return r, q
    scores = torch.zeros_like(r)
    last = _last_token(response_mask)
    scores[torch.arange(r.shape[0]), last] = r.sum(-1)
    return scores, q


def prime_norm(scores: torch.Tensor, mode: str = "batch_norm") -> torch.Tensor:
    """`batch_norm`: `scores / (max |return-to-go| + 1e-6)` over the whole batch; `none`: `scores`."""
    if mode not in NORMS:
        raise ValueError(f"reward_model.prime_norm={mode!r}; choose one of {NORMS}")
    if mode == "none":
        return scores
    to_go = scores.flip(-1).cumsum(-1).flip(-1)  # (B, R)
    return scores / (to_go.abs().max() + 1e-6)


def masked_rloo(rewards: torch.Tensor, mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baselined rewards (module docstring), 0 outside `mask`. `index` (B,): group id per row; every
    group needs >= 2 rows."""
    mask = mask.bool()
    out = torch.zeros_like(rewards)
    count = mask.sum(-1).clamp(min=1)
    per_sample = torch.where(mask, rewards, torch.zeros_like(rewards)).sum(-1) / count  # (B,) m_i
    for g in torch.unique(index):
        rows = (index == g).nonzero(as_tuple=True)[0]
        n = rows.numel()
        if n < 2:
            raise ValueError(f"group {int(g)} has {n} sample(s); RLOO needs rollout.n >= 2")
        total = per_sample[rows].sum()
        sub = rewards[rows] * n / (n - 1) - total / (n - 1)  # (n, R)
        out[rows] = torch.where(mask[rows], sub, torch.zeros_like(sub))
    return out


def _whiten(values: torch.Tensor, mask: torch.Tensor, batch_sums) -> torch.Tensor:
    """`(values - mean) / sqrt(var + 1e-8)` with the mean and the unbiased variance of the masked entries of the
    whole batch: `batch_sums` adds the (3,) partial sums of every data-parallel rank (identity on one rank)."""
    m = mask.to(values.dtype)
    stats = batch_sums(torch.stack([(values * m).sum(), (values * values * m).sum(), m.sum()]))
    n = stats[2].clamp(min=1)
    mean = stats[0] / n
    var = (stats[1] / n - mean * mean).clamp(min=0)
    var = var * n / (n - 1) if float(stats[2]) > 1 else torch.zeros_like(var)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def prime_advantages(token_level_scores: torch.Tensor, acc: torch.Tensor, response_mask: torch.Tensor,
                     index: torch.Tensor, *, reward_dpo_coef: float, reward_gt_coef: float,
                     batch_sums=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both (B, R); see the module docstring. `acc` (B,): the outcome reward. Groups must
    not span data-parallel ranks; `batch_sums` (a sum over those ranks of a small tensor) makes the whitening
    global."""
    mask = response_mask.bool()
    total = torch.zeros_like(token_level_scores)
    if reward_dpo_coef != 0:
        total = total + reward_dpo_coef * masked_rloo(token_level_scores, mask, index)
    if reward_gt_coef != 0:
        last = _last_token(response_mask)
        rows = torch.arange(acc.shape[0])
        outcome = torch.zeros_like(token_level_scores)
        outcome[rows, last] = acc.to(outcome.dtype)
        at_last = torch.zeros_like(mask)
        at_last[rows, last] = True
        total = total + reward_gt_coef * masked_rloo(outcome, at_last, index)
    returns = (total * mask).flip(-1).cumsum(-1).flip(-1)
    advantages = _whiten(returns, mask, batch_sums or (lambda t: t)) * mask
    return advantages, returns


def prime_ce_loss(q: torch.Tensor, acc: torch.Tensor, response_mask: torch.Tensor, beta: float) -> torch.Tensor:
    """Mean over rows of `BCE(sigmoid(beta * sum_t q_t), acc)` (computed from the logit, stable)."""
    logit = beta * (q * response_mask.to(q.dtype)).sum(-1)
    return torch.nn.functional.binary_cross_entropy_with_logits(logit, acc.to(logit.dtype))


def prime_dpo_accuracy(q: torch.Tensor, acc: torch.Tensor, response_mask: torch.Tensor,
                       index: torch.Tensor) -> torch.Tensor:
    """How well the PRM's summed q orders each group's samples by outcome (module docstring); a scalar."""
    total = (q * response_mask.to(q.dtype)).sum(-1)
    per_group = []
    for g in torch.unique(index):
        rows = (index == g).nonzero(as_tuple=True)[0]
        i, j = torch.triu_indices(rows.numel(), rows.numel(), offset=1)
        d_acc = acc[rows][i] - acc[rows][j]
        d_score = total[rows][i] - total[rows][j]
        weight = d_acc.abs()
        if float(weight.sum()) == 0:
            per_group.append(torch.tensor(0.5, dtype=q.dtype))
            continue
        agree = ((d_score > 0) == (d_acc > 0)).to(q.dtype)
        per_group.append((agree * weight).sum() / weight.sum())
    return torch.stack(per_group).mean()
