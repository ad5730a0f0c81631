"""One loop per mode, each built from the same parts: the run context (:mod:`rlhf_mcore.trainer.run`), the learner
(:mod:`rlhf_mcore.trainer.learner`) and a rollout side -- colocated for `off`
(:mod:`rlhf_mcore.trainer.colocated`), the rollout pool for `one_step_off` and `fully_async`
(:mod:`rlhf_mcore.trainer.training_pool`, :mod:`rlhf_mcore.trainer.schedules`). :func:`train` picks the loop.

A step, in every mode: take a batch (generate it, or pull it from the data bus), `learner.train_on(batch)`, sync
the weights when due, `run.finish_step` (metrics, validation, checkpoint).
"""
from __future__ import annotations

from typing import Callable, Optional

from rlhf_mcore.config import RLConfig, critic_enabled, reference_enabled
from rlhf_mcore.trace import close_trace
from rlhf_mcore.trainer import roles
from rlhf_mcore.trainer.colocated import ColocatedRollout
from rlhf_mcore.trainer.hooks import PhaseTimer, StepHooks, StepParts
from rlhf_mcore.trainer.learner import Learner
from rlhf_mcore.trainer.run import RunContext
from rlhf_mcore.trainer.schedules import FullyAsync, OneStepOff
from rlhf_mcore.trainer.training_pool import TrainingPool, dp_rank_table


def build_learner(run: RunContext, colocated: bool):
    """The models, in the order that fixes their initial weights: actor, reference, critic, reward model / judge,
    PRIME's PRM, then (colocated) the rollout engine and the agent runner. Returns (learner, learned scorer,
    rollout engine, agent runner)."""
    cfg, state = run.cfg, run.state
    actor = roles.build_actor(cfg, state, run.total_steps)
    ref = roles.build_reference(cfg, state, actor) if reference_enabled(cfg) else None  # LoRA: the actor's base
    critic = roles.build_critic(cfg, state, run.total_steps) if critic_enabled(cfg) else None
    reward_model = roles.build_reward_model(cfg, state, run.tokenizer)  # None unless enabled
    prime = roles.build_prime(cfg, state, run.total_steps)  # None unless reward_manager=prime
    engine = roles.build_rollout(cfg, state) if colocated else None
    agents = roles.build_agent_runner(cfg, engine, run.tokenizer) if colocated else None  # multi-turn; None when off
    return Learner(cfg, state, actor, critic=critic, ref=ref, prime=prime), reward_model, engine, agents


def step_parts(run: RunContext, learner: Learner, reward_model, engine=None) -> StepParts:
    return StepParts(state=run.state, actor=learner.actor, critic=learner.critic, ref=learner.ref,
                     prime=learner.prime, reward_model=reward_model, rollout=engine, scorer=run.scorer,
                     train_set=run.train_set, logger=run.logger)


def export_final(run: RunContext, learner: Learner) -> None:
    if not run.cfg.trainer.export_hf_final:
        return
    out = run.out_dir / "hf_final"
    learner.actor.save_hf(out)  # with LoRA: the base with the adapters merged
    if getattr(learner.actor, "lora", None) is not None:  # and the adapters alone, as a PEFT directory
        from rlhf_mcore.models.lora import save_peft_adapter

        save_peft_adapter(learner.actor.chunks, run.state, run.out_dir / "lora_adapter", learner.actor.lora,
                          learner.actor.hf_dir)
    if run.state.is_coordinator:
        run.logger.text(f"final actor (Hugging Face format): {out}")


# ------------------------------------------------------------------------------------------- the loops
def run_off(run: RunContext, learner: Learner, rollout: ColocatedRollout,
            parts: Optional[StepParts] = None) -> dict[str, float]:
    """The synchronous loop: generate step k with the weights after step k-1, train on it, sync."""
    run.resume(learner)
    run.open_logger()
    parts = parts or step_parts(run, learner, rollout.reward_model, rollout.engine)
    parts.logger = run.logger
    rollout.sync_weights()  # the rollout starts from the actor's weights (fresh or resumed)
    save = lambda: run.save_checkpoint(learner)  # noqa: E731
    last = {}
    if run.cfg.trainer.val_before_train and run.step == 0:
        rollout.validate()
    while run.step < run.total_steps:
        run.step += 1
        run.hooks.step_start(parts, run.step)
        t = PhaseTimer(run.step)
        with t("step"):
            with t("plan"):
                plan = run.plan()                                  # 1. coordinator: prompts per DP rank
            with t("gen"):
                batch, gen_metrics = rollout.generate(plan)        # 2-3. rollout + reward (sleep level 2: + sync)
            train_metrics = learner.train_on(batch, t)             # 4-6. log-probs, advantages, updates
            with t("sync"):
                sync_metrics = rollout.sync_weights()              # 7. actor -> rollout (sleep level 2: at wake)
        last = run.finish_step(batch, {**gen_metrics, **train_metrics, **sync_metrics}, t,  # 8.
                               kl_coef=learner.kl_ctrl.value, validate=rollout.validate, save=save,
                               renormalised=rollout.logprobs_renormalised)
        run.hooks.step_end(parts, run.step, batch, last, t)
    export_final(run, learner)
    return last


def run_one_step_off(run: RunContext, learner: Learner, pool: TrainingPool) -> dict[str, float]:
    """Step k trains on samples of the weights after step k-2, generated by the rollout pool while step k-1
    trained; the weights go to the rollout pool after every step that a later generation needs."""
    sched = OneStepOff(run, pool)
    parts, save = open_pool_run(run, learner, pool, sched)
    for k in (run.step + 1, run.step + 2):
        if k <= run.total_steps:
            sched.post_generate(k)
    last = {}
    while run.step < run.total_steps:
        run.step += 1
        run.hooks.step_start(parts, run.step)
        t = PhaseTimer(run.step)
        with t("step"):
            with t("wait"):
                groups, prompts, info = sched.receive_step()     # step k's groups, pulled from the bus
            batch, rows = pool.to_batch(groups, prompts, info, t)  # reward-model scores composed in
            parts.rows = [(prompts[r.prompt_pos], r) for r in rows]
            train_metrics = learner.train_on(batch, t)
            with t("sync"):
                sync_metrics = pool.push_weights(learner.actor, run.step) if sched.weights_due() else {}
        last = finish_pool_step(run, learner, pool, batch, info, prompts, {**train_metrics, **sync_metrics}, t, save)
        if sched.weights_due():  # after step k's validation and checkpoint
            sched.post_generate(run.step + 2)
        run.hooks.step_end(parts, run.step, batch, last, t)
    pool.stop()
    export_final(run, learner)
    return last


def run_fully_async(run: RunContext, learner: Learner, pool: TrainingPool) -> dict[str, float]:
    """The rollout pool streams groups; each step trains on the oldest fresh-enough ones; the weights go to the
    rollout pool every trigger_parameter_sync_step steps."""
    sched = FullyAsync(run, pool)  # it grants more prompts after each message the pool takes
    parts, save = open_pool_run(run, learner, pool, sched)
    if run.state.is_coordinator:
        sched.grant()
    last = {}
    while run.step < run.total_steps:
        run.step += 1
        run.hooks.step_start(parts, run.step)
        t = PhaseTimer(run.step)
        with t("step"):
            with t("wait"):
                groups, prompts, info = sched.next_batch()       # the oldest fresh-enough groups on the bus
            batch, rows = pool.to_batch(groups, prompts, info, t)
            parts.rows, parts.version = [(prompts[r.prompt_pos], r) for r in rows], sched.version
            train_metrics = learner.train_on(batch, t)
            sched.version = run.step
            with t("sync"):
                sync_metrics = pool.push_weights(learner.actor, run.step) if sched.weights_due() else {}
        last = finish_pool_step(run, learner, pool, batch, info, prompts, {**train_metrics, **sync_metrics}, t, save)
        run.hooks.step_end(parts, run.step, batch, last, t)
    pool.stop()
    export_final(run, learner)
    return last


def open_pool_run(run: RunContext, learner: Learner, pool: TrainingPool, sched) -> tuple[StepParts, Callable]:
    """An asynchronous run's start on the training pool: resume (the pool's state, then the schedule's: it reads
    the pool's ledger), the logger, the weights to the rollout pool, the validation before training. Returns the
    hooks' parts and the checkpoint saver."""
    state = run.resume(learner)
    if state is not None:
        pool.load_state_dict(state)
        sched.load_state_dict(state)
    run.open_logger()
    parts = step_parts(run, learner, pool.reward_model)
    pool.push_weights(learner.actor, run.step)
    if run.cfg.trainer.val_before_train and run.step == 0:
        pool.validate(learner.actor)
    return parts, lambda: run.save_checkpoint(learner, {**pool.state_dict(), **sched.state_dict()})


def finish_pool_step(run, learner, pool, batch, info, prompts, metrics, t, save) -> dict[str, float]:
    """An asynchronous step's end: the step info's and the same-version gap's metrics, the trainer's idle share,
    then `run.finish_step` with validation on the rollout pool."""
    step_metrics = {**pool.step_metrics(batch, info, prompts), **metrics,
                    "trainer/idle_ratio": t.seconds["wait"] / max(t.seconds["step"], 1e-9)}
    return run.finish_step(batch, step_metrics, t, kl_coef=learner.kl_ctrl.value,
                           validate=lambda: pool.validate(learner.actor), save=save,
                           gap_prefix="rollout/same_version/")


# ------------------------------------------------------------------------------------------- entry points
def train(cfg: RLConfig, hooks: Optional[StepHooks] = None) -> dict[str, float]:
    """Every rank: run PPO/GRPO as `async_training.mode` says; returns the last step's reduced metrics (the
    rollout pool's ranks: {})."""
    if cfg.vla.enable:  # the VLA trainer: its own loop on envs (rlhf_mcore/trainer/vla.py)
        from rlhf_mcore.trainer.vla import run_vla

        return run_vla(cfg)
    if cfg.async_training.mode != "off":
        return train_async(cfg, hooks)
    run = RunContext.open(cfg, hooks)
    with run.building():
        learner, reward_model, engine, agents = build_learner(run, colocated=True)
    try:
        return run_off(run, learner, ColocatedRollout(run, learner, engine, agents, reward_model))
    finally:
        run.close()


def train_async(cfg: RLConfig, hooks: Optional[StepHooks] = None) -> dict[str, float]:
    """Every rank of an asynchronous run: join its pool, then train (training pool) or generate (rollout pool)."""
    import os

    import torch.distributed as dist

    from rlhf_mcore.config import pool_sizes
    from rlhf_mcore.parallel import pick_device
    from rlhf_mcore.parallel.pools import PoolLayout, init_pools
    from rlhf_mcore.trainer.rollout_worker import RolloutWorker

    train_size, rollout_size = pool_sizes(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    layout = PoolLayout(train_size, rollout_size, cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)
    pools = init_pools(layout, pick_device(cfg.trainer.device))
    if pools.is_rollout:
        worker = RolloutWorker(cfg, pools)
        try:
            worker.run()
        finally:
            dist.destroy_process_group()
            close_trace()
        return {}
    run = RunContext.open(cfg, hooks)
    with run.building():
        learner, reward_model, _, _ = build_learner(run, colocated=False)
        pool = TrainingPool(run, pools, dp_rank_table(run.state), reward_model)
    try:
        loop = {"one_step_off": run_one_step_off, "fully_async": run_fully_async}[cfg.async_training.mode]
        return loop(run, learner, pool)
    finally:
        run.close()
