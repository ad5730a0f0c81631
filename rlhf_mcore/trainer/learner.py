"""The learner: the training engines (actor, critic, reference, PRIME's implicit PRM) and what turns a generated
batch into their updates -- old / reference log-probs and values, advantages (the KL-in-reward penalty, PRIME),
rollout correction, the critic's and the actor's updates. Every mode's loop calls :meth:`Learner.train_on`; it
returns the step's metrics and keeps nothing of the step. The actor's update computes the old log-probs of its first
mini-batch itself, which the old-log-prob pass then leaves out: all of them, and no pass, when the update is one
optimizer step on the whole batch (:meth:`Learner.old_from_update`); the critic's update likewise its first
mini-batch's values, which the values pass leaves out (:meth:`Learner.values_from_update`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from rlhf_mcore import algos
from rlhf_mcore.engine.micro_batches import select_rows
from rlhf_mcore.engine.routes import OLD_ROUTES, ROLLOUT_ROUTES
from rlhf_mcore.parallel.collectives import group_all_reduce
from rlhf_mcore.trace import span
from rlhf_mcore.trainer.hooks import PhaseTimer
from rlhf_mcore.trainer.logging import reduce_metrics


class Learner:
    def __init__(self, cfg, state, actor, critic=None, ref=None, prime=None):
        self.cfg, self.state = cfg, state
        self.actor, self.critic, self.ref, self.prime = actor, critic, ref, prime
        self.kl_ctrl = algos.build_kl_controller(**vars(cfg.algorithm.kl_ctrl))
        self.estimator = algos.adv_estimator_info(cfg.algorithm.adv_estimator)  # the function and what it needs

    def train_on(self, batch: dict[str, Any], t: PhaseTimer) -> dict[str, float]:
        """A generated batch to an update (steps 4-6 of every mode). Returns their metrics, with
        `actor/old_log_prob_from_update`: the fraction of the batch's rows whose old log-probs the update computed
        (:meth:`old_from_update`; 1 when there was no pass, 0 when the pass took every row), and with a critic
        `critic/values_from_update`, the same for the values (:meth:`values_from_update`)."""
        B = batch["response_mask"].shape[0]
        rows = self.actor.on_policy_rows(B) if self.old_from_update(batch) else None
        value_rows = self.critic.on_policy_rows(B) if self.values_from_update() else None
        with t("old_log_prob"):
            route_metrics = self.forward_passes(batch, skip=rows, skip_values=value_rows)
        with t("adv"):
            adv_metrics = self.compute_advantages(batch)  # with value_rows: their returns only (values not yet read)
            corr_metrics = self.correct_rollout(batch)  # off-policy IS weights / rejection
        with t("update"):
            update_metrics = self.update(batch, on_policy=rows is not None, values_on_policy=value_rows is not None)
        shares = {"actor/old_log_prob_from_update": 0.0 if rows is None else rows.numel() / B}
        if self.critic is not None:
            shares["critic/values_from_update"] = 0.0 if value_rows is None else value_rows.numel() / B
        return {**route_metrics, **adv_metrics, **corr_metrics, **update_metrics, **shares}

    def old_from_update(self, batch: dict[str, Any]) -> bool:
        """Whether the actor update's first mini-batch takes its own log-probs, detached, as the old ones, and the
        old-log-prob pass leaves its rows out (`actor.old_log_prob_from_update`, on by default; the rows:
        the engine's `on_policy_rows`). Exact: that mini-batch runs before any optimizer step, so its forward runs
        the policy the pass would run -- the same values, loss and gradient (its ratio is exactly 1). When the
        update is one optimizer step on the whole batch (ppo_epochs=1, one mini-batch) there is no pass at all;
        with n mini-batches the pass takes (n - 1) / n of the rows. Not taken when something reads the old
        log-probs before the update -- the KL penalty in the reward (the advantages), rollout correction (its IS
        weights and rejection mask), a MoE actor's pass (R2 replays its routes; the routing metrics read them) --
        nor with `use_rollout_log_probs` (no pass to skip). `batch` is the step's (the decision does not depend
        on it today)."""
        actor, alg = self.cfg.actor_rollout_ref.actor, self.cfg.algorithm
        return (actor.old_log_prob_from_update and not actor.use_rollout_log_probs and not alg.use_kl_in_reward
                and not _corrects(alg.rollout_correction) and getattr(self.actor, "moe_shape", None) is None)

    def values_from_update(self) -> bool:
        """Whether the critic update's first mini-batch takes its own values, detached, as the old ones (those its
        clipped loss reads) and the values pass leaves its rows out (`critic.values_from_update`, on by default).
        Exact as :meth:`old_from_update` is, where nothing reads those rows' values before the critic's update:
        the returns (the critic's targets) must not depend on them -- GAE's with `lam=1` are the discounted
        rewards-to-go (`A + V` with `A = G - V`) -- and the advantages, which do, are estimated again once the
        critic's update has written its values back (before the actor's update; the critic updates first)."""
        if self.critic is None or self.prime is not None or not self.cfg.critic.values_from_update:
            return False
        return self.estimator.returns_free_of_values(self.cfg.algorithm.lam)

    def forward_passes(self, batch: dict[str, Any], skip: Optional[torch.Tensor] = None,
                       skip_values: Optional[torch.Tensor] = None) -> dict[str, float]:
        """Old log-probs (not at the rows `skip`: the actor's update computes those, :meth:`old_from_update`),
        reference log-probs, values (not at the rows `skip_values`: the critic's update computes those, zeros
        there until it has, :meth:`values_from_update`). Returns the routing metrics of a MoE actor's
        old-log-prob pass (:meth:`old_log_probs`)."""
        metrics = self.old_log_probs(batch, skip)
        if self.ref is not None:
            with span("reference"):
                batch["ref_log_prob"], _ = self.ref.compute_log_probs(batch)
        if self.critic is not None:
            with span("values"):
                if skip_values is None:
                    batch["values"] = self.critic.compute_values(batch)
                else:  # zeros at skip_values until the critic's update writes them (the returns do not read them)
                    out = _pass_but(batch, skip_values, lambda b: (self.critic.compute_values(b),))
                    batch["values"] = out[0] if out is not None else batch["response_mask"].new_zeros(
                        batch["response_mask"].shape, dtype=torch.float32)
        return metrics

    def old_log_probs(self, batch: dict[str, Any], skip: Optional[torch.Tensor] = None) -> dict[str, float]:
        """`old_log_probs` (and `old_entropy`) into the batch; with `skip` (rows the update computes them for) of
        the other rows only, zeros at those (no pass when no other row is left). A MoE actor records its routes in
        the old-log-prob pass (R2 replays them in the update); returns the routing metrics
        (:meth:`routing_metrics`)."""
        if skip is not None:
            self.old_log_probs_but(batch, skip)
        elif self.cfg.actor_rollout_ref.actor.use_rollout_log_probs:  # the rollout's log-probs are the old policy
            batch["old_log_probs"] = batch["rollout_log_probs"]
        elif getattr(self.actor, "moe_shape", None) is not None:
            batch["old_log_probs"], batch["old_entropy"], routes = self.actor.compute_log_probs(batch,
                                                                                              record_routes=True)
            if self.cfg.actor_rollout_ref.actor.router_replay.mode == "R2":
                batch[OLD_ROUTES] = routes
            return self.routing_metrics(batch, routes)
        else:
            batch["old_log_probs"], batch["old_entropy"] = self.actor.compute_log_probs(batch)
        return {}

    def old_log_probs_but(self, batch: dict[str, Any], skip: torch.Tensor) -> None:
        """The old-log-prob pass over the rows not in `skip`, scattered into (B, R) grids with zeros at `skip`."""
        out = _pass_but(batch, skip, self.actor.compute_log_probs)
        if out is not None:  # else the update writes every row
            batch["old_log_probs"], ent = out
            if ent is not None:
                batch["old_entropy"] = ent

    def routing_metrics(self, batch: dict[str, Any], trainer_routes) -> dict[str, float]:
        """MoE routing, over the whole step (every DP rank's tokens, every pipeline stage's MoE layers):
        `actor/moe_routing_mismatch/{mean,max}` (over MoE layers, the fraction of the tokens the rollout routed --
        prompt and response but its last token -- whose top-k expert set in the old-log-prob pass differs from the
        rollout's; when the rollout recorded routes) and `actor/moe_expert_load/{mean,max}` (over MoE layers, the
        busiest expert's tokens over the mean per expert, in the routes the update takes: the rollout's under R3,
        else the old-log-prob pass's)."""
        from rlhf_mcore.models.routing_replay import expert_counts, fed_tokens, mismatch_counts, routing_summary

        shape, state = self.actor.moe_shape, self.state
        local = torch.zeros(len(shape.moe_layers), dtype=torch.bool)
        local[self.actor.local_moe_layers] = True  # this pipeline stage's MoE layers
        real = batch["attention_mask"].bool()  # (B, L)
        rollout = batch.get(ROLLOUT_ROUTES)
        used = rollout if self.cfg.actor_rollout_ref.actor.router_replay.mode == "R3" else trainer_routes
        counts = expert_counts(used, real, shape.num_experts) * local[:, None]  # (n, E)
        mismatch = None
        if rollout is not None:
            fed = fed_tokens(real)  # the rollout never fed a row's last token back: it has no routes
            mismatch = mismatch_counts(trainer_routes, rollout, fed) * local[:, None]  # (n, 2)
        both = torch.cat([counts, mismatch if mismatch is not None else counts.new_zeros(len(local), 2)], 1)
        for group in (state.dp_group, state.pp_group):
            both = group_all_reduce(both, group)
        e = shape.num_experts
        return routing_summary(both[:, e:] if mismatch is not None else None, both[:, :e], "actor/")

    def compute_advantages(self, batch: dict[str, Any]) -> dict[str, float]:
        """`advantages` and `returns` into the batch; returns PRIME's metrics or the KL-in-reward penalty's
        (veRL's names; this rank's, reduced with the step's metrics)."""
        if self.prime is not None:  # PRIME: the implicit PRM's update and its RLOO advantages
            return self.prime.compute_advantages(batch)
        alg, metrics = self.cfg.algorithm, {}
        batch["token_level_rewards"] = batch["token_level_scores"]
        if alg.use_kl_in_reward:
            coef = self.kl_ctrl.value  # this step's (an adaptive controller updates it below)
            batch["token_level_rewards"], kl_metrics = algos.apply_kl_penalty(
                batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"], batch["response_mask"],
                kl_coef=coef, kl_penalty_type=alg.kl_penalty)
            current = reduce_metrics({"kl": float(kl_metrics["reward_kl_penalty"])}, self.state.dp_group)["kl"]
            self.kl_ctrl.update(current, n_steps=self.cfg.data.train_batch_size)
            metrics = {"actor/reward_kl_penalty": float(kl_metrics["reward_kl_penalty"]),
                       "actor/reward_kl_penalty_coeff": coef}
        self.estimate_advantages(batch)
        return metrics

    def estimate_advantages(self, batch: dict[str, Any]) -> None:
        """`advantages` and `returns` into the batch from its `token_level_rewards` (and `values`)."""
        alg = self.cfg.algorithm
        batch["advantages"], batch["returns"] = self.estimator.fn(
            token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"].float(),
            values=batch.get("values"), index=batch["index"], gamma=alg.gamma, lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, reward_baselines=batch.get("reward_baselines"))

    def correct_rollout(self, batch: dict[str, Any]) -> dict[str, float]:
        """`algorithm.rollout_correction`: puts `rollout_is_weights` (B, R) and `loss_mask` (B, R; the response
        mask less rejected tokens) in the batch for the updates; returns the `rollout_corr/*` metrics.

        Advantages are computed before, on the whole response; rejection only removes tokens from the losses."""
        rc = self.cfg.algorithm.rollout_correction
        if not _corrects(rc):
            return {}

        corr = algos.compute_rollout_correction(  # the batch is split over DP ranks: its sums over all of them
            batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], **vars(rc),
            batch_sum=lambda t: group_all_reduce(t, self.state.dp_group))
        if corr.rollout_is_weights is not None:
            batch["rollout_is_weights"] = corr.rollout_is_weights
        batch["loss_mask"] = corr.response_mask
        return corr.metrics

    def update(self, batch: dict[str, Any], on_policy: bool = False, values_on_policy: bool = False
               ) -> dict[str, float]:
        """Critic, then actor; their losses see `loss_mask` (rollout rejection) as the response mask when set.
        `on_policy` (:meth:`old_from_update`): the actor's update puts the old log-probs and entropy into `batch`.
        `values_on_policy` (:meth:`values_from_update`): the critic's update puts its first mini-batch's values
        into `batch`, and the advantages are estimated again from them before the actor's update."""
        view = {**batch, "response_mask": batch["loss_mask"]} if "loss_mask" in batch else batch
        metrics = {}
        if self.critic is not None:
            metrics.update(self.critic.update_critic(view, on_policy=values_on_policy))
            if values_on_policy:
                batch["values"] = view["values"]
                with span("advantages"):
                    self.estimate_advantages(batch)
                view = {**batch, "response_mask": batch["loss_mask"]} if "loss_mask" in batch else batch
        if on_policy:  # no rollout correction, so no loss_mask: the update writes into the step's batch itself
            metrics.update(self.actor.update_policy(batch, on_policy=True))
        else:
            metrics.update(self.actor.update_policy(view))
        return metrics

    # ------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The learner's part of the trainer state (checkpoint key `kl_ctrl`)."""
        return {"kl_ctrl": self.kl_ctrl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])

    def save_engines(self, path: Path) -> None:
        self.actor.save_checkpoint(path / "actor")
        if self.critic is not None:
            self.critic.save_checkpoint(path / "critic")
        if self.prime is not None:  # PRIME's implicit PRM is trained online: its weights and optimizer too
            self.prime.engine.save_checkpoint(path / "prm")

    def load_engines(self, path: Path) -> None:
        self.actor.load_checkpoint(path / "actor")
        if self.critic is not None:
            self.critic.load_checkpoint(path / "critic")
        if self.prime is not None:
            self.prime.engine.load_checkpoint(path / "prm")

    def engines(self) -> tuple[Any, Optional[Any], Optional[Any]]:
        """The engines that move to the host around a colocated rollout (when their config asks)."""
        return self.actor, self.critic, self.ref


def _pass_but(batch: dict[str, Any], skip: torch.Tensor, forward) -> Optional[tuple[Optional[torch.Tensor], ...]]:
    """`forward` (a pass returning a tuple of (b, R) grids or Nones) over the rows of `batch` not in `skip`, its
    grids scattered into (B, R) ones with zeros at `skip`; None (no pass) when no other row is left."""
    B = batch["response_mask"].shape[0]
    rest = torch.ones(B, dtype=torch.bool)
    rest[skip.cpu()] = False
    if not rest.any():
        return None
    rows = rest.nonzero().squeeze(1).to(batch["input_ids"].device)
    outs = forward(select_rows(batch, rows))
    return tuple(None if g is None else g.new_zeros((B, *g.shape[1:])).index_copy(0, rows.to(g.device), g)
                 for g in outs)


def _corrects(rc) -> bool:
    """Whether `algorithm.rollout_correction` (`rc`) is on: IS weights, rejection or the token veto."""
    return rc.rollout_is is not None or rc.rollout_rs is not None or rc.rollout_token_veto_threshold is not None
