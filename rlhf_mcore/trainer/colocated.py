"""The colocated rollout side of the synchronous trainer (async_training.mode=off): the rollout engine on the
training ranks, woken for generation, given the actor's weights after each update; generation, scoring (the reward
pipeline), dynamic sampling and validation."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from rlhf_mcore.algos.dynamic_sampling import GroupPool
from rlhf_mcore.data.rows import Row
from rlhf_mcore.data.seeds import step_seed
from rlhf_mcore.parallel.collectives import broadcast_object
from rlhf_mcore.rewards import reward_metrics
from rlhf_mcore.rewards.pipeline import OverlongShaping, compose
from rlhf_mcore.trainer import roles
from rlhf_mcore.trainer.plan import plan_step
from rlhf_mcore.trainer.rollout_phase import ENGINE_METRIC_PREFIXES, generate_and_score
from rlhf_mcore.trainer.step_batch import rows_to_batch
from rlhf_mcore.trainer.validation import validate


class ColocatedRollout:
    def __init__(self, run, learner, engine, agents=None, reward_model=None):
        """`engine`: the rollout engine; `agents`: the multi-turn runner (None when off); `reward_model`: the
        learned scorer (a reward model or a judge; None when neither is enabled)."""
        self.run, self.learner = run, learner
        self.engine, self.agents, self.reward_model = engine, agents, reward_model
        self.shaping = OverlongShaping.from_config(run.cfg)
        self.told_rm_blocker = False  # why the reward model cannot stream: logged once

    def generate(self, plan: list[list[int]]) -> tuple[dict[str, Any], dict[str, float]]:
        """Every rollout replica generates its share of the whole step's prompts; this DP rank keeps its groups."""
        run, n = self.run, self.run.cfg.actor_rollout_ref.rollout.n
        with self.session() as wake_sync_metrics:
            if run.cfg.algorithm.filter_groups.enable:
                plan, rows, stats = self.sample_informative_groups(plan[0])  # plan: now split over DP ranks
            else:
                rows, stats = self.rollout_and_score([i for part in plan for i in part], gen_batch=0)
        prompt_ids = [i for part in plan for i in part]  # rank order
        per_rank = len(plan[0]) * n
        mine = rows[run.state.dp_rank * per_rank:(run.state.dp_rank + 1) * per_rank]  # this DP rank's groups
        stats.update(self.shaping.metrics(rows))  # the step's rows (every DP rank's: the same)
        batch = rows_to_batch(mine, prompt_ids, run.train_set, run.tokenizer.pad_token_id,
                              self.learner.estimator.needs_greedy_baseline)
        return batch, {**stats, **wake_sync_metrics}

    def rollout_and_score(self, prompt_ids: list[int], gen_batch: int) -> tuple[list[Row], dict[str, float]]:
        """Generate and score `prompt_ids` (all ranks together; every rank gets all rows): the reward pipeline
        (rlhf_mcore.rewards.pipeline), the reward model's or judge's score combined in and the overlong penalty
        added (`reward_extra`: `acc`, the reward function's score, `rm_score` and `overlong_penalty`)."""
        run, cfg = self.run, self.run.cfg
        items = [run.train_set[i] for i in prompt_ids]
        baseline = self.learner.estimator.needs_greedy_baseline
        params = roles.train_sampling_params(cfg, seed=step_seed(cfg.trainer.seed, run.step, gen_batch))
        rows, stats = generate_and_score(
            self.engine, run.scorer, [it["input_ids"] for it in items], items, params, run.tokenizer,
            rollout_tp=cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, group=run.state.cpu_group,
            greedy_baseline=baseline, agent_runner=self.agents, reward_model=self.streaming_reward_model())
        metrics = reward_metrics(stats)
        t0 = time.monotonic()  # the reward model scores what the stream left (all of it when it could not stream)
        metrics.update(compose(rows, items, self.shaping, learned=self.reward_model, baseline=baseline))
        if self.reward_model is not None and "timing_s/reward_tail" in metrics:  # scoring left after the last sample
            metrics["timing_s/reward_tail"] += time.monotonic() - t0
        passed_on = ("agent/", "reward_model/", *ENGINE_METRIC_PREFIXES)
        metrics.update({k: v for k, v in stats.items() if k.startswith(passed_on)})
        return rows, metrics

    def streaming_reward_model(self):
        """The reward model when it can score batches during generation (reward_model.StreamingBatches), else None;
        the reason it cannot is logged at the first step."""
        blocker = getattr(self.reward_model, "streaming_blocker", "a judge scores after generation")
        if self.reward_model is not None and blocker is not None and not self.told_rm_blocker:
            self.told_rm_blocker = True
            if self.run.logger is not None:
                self.run.logger.text(f"the reward model does not score while the rollout generates: {blocker}")
        return self.reward_model if blocker is None else None

    def sample_informative_groups(self, first_ids: list[int]) -> tuple[list[list[int]], list[Row], dict[str, float]]:
        """Dynamic sampling: generate data.gen_batch_size prompts at a time, keeping the groups whose
        filter_groups.metric is not the same for all their responses, until data.train_batch_size are kept (the
        first ones; every drawn prompt is consumed). Every rank holds all rows, so all agree on the groups; rank 0
        draws the prompts and splits the kept groups over DP ranks. Returns that plan, the rows in plan order
        (`prompt_pos` renumbered to it) and the metrics."""
        run = self.run
        d, fg = run.cfg.data, run.cfg.algorithm.filter_groups
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
            draw = run.draw(d.gen_batch_size or d.train_batch_size) if run.state.is_coordinator else None
            ids = broadcast_object(draw, group=run.state.cpu_group)
        kept = pool.take()  # DynamicSamplingError (every rank: the same pool) when max_num_gen_batches is hit
        lengths = [len(run.train_set[i]["input_ids"]) for i, _ in kept]
        parts = broadcast_object(plan_step(list(range(len(kept))), lengths, run.state.dims.dp)
                                 if run.state.is_coordinator else None, group=run.state.cpu_group)
        order = [pos for part in parts for pos in part]
        rows = [replace(r, prompt_pos=k) for k, pos in enumerate(order) for r in kept[pos][1]]
        return [[kept[pos][0] for pos in part] for part in parts], rows, {**stats, **pool.metrics()}

    def sync_weights(self) -> dict[str, float]:
        """Actor -> rollout after an update; at sleep level 2 nothing here (the next wake syncs)."""
        if roles.syncs_at_wake(self.run.cfg):
            return {}
        return roles.sync_weights(self.learner.actor, self.engine, self.run.state,
                                  self.run.cfg.actor_rollout_ref.rollout)

    def session(self):
        """The rollout awake, the training engines' opt-in offload around it; yields the wake's sync metrics."""
        r, run = self.run.cfg.actor_rollout_ref.rollout, self.run
        at_wake = (lambda: roles.sync_weights(self.learner.actor, self.engine, run.state, r)) \
            if roles.syncs_at_wake(run.cfg) else None
        return roles.colocated_rollout(self.engine, self.learner.engines(), free_cache=r.free_cache_engine,
                                       sync_at_wake=at_wake)

    def validate(self) -> dict[str, float]:
        run = self.run
        if run.val_set is None:
            return {}
        with self.session():
            metrics, samples = validate(
                self.engine, run.scorer, run.tokenizer, run.val_set, roles.val_sampling_params(run.cfg),
                rollout_tp=run.cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, group=run.state.cpu_group,
                batch_size=run.cfg.data.val_batch_size, agent_runner=self.agents)
        if run.state.is_coordinator:
            run.log_validation(metrics, samples[: run.cfg.trainer.log_val_generations])
        return metrics

    @property
    def logprobs_renormalised(self) -> bool:
        return getattr(self.engine, "logprobs_renormalised", True)
