"""Per-step batch statistics (reward, response length, advantages, KL) and memory, as flat floats."""
from __future__ import annotations

import resource
import sys
from typing import Any

import torch


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def batch_metrics(batch: dict[str, Any]) -> dict[str, float]:
    mask = batch["response_mask"].float()  # (B, R)
    lengths = mask.sum(1)  # (B,)
    scores = batch["token_level_scores"].sum(1)  # (B,)
    rewards = batch["token_level_rewards"].sum(1)  # (B,)
    out = {
        "critic/score/mean": float(scores.mean()), "critic/score/std": float(scores.std(unbiased=False)),
        "critic/score/max": float(scores.max()), "critic/score/min": float(scores.min()),
        "critic/rewards/mean": float(rewards.mean()),
        "critic/advantages/mean": _masked_mean(batch["advantages"], mask),
        "critic/returns/mean": _masked_mean(batch["returns"], mask),
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(batch["truncated"].float().mean()),
        "prompt_length/mean": float(batch["attention_mask"].sum(1).float().mean() - lengths.mean()),
        "actor/rollout_entropy": _masked_mean(batch["old_entropy"], mask) if "old_entropy" in batch else 0.0,
    }
    if "values" in batch:
        out["critic/values/mean"] = _masked_mean(batch["values"], mask)
    if "ref_log_prob" in batch:
        kl = batch["old_log_probs"] - batch["ref_log_prob"]
        out["actor/reward_kl"] = _masked_mean(kl, mask)
    if "old_log_probs" in batch and batch["old_log_probs"] is not batch["rollout_log_probs"]:  # not bypass mode
        out.update(rollout_gap_metrics(batch["rollout_log_probs"], batch["old_log_probs"], mask))
    return out


def rollout_gap_metrics(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                        mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's log-probs (B, R) are from the actor's recomputed ones (B, R) on the response
    tokens of `mask` (B, R). With the same weights this is numerics only (kernels, dtype, batch shapes).

    - `rollout/logprob_diff_abs`: mean |log pi_rollout - log pi_actor|;
    - `rollout/k3_kl`: mean k3 estimate of KL(pi_rollout || pi_actor) from the rollout's own samples,
      exp(r) - r - 1 with r = log pi_actor - log pi_rollout (>= 0, unbiased);
    - `rollout/k3_kl/max`: its largest token (one broken token shows here when the mean hides it).
    """
    m = mask.bool()
    if not m.any():
        return {"rollout/logprob_diff_abs": 0.0, "rollout/k3_kl": 0.0, "rollout/k3_kl/max": 0.0}
    r = (old_log_probs.double() - rollout_log_probs.double())[m]  # (N,) valid tokens
    k3 = torch.expm1(r) - r  # (N,)
    return {"rollout/logprob_diff_abs": float(r.abs().mean()), "rollout/k3_kl": float(k3.mean()),
            "rollout/k3_kl/max": float(k3.max())}


def peak_memory_gb() -> float:
    """Peak GPU memory on CUDA (GiB; a weight sync's own measurement does not hide it), else the process's peak
    resident memory."""
    if torch.cuda.is_available():
        from rlhf_mcore.sync.memory import device_peak_bytes

        return device_peak_bytes() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def reset_peak_memory() -> None:
    """Start the next step's peak window (GPU only; a process's peak resident memory cannot be reset)."""
    if torch.cuda.is_available():
        from rlhf_mcore.sync.memory import reset_device_peak

        reset_device_peak()
