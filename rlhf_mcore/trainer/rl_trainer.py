"""The PPO/GRPO loop, one method per step: plan, generate + score, forward passes, advantages, update, sync,
then metrics / validation / checkpoint.

Simplifications, on purpose: one synchronous step at a time (generation of step k+1 does not overlap training of
step k); all training models share one process layout; the rollout engine is rebuilt from the actor's weights at
start (and after a resume) rather than from its own checkpoint.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from rlhf_mcore import algos
from rlhf_mcore.algos.dynamic_sampling import GroupPool
from rlhf_mcore.config import RLConfig, critic_enabled, load_plugins, parallel_layout, reference_enabled, to_dict
from rlhf_mcore.parallel import collective_device, destroy_distributed, init_distributed
from rlhf_mcore.rewards import reward_metrics
from rlhf_mcore.rewards.pipeline import OverlongShaping, compose
from rlhf_mcore.trainer import roles
from rlhf_mcore.trainer.batch import build_batch, last_response_token
from rlhf_mcore.trainer.checkpoint import CheckpointManager
from rlhf_mcore.trainer.errors import RolloutMismatchError
from rlhf_mcore.trainer.logging import MetricLogger, reduce_metrics
from rlhf_mcore.trainer.plan import broadcast_object, plan_step
from rlhf_mcore.trainer.rollout_phase import Row, generate_and_score
from rlhf_mcore.trainer.run_lock import take_run_lock
from rlhf_mcore.trainer.stats import batch_metrics, peak_memory_gb, reset_peak_memory
from rlhf_mcore.trainer.validation import validate


class PhaseTimer:
    """Seconds per named phase of one step (`timing_s/<name>` in the metrics)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


class StepHooks:
    """Observers of the loop (benchmarks, profilers), called on every rank; they read, never steer. The default
    does nothing; pass a subclass as ``RLTrainer(cfg, hooks=...)``."""

    def step_start(self, trainer: "RLTrainer", step: int) -> None:
        pass

    def step_end(self, trainer: "RLTrainer", step: int, batch: dict[str, Any], metrics: dict[str, float],
                 timer: PhaseTimer) -> None:
        pass


class RLTrainer:
    def __init__(self, cfg: RLConfig, hooks: Optional[StepHooks] = None, pools=None):
        """pools: the asynchronous trainers' layout (`parallel.pools.init_pools`, already joined): this process
        is then a training-pool rank and holds no rollout engine. None: the colocated synchronous trainer."""
        self.cfg = cfg
        self.pools = pools
        self.hooks = hooks or StepHooks()
        load_plugins(cfg.trainer.plugins)
        self.out_dir = roles.run_dir(cfg)
        self.tokenizer, self.train_set, self.val_set = roles.build_data(cfg)  # bad inputs fail before any compute
        self.scorer = roles.build_scorer(cfg)  # a broken reward file too
        tp, pp, vpp = parallel_layout(cfg)
        if cfg.trainer.deterministic:  # warn_only: an op without a deterministic kernel warns instead of failing
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: set it first
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.state = init_distributed(tp, pp, vpp, device=cfg.trainer.device, seed=cfg.trainer.seed)
        self.run_lock = take_run_lock(self.out_dir, self.state)  # one live run per directory, before any model
        try:
            self.build_components(cfg, pools)
        except BaseException:  # e.g. a model that fails to load: the next run must not find this run's lock
            self.run_lock.release()
            raise

    def build_components(self, cfg: RLConfig, pools) -> None:
        """The models, the rollout and the bookkeeping, under the run lock (released by __init__ if this raises;
        a subclass that builds more extends this)."""
        self.sampler = roles.build_sampler(cfg, len(self.train_set))
        steps_per_epoch = len(self.train_set) // cfg.data.train_batch_size
        self.total_steps = cfg.trainer.total_training_steps or steps_per_epoch * cfg.trainer.total_epochs
        self.actor = roles.build_actor(cfg, self.state, self.total_steps)
        self.ref = roles.build_reference(cfg, self.state) if reference_enabled(cfg) else None
        self.critic = roles.build_critic(cfg, self.state, self.total_steps) if critic_enabled(cfg) else None
        self.reward_model = roles.build_reward_model(cfg, self.state, self.tokenizer)  # None unless enabled
        self.told_rm_blocker = False  # why the reward model cannot stream: logged once
        self.prime = roles.build_prime(cfg, self.state, self.total_steps)  # None unless reward_manager=prime
        self.prime_metrics: dict[str, float] = {}
        self.rollout = roles.build_rollout(cfg, self.state) if pools is None else None
        self.agents = (roles.build_agent_runner(cfg, self.rollout, self.tokenizer)  # multi-turn; None when off
                       if self.rollout is not None else None)
        self.kl_ctrl = algos.build_kl_controller(**vars(cfg.algorithm.kl_ctrl))
        self.estimator = algos.adv_estimator_info(cfg.algorithm.adv_estimator)  # the function and what it needs
        self.ckpt = CheckpointManager(self.out_dir / "checkpoints", cfg.trainer.max_actor_ckpt_to_keep,
                                      self.state.rank, group=self.state.cpu_group)
        self.step = 0
        self.logger: Optional[MetricLogger] = None

    # ------------------------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, float]:
        self.resume()
        self.open_logger()
        self.sync_weights()  # the rollout starts from the actor's weights (fresh or resumed)
        last = {}
        if self.cfg.trainer.val_before_train and self.step == 0:
            self.run_validation()
        while self.step < self.total_steps:
            self.step += 1
            self.hooks.step_start(self, self.step)
            t = PhaseTimer()
            with t("step"):
                with t("plan"):
                    plan = self.plan()                             # 1. coordinator: prompts per DP rank
                with t("gen"):
                    batch, gen_metrics = self.generate(plan)       # 2-3. rollout + reward (sleep level 2: + sync)
                train_metrics = self.train_on(batch, t)            # 4-6. log-probs, advantages, updates
                with t("sync"):
                    sync_metrics = self.sync_weights()             # 7. actor -> rollout (sleep level 2: at wake)
            last = self.finish_step(batch, {**gen_metrics, **train_metrics, **sync_metrics}, t)  # 8.
            self.hooks.step_end(self, self.step, batch, last, t)
        if self.cfg.trainer.export_hf_final:
            self.export_final()
        return last

    def open_logger(self) -> None:
        self.logger = MetricLogger(self.cfg.trainer.logger, self.out_dir, self.total_steps, to_dict(self.cfg),
                                   self.cfg.trainer.project_name, self.cfg.trainer.experiment_name,
                                   enabled=self.state.is_coordinator, start_step=self.step)

    # ------------------------------------------------------------------------------------------- the steps
    def plan(self) -> list[list[int]]:
        """Rank 0 draws the batch and splits it over DP ranks; every rank gets the dataset indices per DP rank.
        With dynamic sampling (algorithm.filter_groups) one unsplit part of data.gen_batch_size prompts: generate()
        splits the groups it keeps."""
        plan = None
        if self.state.is_coordinator:
            if self.cfg.algorithm.filter_groups.enable:
                plan = [self.sampler.next_batch(self.cfg.data.gen_batch_size or self.cfg.data.train_batch_size)]
            else:
                ids = self.sampler.next_batch(self.cfg.data.train_batch_size)
                plan = self.split_over_dp(ids)
        return broadcast_object(plan, group=self.state.cpu_group)

    def split_over_dp(self, ids: list[int]) -> list[list[int]]:
        return plan_step(ids, [len(self.train_set[i]["input_ids"]) for i in ids], self.state.dims.dp)

    def generate(self, plan: list[list[int]]) -> tuple[dict[str, Any], dict[str, float]]:
        """Every rollout replica generates its share of the whole step's prompts; this DP rank keeps its groups."""
        cfg, n = self.cfg, self.cfg.actor_rollout_ref.rollout.n
        with self.rollout_session() as wake_sync_metrics:
            if cfg.algorithm.filter_groups.enable:
                plan, rows, stats = self.sample_informative_groups(plan[0])  # plan: now split over DP ranks
            else:
                rows, stats = self.rollout_and_score([i for part in plan for i in part], gen_batch=0)
        prompt_ids = [i for part in plan for i in part]  # rank order
        per_rank = len(plan[0]) * n
        mine = rows[self.state.dp_rank * per_rank:(self.state.dp_rank + 1) * per_rank]  # this DP rank's groups
        stats.update(OverlongShaping.from_config(cfg).metrics(rows))  # the step's rows (every DP rank's: the same)
        return self.rows_to_batch(mine, prompt_ids), {**stats, **wake_sync_metrics}

    def rows_to_batch(self, rows: list[Row], prompt_ids: list[int]) -> dict[str, Any]:
        """This DP rank's rows as the padded batch; `prompt_ids[r.prompt_pos]` is row r's dataset index.
        The reward sits on the last model token (`token_level_scores`)."""
        items = [self.train_set[prompt_ids[r.prompt_pos]] for r in rows]
        meta = {key: [it[key] for it in items] for key in ("data_source", "ground_truth")}
        batch = build_batch([r.prompt_ids for r in rows], [r.response_ids for r in rows], [r.logprobs for r in rows],
                            [r.finish_reason for r in rows], [r.prompt_pos for r in rows], meta,
                            pad_token_id=self.tokenizer.pad_token_id,
                            response_masks=[r.response_mask for r in rows])
        last = last_response_token(batch["response_mask"])  # (B,) the reward sits on the last model token
        scores = torch.tensor([r.score for r in rows])
        batch["token_level_scores"] = torch.zeros_like(batch["rollout_log_probs"]).scatter(
            1, last[:, None], scores[:, None])  # (B, R)
        if self.estimator.needs_greedy_baseline:
            batch["reward_baselines"] = torch.tensor([r.baseline_score for r in rows])  # (B,)
        return batch

    def rollout_and_score(self, prompt_ids: list[int], gen_batch: int) -> tuple[list[Row], dict[str, float]]:
        """Generate and score `prompt_ids` (all ranks together; every rank gets all rows): the reward pipeline
        (rlhf_mcore.rewards.pipeline), the reward model's or judge's score combined in and the overlong penalty
        added (`reward_extra`: `acc`, the reward function's score, `rm_score` and `overlong_penalty`)."""
        cfg = self.cfg
        items = [self.train_set[i] for i in prompt_ids]
        params = roles.train_sampling_params(cfg, seed=cfg.trainer.seed * 100_003 + self.step + 1_000_003 * gen_batch)
        rows, stats = generate_and_score(
            self.rollout, self.scorer, [it["input_ids"] for it in items], items, params, self.tokenizer,
            rollout_tp=cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, group=self.state.cpu_group,
            greedy_baseline=self.estimator.needs_greedy_baseline, agent_runner=self.agents,
            reward_model=self.streaming_reward_model())
        metrics = reward_metrics(stats)
        t0 = time.monotonic()  # the reward model scores what the stream left (all of it when it could not stream)
        metrics.update(compose(rows, items, OverlongShaping.from_config(cfg), learned=self.reward_model,
                               baseline=self.estimator.needs_greedy_baseline))
        if self.reward_model is not None and "timing_s/reward_tail" in metrics:  # scoring left after the last sample
            metrics["timing_s/reward_tail"] += time.monotonic() - t0
        metrics.update({k: v for k, v in stats.items() if k.startswith(("agent/", "reward_model/"))})
        return rows, metrics

    def streaming_reward_model(self):
        """The reward model when it can score batches during generation (reward_model.StreamingBatches), else None;
        the reason it cannot is logged at the first step."""
        blocker = getattr(self.reward_model, "streaming_blocker", "a judge scores after generation")
        if self.reward_model is not None and blocker is not None and not self.told_rm_blocker:
            self.told_rm_blocker = True
            if self.logger is not None:
                self.logger.text(f"the reward model does not score while the rollout generates: {blocker}")
        return self.reward_model if blocker is None else None

    def sample_informative_groups(self, first_ids: list[int]) -> tuple[list[list[int]], list[Row], dict[str, float]]:
        """Dynamic sampling: generate data.gen_batch_size prompts at a time, keeping the groups whose
        filter_groups.metric is not the same for all their responses, until data.train_batch_size are kept (the
        first ones; every drawn prompt is consumed). Every rank holds all rows, so all agree on the groups; rank 0
        draws the prompts and splits the kept groups over DP ranks. Returns that plan, the rows in plan order
        (`prompt_pos` renumbered to it) and the metrics."""
        d, fg = self.cfg.data, self.cfg.algorithm.filter_groups
        pool = GroupPool(target=d.train_batch_size, max_num_gen_batches=fg.max_num_gen_batches)
        value = (lambda r: r.reward_extra["acc"]) if fg.metric in ("acc", "score") else (lambda r: r.score)
        ids, stats = first_ids, {}
        while True:
            rows, batch_stats = self.rollout_and_score(ids, gen_batch=pool.num_gen_batches)
            stats = {k: stats.get(k, 0.0) + v for k, v in batch_stats.items()}  # failure counts
            groups = [(i, []) for i in ids]  # (dataset index, its rows)
            for r in rows:
                groups[r.prompt_pos][1].append(r)
            pool.add(groups, [r.prompt_pos for r in rows], [value(r) for r in rows])
            if not pool.wants_more():
                break
            draw = self.sampler.next_batch(d.gen_batch_size or d.train_batch_size) if self.state.is_coordinator \
                else None
            ids = broadcast_object(draw, group=self.state.cpu_group)
        kept = pool.take()  # DynamicSamplingError (every rank: the same pool) when max_num_gen_batches is hit
        lengths = [len(self.train_set[i]["input_ids"]) for i, _ in kept]
        parts = broadcast_object(plan_step(list(range(len(kept))), lengths, self.state.dims.dp)
                                 if self.state.is_coordinator else None, group=self.state.cpu_group)
        order = [pos for part in parts for pos in part]
        rows = [replace(r, prompt_pos=k) for k, pos in enumerate(order) for r in kept[pos][1]]
        return [[kept[pos][0] for pos in part] for part in parts], rows, {**stats, **pool.metrics()}

    def train_on(self, batch: dict[str, Any], t: PhaseTimer) -> dict[str, float]:
        """A generated batch to an update: ref / old log-probs and values, advantages, rollout correction, the
        critic's and the actor's updates (every trainer's steps 4-6). Returns their metrics."""
        with t("old_log_prob"):
            self.forward_passes(batch)
        with t("adv"):
            self.compute_advantages(batch)
            corr_metrics = self.correct_rollout(batch)  # off-policy IS weights / rejection
        with t("update"):
            return {**corr_metrics, **self.update(batch)}

    def forward_passes(self, batch: dict[str, Any]) -> None:
        if self.cfg.actor_rollout_ref.actor.use_rollout_log_probs:  # the rollout's log-probs are the old policy
            batch["old_log_probs"] = batch["rollout_log_probs"]
        else:
            batch["old_log_probs"], batch["old_entropy"] = self.actor.compute_log_probs(batch)
        if self.ref is not None:
            batch["ref_log_prob"], _ = self.ref.compute_log_probs(batch)
        if self.critic is not None:
            batch["values"] = self.critic.compute_values(batch)

    def compute_advantages(self, batch: dict[str, Any]) -> None:
        if self.prime is not None:  # PRIME: the implicit PRM's update and its RLOO advantages
            self.prime_metrics = self.prime.compute_advantages(batch)
            return
        alg = self.cfg.algorithm
        batch["token_level_rewards"] = batch["token_level_scores"]
        if alg.use_kl_in_reward:
            coef = self.kl_ctrl.value  # this step's (an adaptive controller updates it below)
            batch["token_level_rewards"], kl_metrics = algos.apply_kl_penalty(
                batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"], batch["response_mask"],
                kl_coef=coef, kl_penalty_type=alg.kl_penalty)
            current = reduce_metrics({"kl": float(kl_metrics["reward_kl_penalty"])}, self.state.dp_group)["kl"]
            self.kl_ctrl.update(current, n_steps=self.cfg.data.train_batch_size)
            batch["kl_metrics"] = {  # veRL's names; this rank's, reduced with the step's metrics (finish_step)
                "actor/reward_kl_penalty": float(kl_metrics["reward_kl_penalty"]),
                "actor/reward_kl_penalty_coeff": coef}
        batch["advantages"], batch["returns"] = self.estimator.fn(
            token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"].float(),
            values=batch.get("values"), index=batch["index"], gamma=alg.gamma, lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, reward_baselines=batch.get("reward_baselines"))

    def correct_rollout(self, batch: dict[str, Any]) -> dict[str, float]:
        """`algorithm.rollout_correction`: puts `rollout_is_weights` (B, R) and `loss_mask` (B, R; the response
        mask less rejected tokens) in the batch for the updates; returns the `rollout_corr/*` metrics.

        Advantages are computed before, on the whole response; rejection only removes tokens from the losses."""
        rc = self.cfg.algorithm.rollout_correction
        if rc.rollout_is is None and rc.rollout_rs is None and rc.rollout_token_veto_threshold is None:
            return {}

        def dp_sum(t: torch.Tensor) -> torch.Tensor:  # the batch is split over DP ranks
            g = self.state.dp_group
            if g is None or not dist.is_initialized() or dist.get_world_size(g) == 1:
                return t
            out = t.to(collective_device(g))
            dist.all_reduce(out, group=g)
            return out.to(t.device)

        corr = algos.compute_rollout_correction(batch["old_log_probs"], batch["rollout_log_probs"],
                                                batch["response_mask"], **vars(rc), batch_sum=dp_sum)
        if corr.rollout_is_weights is not None:
            batch["rollout_is_weights"] = corr.rollout_is_weights
        batch["loss_mask"] = corr.response_mask
        return corr.metrics

    def update(self, batch: dict[str, Any]) -> dict[str, float]:
        """Critic, then actor; their losses see `loss_mask` (rollout rejection) as the response mask when set."""
        if "loss_mask" in batch:
            batch = {**batch, "response_mask": batch["loss_mask"]}
        metrics = {}
        if self.critic is not None:
            metrics.update(self.critic.update_critic(batch))
        metrics.update(self.actor.update_policy(batch))
        return {**metrics, **self.prime_metrics}

    def sync_weights(self) -> dict[str, float]:
        """Actor -> rollout after an update; at sleep level 2 nothing here (the next wake syncs)."""
        if roles.syncs_at_wake(self.cfg):
            return {}
        return roles.sync_weights(self.actor, self.rollout, self.state, self.cfg.actor_rollout_ref.rollout)

    def rollout_session(self):
        """The rollout awake, the training engines' opt-in offload around it; yields the wake's sync metrics."""
        r = self.cfg.actor_rollout_ref.rollout
        at_wake = (lambda: roles.sync_weights(self.actor, self.rollout, self.state, r)) \
            if roles.syncs_at_wake(self.cfg) else None
        return roles.colocated_rollout(self.rollout, (self.actor, self.critic, self.ref),
                                       free_cache=r.free_cache_engine, sync_at_wake=at_wake)

    def finish_step(self, batch, step_metrics: dict[str, float], timer: PhaseTimer) -> dict[str, float]:
        local = {**batch_metrics(batch), **batch.get("kl_metrics", {}), **step_metrics,
                 **{f"timing_s/{k}": v for k, v in timer.seconds.items()},
                 "perf/max_memory_allocated_gb/max": peak_memory_gb(),  # this step's (reset below)
                 "actor/kl_coef": float(self.kl_ctrl.value)}
        reset_peak_memory()
        tokens = float(batch["attention_mask"].sum())
        local["perf/throughput"] = tokens / max(timer.seconds["step"], 1e-9)
        metrics = reduce_metrics(local, group=None)
        metrics["perf/throughput"] *= self.state.dims.dp  # tokens/s of the whole job
        self.logger.log(self.step, metrics)
        self.check_rollout_gap(metrics)
        for role in ("actor", "critic"):
            if metrics.get(f"{role}/update_skipped", 0.0) > 0:
                self.logger.text(f"step {self.step}: {role} skipped an optimizer step (non-finite loss); "
                                 f"its weights are unchanged by it")
        cfg = self.cfg.trainer
        last_step = self.step == self.total_steps
        if cfg.test_freq > 0 and (self.step % cfg.test_freq == 0 or last_step):
            metrics.update(self.run_validation())
        if cfg.save_freq > 0 and (self.step % cfg.save_freq == 0 or last_step):
            self.save_checkpoint()
        return metrics

    def check_rollout_gap(self, metrics: dict[str, float]) -> None:
        """`trainer.max_rollout_logprob_gap` on the reduced `rollout/k3_kl` (the same on every rank, so every
        rank stops together)."""
        t, r = self.cfg.trainer, self.cfg.actor_rollout_ref.rollout
        gap = metrics.get("rollout/k3_kl")
        truncated = (r.top_k > 0 or r.top_p < 1) and getattr(self.rollout, "logprobs_renormalised", True)
        if t.max_rollout_logprob_gap is None or gap is None or truncated or gap <= t.max_rollout_logprob_gap:
            return
        msg = (f"step {self.step}: the rollout's log-probs are {gap:.3g} (mean k3 KL; worst token "
               f"{metrics.get('rollout/k3_kl/max', float('nan')):.3g}, mean |diff| "
               f"{metrics.get('rollout/logprob_diff_abs', float('nan')):.3g}) from the actor's on the same weights, "
               f"over trainer.max_rollout_logprob_gap={t.max_rollout_logprob_gap}: the rollout engine and the trainer "
               f"disagree about the policy (weight sync, dtype or kernel). Raise the limit or set "
               f"trainer.rollout_logprob_gap_action=warn to continue.")
        if t.rollout_logprob_gap_action == "error":
            raise RolloutMismatchError(msg)
        self.logger.text("warning: " + msg)

    # ------------------------------------------------------------------------------------------- around
    def run_validation(self) -> dict[str, float]:
        if self.val_set is None:
            return {}
        with self.rollout_session():
            metrics, samples = validate(
                self.rollout, self.scorer, self.tokenizer, self.val_set, roles.val_sampling_params(self.cfg),
                rollout_tp=self.cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, group=self.state.cpu_group,
                batch_size=self.cfg.data.val_batch_size, agent_runner=self.agents)
        if self.state.is_coordinator:
            self.logger.log(self.step, metrics, kind="val")
            for s in samples[: self.cfg.trainer.log_val_generations]:
                self.logger.text(f"[val sample] score={s['score']:.1f} | {s['prompt'][-120:]!r} -> "
                                 f"{s['response'][:200]!r}")
        return metrics

    def trainer_state(self) -> dict[str, Any]:
        return {"step": self.step, "sampler": self.sampler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict()}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])

    def save_checkpoint(self) -> Path:
        def save_engines(path: Path) -> None:
            self.actor.save_checkpoint(path / "actor")
            if self.critic is not None:
                self.critic.save_checkpoint(path / "critic")
            if self.prime is not None:  # PRIME's implicit PRM is trained online: its weights and optimizer too
                self.prime.engine.save_checkpoint(path / "prm")

        return self.ckpt.save(self.step, self.trainer_state(), save_engines, config=to_dict(self.cfg))

    def resume(self) -> None:
        path = self.ckpt.resume_point(self.cfg.trainer.resume_mode, to_dict(self.cfg),
                                      self.cfg.trainer.resume_ignore_config_changes)  # verified, config checked
        if path is None:
            return
        self.actor.load_checkpoint(path / "actor")
        if self.critic is not None:
            self.critic.load_checkpoint(path / "critic")
        if self.prime is not None:
            self.prime.engine.load_checkpoint(path / "prm")
        self.load_trainer_state(self.ckpt.load_trainer_state(path))
        if self.state.is_coordinator:
            print(f"resumed from {path} at step {self.step}", flush=True)

    def export_final(self) -> None:
        out = self.out_dir / "hf_final"
        self.actor.save_hf(out)
        if self.state.is_coordinator:
            self.logger.text(f"final actor (Hugging Face format): {out}")

    def close(self) -> None:
        try:
            if self.logger is not None:
                self.logger.close()
            self.scorer.close()
            if dist.is_initialized():
                dist.barrier(group=self.state.cpu_group)
            destroy_distributed()
        finally:  # a failed barrier (another rank died) too
            self.run_lock.release()


def train(cfg: RLConfig) -> dict[str, float]:
    if cfg.async_training.mode != "off":  # a training pool and a rollout pool
        from rlhf_mcore.trainer.async_trainers import train_async

        return train_async(cfg)
    trainer = RLTrainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()


__all__ = ["RLTrainer", "StepHooks", "PhaseTimer", "RolloutMismatchError", "train"]
