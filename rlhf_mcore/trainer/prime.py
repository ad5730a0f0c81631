"""PRIME in the RL loop (`reward_model.reward_manager=prime`, `reward_model.enable=true`): an implicit process
reward model updated online, and the advantages PRIME computes from it (the math: :mod:`rlhf_mcore.algos.prime`).

The implicit PRM is a second copy of the policy's model on the train engine (the actor's layout, its own
optimizer: `reward_model.model.optim`); its reference is the run's reference policy (built for PRIME), so
`q_t = log pi_prm(y_t) - log pi_ref(y_t)` needs no extra forward pass of a third model. Each step, after the
old/ref log-probs:

1. the outcome label of each response is its rule score (`token_level_scores` summed over the response, overlong
   penalty included), which must lie in [0, 1];
2. `reward_model.model.update=before` (veRL's default): one optimizer step of the PRM on the cross-entropy between
   `sigmoid(beta_train * sum_t q_t)` and the label, then the PRM's log-probs; `after`: the log-probs first;
3. token-level process rewards (`prime_granularity`, `prime_norm` with the largest |return-to-go| taken over all
   data-parallel ranks), then RLOO on them and on the outcome (`algorithm.reward_dpo_coef`, `reward_gt_coef`), the
   returns whitened over every rank's response tokens.

Metrics: `prime/dpo_acc` (how well the PRM's summed q orders each group by outcome, with the log-probs the rewards
came from), `prime/process_reward_mean` (the normalised process rewards summed per response) and the PRM update's
`prime_rm/*`.

The PRM's weights and optimizer are saved in every checkpoint (`prm/`) and loaded on resume
(`Learner.save_engines` / `load_engines`). Not done yet: it is not offloaded around generation.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from rlhf_mcore.algos.prime import (
    implicit_process_rewards,
    prime_advantages,
    prime_ce_loss,
    prime_dpo_accuracy,
    prime_norm,
)
from rlhf_mcore.engine.losses import LossContext, score_tokens
from rlhf_mcore.engine.micro_batches import MicroBatch
from rlhf_mcore.engine.train_engine import TrainEngine
from rlhf_mcore.parallel.collectives import group_all_reduce

__all__ = ["ImplicitPRMEngine", "ImplicitPRM", "build_prime", "prm_ce_loss"]


def prm_ce_loss(output: torch.Tensor, mb: MicroBatch, ctx: LossContext, *, beta: float) -> tuple[torch.Tensor, dict]:
    """This micro-batch's share of the mini-batch's mean PRIME cross-entropy (over its sequences, all DP ranks)."""
    mask = mb.data["response_mask"]  # (b, R)
    logp, _ = score_tokens(output, mb.inputs, ctx.cfg, ctx.tp_group, ctx.vocab_size, compute_entropy=False)
    q = (logp - mb.data["ref_log_prob"]) * mask
    acc = mb.data["prime_acc"][:, 0]  # (b,) the label, repeated over the row
    loss = prime_ce_loss(q, acc, mask, beta) * q.shape[0] / ctx.global_seqs
    return loss * ctx.scale, {"ce_loss": loss.detach(), "loss": loss.detach()}


class ImplicitPRMEngine(TrainEngine):
    """The policy-shaped PRM on the train engine: log-probs as the actor's, trained by :func:`prm_ce_loss`."""

    def __init__(self, chunks, state, cfg, optim, *, beta: float, **kwargs):
        super().__init__(chunks, state, cfg, optim, **kwargs)
        self.beta = beta

    def loss_inputs(self, batch: dict):
        return ("response_mask", "ref_log_prob", "prime_acc"), partial(prm_ce_loss, beta=self.beta)


class ImplicitPRM:
    """Runs steps 1-3 of the module docstring on one DP rank's batch."""

    def __init__(self, engine: ImplicitPRMEngine, rm_cfg, alg_cfg, dp_group=None):
        self.engine, self.rm, self.alg, self.dp_group = engine, rm_cfg, alg_cfg, dp_group

    def compute_advantages(self, batch: dict[str, Any]) -> dict[str, float]:
        mask = batch["response_mask"].float()
        acc = batch["token_level_scores"].sum(-1).float()  # (B,) the outcome label
        if bool(((acc < 0) | (acc > 1)).any()):
            raise ValueError(f"PRIME's outcome labels must lie in [0, 1] (its cross-entropy reads them as "
                             f"probabilities); this batch has rule scores in [{float(acc.min()):g}, "
                             f"{float(acc.max()):g}]: use a 0/1 reward function (or turn the overlong penalty off)")
        train = {**batch, "prime_acc": acc[:, None].expand_as(mask).contiguous()}
        metrics: dict[str, float] = {}
        if self.rm.model.update == "before":
            metrics.update(self._update(train))
        prm_lp, _ = self.engine.compute_log_probs(batch, with_entropy=False)
        scores, q = implicit_process_rewards(prm_lp, batch["ref_log_prob"], mask, self.rm.model.beta_train,
                                             self.rm.prime_granularity)
        if self.rm.prime_norm == "batch_norm":  # the largest |return-to-go| over all DP ranks
            biggest = group_all_reduce(scores.flip(-1).cumsum(-1).flip(-1).abs().max().reshape(1), self.dp_group,
                                       dist.ReduceOp.MAX)
            scores = scores / (biggest + 1e-6)
        else:
            scores = prime_norm(scores, "none")
        if self.rm.model.update == "after":
            metrics.update(self._update(train))

        def batch_sums(stats: torch.Tensor) -> torch.Tensor:
            return group_all_reduce(stats, self.dp_group, dist.ReduceOp.SUM)

        batch["advantages"], batch["returns"] = prime_advantages(
            scores, acc, mask, batch["index"], reward_dpo_coef=self.alg.reward_dpo_coef,
            reward_gt_coef=self.alg.reward_gt_coef, batch_sums=batch_sums)
        batch["token_level_rewards"] = batch["token_level_scores"]
        metrics["prime/dpo_acc"] = float(prime_dpo_accuracy(q, acc, mask, batch["index"]))
        metrics["prime/process_reward_mean"] = float(scores.sum(-1).mean())
        return metrics

    def _update(self, batch: dict) -> dict[str, float]:
        out = self.engine.update(batch)
        return {k.replace("actor/", "prime_rm/", 1).replace("perf/actor/", "perf/prime_rm/", 1): v
                for k, v in out.items()}


def build_prime(cfg, state, total_steps: int):
    """The implicit PRM of `cfg` (None unless PRIME is on), built from the actor's model on the actor's layout."""
    from rlhf_mcore.config import pipeline_split, prime_enabled
    from rlhf_mcore.engine.builder import _dtype
    from rlhf_mcore.engine.config import EngineConfig
    from rlhf_mcore.models import build_model

    if not prime_enabled(cfg):
        return None
    arr, rm = cfg.actor_rollout_ref, cfg.reward.reward_model
    ecfg = dataclasses.replace(
        EngineConfig.from_actor(arr.actor, arr.model, arr.rollout, state.dims.dp), ppo_epochs=1, use_kl_loss=False,
        entropy_coeff=0.0, shuffle=False)
    optim = dataclasses.replace(rm.model.optim, total_training_steps=total_steps)
    chunks = build_model(arr.model.path, state, role="actor", dtype=_dtype(arr.model.dtype),
                         config_overrides=pipeline_split(cfg) or None)
    engine = ImplicitPRMEngine(chunks, state, ecfg, optim, beta=rm.model.beta_train,
                               use_distributed_optimizer=arr.actor.megatron.use_distributed_optimizer,
                               hf_dir=str(arr.model.path))
    return ImplicitPRM(engine, rm, cfg.algorithm, state.dp_group)
