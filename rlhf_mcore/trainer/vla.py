"""The VLA trainer: GRPO or PPO with a value head on task success against a vectorized simulated env
(`vla.enable=true`).

    torchrun launch/train.py --config configs/vla_reachpush_cpu.yaml        # GRPO
    torchrun launch/train.py --config configs/vla_reachpush_ppo_cpu.yaml    # PPO (algorithm.adv_estimator=gae)

One step (:func:`train_step`): draw `num_envs / rollout.n` training initial states from `(seed, step)`, run each
`rollout.n` times (one GRPO group per state) with the policy sampling its action chunks at `rollout.temperature`
(:class:`~rlhf_mcore.trainer.vla_policy.VLAPolicy`, the engine's own chunks decoding: colocated), flatten the
episodes into one row per (episode, chunk step) up to the first done (:mod:`rlhf_mcore.vla.rows`), score each
episode by its success, normalise the scores within groups (`compute_grpo`) and broadcast each episode's advantage
to its rows' action tokens, optionally keep only the groups whose success rate lies in
`[vla.filter_low, vla.filter_high]` (DAPO's group filter, as SimpleVLA-RL uses it), then the engine's PPO-clip
update (the actor loss of :mod:`rlhf_mcore.engine.losses`, softmax over the action ids only: `token_range`). The
old policy's log-probs are the engine's forward pass over the rows (`train/rollout_logprob_gap`: their mean
distance from the rollout's own, which come from the same chunks and weights: numerics only;
tests/test_vla_trainer.py checks that the engine scores the same rows to the same log-probs).

PPO (`algorithm.adv_estimator=gae`): a critic (:func:`build_critic`: the same LLaVA with a width-1 value head in
place of the LM head, from `critic.model.path`, default the actor's) values every row; each row's value at the
position predicting its first action token is the value of its observation, and chunk-level GAE over each episode's
rows (:func:`rlhf_mcore.vla.gae.chunk_gae`: gamma, lam; the episode's reward on its last row) gives each row an
advantage (on all its action tokens, whitened over the batch's rows) and a return (the value target on all its
action tokens); then the critic's clipped value update (its old values: the per-token values of that pass), then the
actor's, as the text trainer orders them. Episodes are not grouped (`rollout.n` > 1 only adds episodes; the group
filter is refused).

Before step 0, `vla.bc_steps` behaviour-cloning steps on the scripted expert's demonstrations (`vla.demo_episodes`
episodes, which also give the action statistics q01/q99): the engine's update with the negative log-likelihood of
the expert's action tokens as the objective (:func:`bc_loss`). Validation (greedy, `vla.held_out_states` held-out
scenes) reports `val/success`; checkpoints hold the engines (`actor/`, and `critic/` with PPO: model, optimizer,
scheduler) and the step; every random draw is keyed on `(trainer.seed, step)`, so a resumed run continues as the
uninterrupted one would (tested for both estimators). Behaviour cloning trains the actor only.

Data parallelism: each DP rank runs its share of the groups (and of the held-out states); metrics are all-reduced.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from rlhf_mcore.algos import agg_loss
from rlhf_mcore.algos.advantages import compute_grpo
from rlhf_mcore.engine import TrainEngine
from rlhf_mcore.engine.config import EngineConfig
from rlhf_mcore.engine.losses import score_tokens
from rlhf_mcore.trainer.vla_policy import VLAPolicy, all_instructions
from rlhf_mcore.vla.actions import ActionStats
from rlhf_mcore.vla.envs.reach_push import HELD_OUT_OFFSET, ReachPush, collect_demos, held_out_state_ids
from rlhf_mcore.vla.gae import chunk_gae
from rlhf_mcore.vla.rollout import rollout
from rlhf_mcore.vla.rows import flatten_rollout, repeat_for_groups

__all__ = ["run_vla", "VLARun", "bc_loss", "group_filter", "build_critic"]


# ------------------------------------------------------------------ the engine's objectives


def bc_loss(output, mb, ctx):
    """Behaviour cloning: the token-mean negative log-likelihood of the batch's responses (the expert's actions)."""
    mask = mb.data["response_mask"]
    logp, _ = score_tokens(output, mb.inputs, ctx.cfg, ctx.tp_group, ctx.vocab_size, compute_entropy=False)
    loss = agg_loss(-logp, mask, "token-mean", global_tokens=ctx.global_tokens, global_seqs=ctx.global_seqs)
    n = mask.sum().float()
    return loss * ctx.scale, {"bc_loss": loss.detach().float(), "loss": loss.detach().float(), "n_tokens": n}


class VLAEngine(TrainEngine):
    """The actor engine with a second objective: `objective = "bc"` trains on :func:`bc_loss`, else PPO."""

    objective = "ppo"

    def loss_inputs(self, batch):
        if self.objective == "bc":
            return ("response_mask",), bc_loss
        return super().loss_inputs(batch)


def build_engine(cfg, state, path: str, token_range: tuple[int, int], total_steps: int) -> VLAEngine:
    from rlhf_mcore.models import build_model

    arr = cfg.actor_rollout_ref
    a = arr.actor
    ecfg = EngineConfig(role="actor", mini_batch_size=None, use_dynamic_bsz=True,
                        max_token_len=a.ppo_max_token_len_per_gpu,
                        ppo_epochs=a.ppo_epochs, seed=a.megatron.seed, grad_clip=a.grad_clip,
                        use_remove_padding=arr.model.use_remove_padding, policy_loss=a.policy_loss,
                        loss_agg_mode=a.loss_agg_mode, clip_ratio=a.clip_ratio, clip_ratio_low=a.clip_ratio_low,
                        clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c, entropy_coeff=a.entropy_coeff,
                        temperature=arr.rollout.temperature, token_range=token_range, cuda_graphs=False)
    chunks = build_model(path, state, role="actor", freeze_vision=cfg.vla.freeze_vision)
    optim = dataclasses.replace(a.optim, total_training_steps=total_steps + cfg.vla.bc_steps)
    return VLAEngine(chunks, state, ecfg, optim, use_distributed_optimizer=a.megatron.use_distributed_optimizer,
                     hf_dir=path)


def build_critic(cfg, state, total_steps: int) -> TrainEngine:
    """PPO's critic: the LLaVA of `critic.model.path` (default: the actor's) with the width-1 value head in place of
    the LM head (the head starts at its small deterministic initialisation), `vla.freeze_vision` as the actor's,
    rows micro-batched by `critic.ppo_max_token_len_per_gpu`, one mini-batch per epoch (`critic.ppo_epochs`, default
    the actor's), the clipped value loss (`critic.cliprange_value`, `.loss_agg_mode`), `critic.optim`."""
    from rlhf_mcore.models import ModelShape, build_model

    c, a, actor_path = cfg.critic, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model.path
    path = c.model.path or actor_path
    mine, theirs = ModelShape.from_hf_dir(path), ModelShape.from_hf_dir(actor_path)
    if mine.vision is None or (mine.vocab_size, mine.vision) != (theirs.vocab_size, theirs.vision):
        raise ValueError(f"critic.model.path={path!r} must be a LLaVA model with the actor's vocabulary and vision "
                         f"config (it reads the actor's prompts: image tokens and instruction ids); it is "
                         f"{mine.architecture}: leave critic.model.path unset (the actor's model) or point it at one")
    ecfg = EngineConfig(role="critic", mini_batch_size=None, use_dynamic_bsz=True,
                        max_token_len=c.ppo_max_token_len_per_gpu, ppo_epochs=c.ppo_epochs or a.ppo_epochs,
                        seed=c.megatron.seed, grad_clip=c.grad_clip, use_remove_padding=c.model.use_remove_padding,
                        loss_agg_mode=c.loss_agg_mode, cliprange_value=c.cliprange_value, cuda_graphs=False)
    chunks = build_model(path, state, role="critic", freeze_vision=cfg.vla.freeze_vision)
    optim = dataclasses.replace(c.optim, total_training_steps=total_steps)
    return TrainEngine(chunks, state, ecfg, optim, use_distributed_optimizer=c.megatron.use_distributed_optimizer,
                       hf_dir=path)


# ------------------------------------------------------------------ the pieces of a step


def group_filter(success: np.ndarray, group: np.ndarray, low: float, high: float) -> np.ndarray:
    """(B,) bool: episodes whose group's success rate lies in [low, high] (DAPO's filter)."""
    rate = {g: success[group == g].mean() for g in np.unique(group)}
    return np.array([low <= rate[g] <= high for g in group], bool)


def episode_advantages(success: np.ndarray, group: np.ndarray, norm_by_std: bool) -> np.ndarray:
    """(B,) GRPO advantages of the episodes: success normalised within each group (`compute_grpo`)."""
    score = torch.as_tensor(success, dtype=torch.float32)[:, None]
    adv, _ = compute_grpo(token_level_rewards=score, response_mask=torch.ones_like(score), index=list(group),
                          norm_adv_by_std_in_grpo=norm_by_std)
    return adv[:, 0].numpy()


def reset_adam_moments(optimizer) -> int:
    """Forget the Adam(W) state (step, moments) of every torch optimizer inside a Megatron one: the next step
    starts as the first one did (torch's Adam initialises an empty state lazily). Returns the parameters reset."""
    from rlhf_mcore.engine.offload import torch_optimizers

    n = 0
    for opt in torch_optimizers(optimizer):
        n += len(opt.state)
        opt.state.clear()
    return n


def _keyed_generator(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(np.random.SeedSequence(list(key)).generate_state(1)[0]))


class VLARun:
    """The parts a VLA run holds: the parallel state, envs, policy (with its engine), checkpoints, logger."""

    def __init__(self, cfg, state, out_dir: Path):
        from transformers import AutoTokenizer

        self.cfg, self.state, self.out_dir = cfg, state, out_dir
        v, t = cfg.vla, cfg.trainer
        self.n = cfg.actor_rollout_ref.rollout.n
        self.total_steps = t.total_training_steps  # required for a VLA run (config/vla.py)
        dp, rank = state.dims.dp, state.dp_rank
        if (v.num_envs // self.n) % dp or v.held_out_states % dp:
            raise ValueError(f"vla.num_envs / rollout.n = {v.num_envs // self.n} states and vla.held_out_states="
                             f"{v.held_out_states} must split evenly over the {dp} data-parallel ranks")
        self.local_envs = v.num_envs // dp
        self.env_kwargs = dict(seed=t.seed, image_size=v.image_size, max_steps=v.max_steps, tasks=tuple(v.tasks),
                               colors=tuple(v.colors))
        path = cfg.actor_rollout_ref.model.path
        tokenizer = AutoTokenizer.from_pretrained(path)
        stats = self._action_stats()
        probe = ReachPush(1, **self.env_kwargs)
        vocab = _model_vocab(path)
        from rlhf_mcore.trainer.vla_policy import action_range

        token_range = action_range(tokenizer, vocab, v.num_bins)
        engine = build_engine(cfg, state, path, token_range, self.total_steps)
        self.critic = build_critic(cfg, state, self.total_steps) if cfg.algorithm.adv_estimator == "gae" else None
        self.policy = VLAPolicy(engine, tokenizer, chunk=v.chunk, action_dim=probe.spec.action_dim,
                                num_bins=v.num_bins, stats=stats, instructions=all_instructions(v.tasks, v.colors))
        self.stages = self._envs()
        local_val = v.held_out_states // dp
        self.val_env = ReachPush(local_val, **self.env_kwargs)
        self.val_ids = held_out_state_ids(v.held_out_states)[rank * local_val:(rank + 1) * local_val]

    @property
    def engine(self) -> VLAEngine:
        return self.policy.engine

    def _action_stats(self) -> ActionStats:
        v = self.cfg.vla
        env = ReachPush(v.demo_episodes, **self.env_kwargs)
        self.demos = collect_demos(env, self._demo_ids(), v.chunk, wrong_target=v.demo_wrong_target,
                                   stop_short=v.demo_stop_short)
        return ActionStats.from_actions(self.demos["actions"])

    def _demo_ids(self) -> np.ndarray:
        """Demonstration scenes: their own part of the training range (the top of it), never held out."""
        return np.arange(HELD_OUT_OFFSET - self.cfg.vla.demo_episodes, HELD_OUT_OFFSET, dtype=np.int64)

    def _envs(self) -> list:
        from functools import partial

        from rlhf_mcore.vla.envs.subproc import SubprocVectorEnv

        v, b = self.cfg.vla, self.local_envs
        if v.num_workers == 0:
            return [ReachPush(b, **self.env_kwargs)]
        fn = partial(ReachPush, **self.env_kwargs)
        if v.overlap:
            half = b // 2
            return [SubprocVectorEnv(fn, half, max(1, v.num_workers // 2)),
                    SubprocVectorEnv(fn, b - half, max(1, v.num_workers - v.num_workers // 2))]
        return [SubprocVectorEnv(fn, b, v.num_workers)]

    def close(self) -> None:
        for env in self.stages:
            env.close()

    # -------------------------------------------------------------- rollouts

    def _policy_fn(self, generator, temperature: float):
        return lambda obs, rows, t: self.policy.act(obs, generator, temperature)

    def train_states(self, step: int) -> np.ndarray:
        """This DP rank's initial states of `step`: drawn from (seed, step) over the training range."""
        per_step = self.cfg.vla.num_envs // self.n
        rng = np.random.default_rng([self.cfg.trainer.seed, step])
        ids = rng.integers(0, HELD_OUT_OFFSET - self.cfg.vla.demo_episodes, size=per_step)
        local = per_step // self.state.dims.dp
        return ids[self.state.dp_rank * local:(self.state.dp_rank + 1) * local]

    def validate(self) -> dict[str, float]:
        """Greedy episodes from the held-out states: success rate and episode length."""
        start = time.perf_counter()
        ro = rollout([self.val_env], self._policy_fn(None, 0.0), self.val_ids, overlap=False)
        m = _mean_over_dp(self.state, {"val/success": ro.success.mean(),
                                       "val/episode_length": ro.episode_length.mean()})
        m["val/seconds"] = time.perf_counter() - start
        return m

    # -------------------------------------------------------------- training

    def behaviour_cloning(self, steps: int, batch_size: int) -> list[float]:
        """`steps` updates on the expert's successful demonstrations (batches drawn from (seed, -1, i)); returns the
        losses."""
        d = self.demos
        keep = np.flatnonzero(d["success"])
        tokens = self.policy.actions.tokenize(d["actions"])
        self.engine.objective, saved = "bc", self.engine.cfg
        self.engine.cfg = dataclasses.replace(saved, ppo_epochs=1)
        losses = []
        try:
            for i in range(steps):
                rng = np.random.default_rng([self.cfg.trainer.seed, 2**31, i, self.state.dp_rank])
                pick = rng.choice(keep, size=min(batch_size, len(keep)), replace=False)
                batch = self.policy.batch(d["image"][pick], [d["instruction"][j] for j in pick], tokens[pick],
                                          np.ones_like(tokens[pick]))
                if self.cfg.vla.bc_lr is not None:  # the scheduler's next step (after this update) sets it back
                    for g in self.engine.optimizer.param_groups:
                        g["lr"] = self.cfg.vla.bc_lr
                losses.append(self.engine.update(batch)["actor/bc_loss"])
        finally:
            self.engine.objective, self.engine.cfg = "ppo", saved
        if self.cfg.vla.bc_reset_optimizer:
            reset_adam_moments(self.engine.optimizer)
        return losses

    def train_step(self, step: int) -> dict[str, float]:
        cfg, v = self.cfg, self.cfg.vla
        t0 = time.perf_counter()
        ids, group = repeat_for_groups(self.train_states(step), self.n)
        gen = _keyed_generator(cfg.trainer.seed, step, self.state.dp_rank)
        temperature = cfg.actor_rollout_ref.rollout.temperature
        ro = rollout(self.stages, self._policy_fn(gen, temperature), ids, overlap=v.overlap and len(self.stages) > 1)
        success = ro.success.astype(np.float32)
        # the group filter is GRPO's (the config refuses it with gae)
        keep = group_filter(success, group, v.filter_low, v.filter_high) if v.filter_groups else np.ones(len(ids), bool)
        rows = flatten_rollout(ro, group)
        sel = np.flatnonzero(keep[rows.traj])
        metrics = {"train/success": success.mean(), "train/episode_length": ro.episode_length.mean(),
                   "train/groups_kept": keep.mean(), "train/rows": float(len(sel)), "train/rollout_logprob_gap": 0.0}
        update = {}
        if _sum_over_dp(self.state, len(sel)) > 0:
            norm = cfg.algorithm.norm_adv_by_std_in_grpo
            adv = episode_advantages(success, group, norm) if self.critic is None else None  # (B,) GRPO's
            batch, metrics["train/rollout_logprob_gap"] = self.training_batch(rows, sel, adv)
            if self.critic is not None:
                metrics.update(self.gae_targets(batch, rows, sel))
            update = self.update(batch) if len(sel) else self._empty_update()
        s = ro.stats
        metrics = _mean_over_dp(self.state, metrics)
        metrics.update({k: v for k, v in update.items() if k.startswith(("actor/", "critic/"))})
        metrics.update({"perf/env_s": s["env_s"], "perf/policy_s": s["policy_s"], "perf/env_wait_s": s["env_wait_s"],
                        "perf/env_steps_per_s": s["env_steps"] / max(s["wall_s"], 1e-9),
                        "perf/step_s": time.perf_counter() - t0})
        return metrics

    def training_batch(self, rows, sel: np.ndarray, adv: Optional[np.ndarray]) -> tuple[dict, float]:
        """The engine's batch of rows `sel` (their own images, the sampled action tokens, the mask up to the first
        done), the old policy's log-probs from the engine's forward, each row's episode advantage `adv` (B,) on its
        masked tokens (None: none; PPO's come from :meth:`gae_targets`); and the mean |engine - rollout| log-prob gap
        over those tokens (numerics only: the same chunks, weights, action range and temperature;
        tests/test_vla_logprobs.py)."""
        batch = self.policy.batch(rows.image[sel], [rows.instruction[i] for i in sel], rows.outputs["tokens"][sel],
                                  rows.response_mask[sel])
        m = batch["response_mask"]
        rollout_lp = torch.as_tensor(rows.outputs["log_probs"][sel], dtype=torch.float32) * m
        old, _ = self.engine.compute_log_probs(batch, with_entropy=False)  # the old policy, scored by the engine
        batch["old_log_probs"] = old * m
        gap = ((old - rollout_lp).abs() * m).sum() / m.sum().clamp(min=1)
        if adv is not None:
            batch["advantages"] = torch.as_tensor(adv[rows.traj[sel]], dtype=torch.float32)[:, None] * m
        return batch, float(gap)

    def gae_targets(self, batch: dict, rows, sel: np.ndarray) -> dict[str, float]:
        """PPO: the critic's per-token values of the rows into `batch["values"]` (the old values of the clipped
        value loss), chunk-level GAE from each row's value at its first action token (the value of its observation)
        and its reward (the env's rewards of its steps; :func:`chunk_gae`), each row's advantage into
        `batch["advantages"]` and its return into `batch["returns"]` on its masked tokens. `sel` must hold whole
        trajectories (no group filter with gae). Returns this rank's `critic/*` statistics over the rows."""
        alg, m = self.cfg.algorithm, batch["response_mask"]
        values = self.critic.compute_values(batch)  # (B, R) at the positions predicting each action token
        v_obs = values[:, 0]  # (B,) V(observation): the position predicting the chunk's first action token
        reward = torch.as_tensor(rows.token_rewards[sel].sum(1), dtype=torch.float32)  # (B,)
        adv, ret = chunk_gae(v_obs, reward, rows.traj[sel], rows.chunk[sel], gamma=alg.gamma, lam=alg.lam)  # (B,)
        batch["values"] = values * m
        batch["advantages"] = adv[:, None] * m
        batch["returns"] = ret[:, None] * m
        explained = 1.0 - float((ret - v_obs).var(unbiased=False) / ret.var(unbiased=False).clamp(min=1e-8))
        return {"critic/values/mean": float(v_obs.mean()), "critic/returns/mean": float(ret.mean()),
                "critic/rewards/mean": float(reward.mean()), "critic/vf_explained_var": explained}

    def update(self, batch: dict) -> dict[str, float]:
        """The critic's update (PPO), then the actor's, as the text trainer's learner orders them."""
        metrics = self.critic.update_critic(batch) if self.critic is not None else {}
        return {**metrics, **self.engine.update(batch)}

    def _empty_update(self):
        raise RuntimeError("a data-parallel rank whose groups were all filtered out cannot join the others' update; "
                           "turn vla.filter_groups off or run one DP rank")

    # -------------------------------------------------------------- checkpoints

    def save(self, ckpt, step: int) -> None:
        from rlhf_mcore.config import to_dict

        ckpt.save(step, {"step": step}, self._save_engines, config=to_dict(self.cfg))

    def _save_engines(self, d: Path) -> None:
        self.engine.save_checkpoint(d / "actor")
        if self.critic is not None:
            self.critic.save_checkpoint(d / "critic")

    def resume(self, ckpt) -> int:
        from rlhf_mcore.config import to_dict

        t = self.cfg.trainer
        path = ckpt.resume_point(t.resume_mode, to_dict(self.cfg), t.resume_ignore_config_changes)
        if path is None:
            return 0
        self.engine.load_checkpoint(path / "actor")
        if self.critic is not None:
            self.critic.load_checkpoint(path / "critic")
        return int(ckpt.load_trainer_state(path)["step"])


def _model_vocab(path: str) -> int:
    from rlhf_mcore.models import ModelShape

    return ModelShape.from_hf_dir(path).vocab_size


def _sum_over_dp(state, value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    if state.dims.dp > 1:
        dist.all_reduce(t, group=state.dp_cpu_group if hasattr(state, "dp_cpu_group") else state.dp_group)
    return float(t[0])


def _mean_over_dp(state, metrics: dict) -> dict[str, float]:
    keys = sorted(metrics)
    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=state.device)
    if state.dims.dp > 1:
        dist.all_reduce(t, group=state.dp_group)
        t /= state.dims.dp
    return dict(zip(keys, t.tolist()))


# ------------------------------------------------------------------ the outer loop


def run_vla(cfg) -> dict[str, float]:
    """Every rank: build, warm-start (fresh runs), then GRPO or PPO steps with validation and checkpoints."""
    from rlhf_mcore.config import parallel_layout, to_dict
    from rlhf_mcore.parallel import destroy_distributed, init_distributed
    from rlhf_mcore.parallel.allocator import expandable_segments_for
    from rlhf_mcore.trainer.checkpoint import CheckpointManager
    from rlhf_mcore.trainer.logging import MetricLogger
    from rlhf_mcore.trainer.roles import run_dir

    t, v = cfg.trainer, cfg.vla
    out_dir = run_dir(cfg)
    tp, pp, _ = parallel_layout(cfg)
    state = init_distributed(tp, pp, None, device=t.device, seed=t.seed,
                             expandable_segments=expandable_segments_for(cfg))
    run: Optional[VLARun] = None
    try:
        run = VLARun(cfg, state, out_dir)
        ckpt = CheckpointManager(out_dir / "checkpoints", t.max_actor_ckpt_to_keep, state.rank, group=state.cpu_group)
        step = run.resume(ckpt)
        log = MetricLogger(t.logger, out_dir, run.total_steps, to_dict(cfg), t.project_name, t.experiment_name,
                           enabled=state.rank == 0, start_step=step)
        if step == 0 and v.bc_steps:
            losses = run.behaviour_cloning(v.bc_steps, v.bc_batch_size)
            log.log(0, {"bc/loss_first": losses[0], "bc/loss_last": losses[-1]}, kind="bc")
        if t.val_before_train and step == 0:
            log.log(0, run.validate(), kind="val")
        metrics: dict[str, float] = {}
        while step < run.total_steps:
            step += 1
            metrics = run.train_step(step)
            if t.test_freq > 0 and (step % t.test_freq == 0 or step == run.total_steps):
                metrics.update(run.validate())
            log.log(step, metrics)
            if t.save_freq > 0 and (step % t.save_freq == 0 or step == run.total_steps):
                run.save(ckpt, step)
        log.close()
        return metrics
    finally:
        if run is not None:
            run.close()
        destroy_distributed()
