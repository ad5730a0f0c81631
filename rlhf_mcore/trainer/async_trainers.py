"""The asynchronous trainers' training pool: one-step-off-policy and fully asynchronous, built from the
synchronous trainer's parts (forward passes, advantages, rollout correction, update, metrics, checkpoints).

The torchrun world is split (:mod:`rlhf_mcore.parallel.pools`): training ranks run these loops, rollout ranks
run :class:`rlhf_mcore.trainer.rollout_worker.RolloutWorker`. Training rank 0 is the coordinator: it draws
prompts, tells the rollout ranks what to do, keeps the data bus's ledger (metadata only) and broadcasts to the
training ranks which groups to pull from which producer.

Policy versions: version v is the actor after v training steps. A group's staleness at step s is
(s - 1) - its oldest token's version.

Multi-turn (agent loops): one_step_off generates each step's trajectories with one policy; fully_async streams them
and, at a weight sync, pauses the model turns in the engine and continues them under the new weights, tool calls
in flight finishing meanwhile (:mod:`rlhf_mcore.trainer.sample_streams`). A trajectory then spans several
versions: each model token keeps the rollout log-prob of the policy that sampled it, its staleness counts from its
oldest token, `fully_async/partial/samples_across_sync` counts the trained ones that crossed a sync and
`agent/paused_turns` the model turns paused mid-generation.

Rewards: the rollout pool scores every sample with the rule functions (plus DAPO's overlong penalty) as it streams
them. A discriminative reward model (`reward_model.enable`) lives on the training pool, sharded like the critic:
each step, after its rows arrive over the data bus and before the forward passes, every data-parallel replica scores
its own rows and combines the score with the rule score by the synchronous trainer's rule
(:meth:`AsyncTrainerBase.score_with_reward_model`). With `reward_model.megatron.param_offload` its weights are on
the host except while it scores, so the training pool alternates reward-model scoring and the actor's update
without holding both on the device.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from rlhf_mcore.config import RLConfig
from rlhf_mcore.engine.balance import partition_balanced
from rlhf_mcore.parallel import pick_device
from rlhf_mcore.parallel.pools import PoolLayout, Pools, init_pools
from rlhf_mcore.rewards.pipeline import OverlongShaping, compose
from rlhf_mcore.sync import broadcast_weights
from rlhf_mcore.trainer.databus import GroupMeta, Ledger, pull, pull_orders, send_orders, staleness_metrics
from rlhf_mcore.trainer.plan import broadcast_object
from rlhf_mcore.trainer.rl_trainer import PhaseTimer, RLTrainer
from rlhf_mcore.trainer.stats import rollout_gap_metrics

WAIT_TIMEOUT_S = 1800.0  # the coordinator's longest wait for a message of the rollout pool (then TimeoutError)


class AsyncTrainerBase(RLTrainer):
    """What both modes share: commands to the rollout pool, the weight push, pulling groups, validation."""

    def __init__(self, cfg: RLConfig, pools: Pools, hooks=None):
        super().__init__(cfg, hooks=hooks, pools=pools)

    def build_components(self, cfg: RLConfig, pools: Pools) -> None:  # under the run lock: see RLTrainer
        super().build_components(cfg, pools)
        self.layout = pools.layout
        self.coord_box = pools.mailbox("coord") if self.state.is_coordinator else None
        self.ledger = Ledger()
        self.pushed_version = -1
        self.pending: dict[str, Any] = {"stats": {}, "val": {}}  # messages that arrived before they were needed
        self.trained_prompts: list[int] = []  # dataset indices, every step's, in order (kept in checkpoints)
        self.dropped_prompts: list[int] = []  # fully_async: prompts whose groups were dropped as stale
        ranks = [None] * self.state.world_size
        dist.all_gather_object(ranks, self.state.dp_rank, group=self.state.cpu_group)
        self.dp_ranks = [[g for g, d in enumerate(ranks) if d == dp] for dp in range(self.state.dims.dp)]

    def fit(self) -> dict[str, float]:
        """Each mode's schedule is its `take_groups` (which samples a step trains on), `weights_due` (when the
        rollout pool gets the actor's weights) and `after_step` (what the rollout pool is asked for next)."""
        self.start()
        last = {}
        while self.step < self.total_steps:
            self.step += 1
            self.hooks.step_start(self, self.step)
            t = PhaseTimer()
            with t("step"):
                with t("wait"):
                    groups, prompts, info = self.take_groups()    # the step's groups, pulled from the bus
                batch = self.groups_to_batch(groups, prompts, info, t)  # reward-model scores combined in
                train_metrics = self.train_on(batch, t)            # log-probs, advantages, updates
                with t("sync"):
                    sync_metrics = self.push_weights() if self.weights_due() else {}
            last = self.finish_step(batch, {**self.step_metrics(batch, info), **train_metrics, **sync_metrics}, t)
            self.after_step()
            self.hooks.step_end(self, self.step, batch, last, t)
        self.stop_rollout()
        if self.cfg.trainer.export_hf_final:
            self.export_final()
        return last

    def after_step(self) -> None:
        pass

    # ------------------------------------------------------------------------------------------- coordinator
    def command(self, cmd: tuple, ranks: Optional[list[int]] = None) -> None:
        """Coordinator: append `cmd` to the mailboxes of `ranks` (default: every rollout rank)."""
        for r in ranks if ranks is not None else self.layout.rollout_ranks:
            self.pools.mailbox(f"rank{r}").put(cmd)

    def pump(self, until, what: str) -> float:
        """Coordinator: take messages from the rollout pool until `until()`; returns the seconds spent waiting."""
        t0 = time.perf_counter()
        while not until():
            try:
                msg = self.coord_box.get(timeout_s=WAIT_TIMEOUT_S)
            except RuntimeError as e:  # the store's wait timed out
                raise TimeoutError(f"the coordinator waited {WAIT_TIMEOUT_S:.0f} s for {what} and the rollout pool "
                                   f"sent nothing: look for a failed or stuck rollout rank above ({e})") from None
            if msg[0] == "group":
                self.ledger.add(msg[1])
            elif msg[0] == "stats":
                self.pending["stats"][msg[1]] = msg[2]
            elif msg[0] == "val":
                self.pending["val"][msg[1]] = (msg[2], msg[3])
            self.on_message()
        return time.perf_counter() - t0

    def on_message(self) -> None:
        pass

    def push_weights(self) -> dict[str, float]:
        """The actor's weights (version = self.step) to every rollout rank: all training ranks export (a
        collective), training rank 0 broadcasts over the weights link."""
        r = self.cfg.actor_rollout_ref.rollout
        if self.state.is_coordinator:
            self.command(("weights", self.step))
            metrics = broadcast_weights(self.pools.weights, 0, self.actor.export_hf_weights(),
                                        bucket_mb=r.sync_bucket_mb, device=self.pools.weights.device,
                                        checksums=r.sync_verify)
        else:
            for _ in self.actor.export_hf_weights():
                pass
            metrics = {}
        self.pushed_version = self.step
        return broadcast_object(metrics, group=self.state.cpu_group)

    def pull_groups(self, chosen: Optional[list[list[GroupMeta]]], info: dict) -> tuple[list, dict]:
        """Every training rank: the coordinator's choice (groups per DP rank) and step info broadcast, then this
        rank's groups pulled from their producers. Returns (groups of rows, info)."""
        orders, info = broadcast_object((pull_orders(chosen), info) if chosen is not None else None,
                                        group=self.state.cpu_group)
        t0 = time.perf_counter()
        groups = pull(self.pools.bus, orders[self.state.dp_rank])
        info["timing_s/pull"] = time.perf_counter() - t0
        return groups, info

    def groups_to_batch(self, groups: list[list], prompts: list[int], info: dict, t: PhaseTimer) -> dict[str, Any]:
        """This rank's groups as the padded batch (`prompts[pos]`: group pos's dataset index), each row's reward
        the rollout pool's rule score or, with a reward model, its combination with the model's score (metrics
        into `info`), and `staleness` (B,): the trainer's policy before this step's update less each row's
        oldest token's version."""
        rows = []
        for pos, group in enumerate(groups):
            for r in group:
                r.prompt_pos = pos
                rows.append(r)
        if self.reward_model is not None:
            with t("reward_model"):
                info.update(self.score_with_reward_model(rows, prompts))
        batch = self.rows_to_batch(rows, prompts)
        version = self.step - 1  # the trainer's policy before this step's update
        batch["staleness"] = torch.tensor([version - min(r.versions) for r in rows])  # (B,)
        return batch

    def score_with_reward_model(self, rows: list, prompts: list[int]) -> dict[str, float]:
        """Every training rank together: this DP rank's rows scored by the reward model on its replica, composed
        by the reward pipeline as the synchronous trainer's rows are (the rollout pool composed them without a
        learned score; `reward_extra` keeps the parts). Returns the `reward_model/*` metrics of the step's rows."""
        items = [self.train_set[p] for p in prompts]
        return compose(rows, items, OverlongShaping.from_config(self.cfg), learned=self.reward_model, local=True)

    def forward_passes(self, batch: dict[str, Any]) -> None:
        super().forward_passes(batch)
        fresh = batch["staleness"] == 0  # samples from the trainer's current weights: the gap is numerics only
        if "old_entropy" in batch and bool(fresh.any()):
            batch["fresh_gap"] = rollout_gap_metrics(batch["rollout_log_probs"][fresh], batch["old_log_probs"][fresh],
                                                     batch["response_mask"][fresh].float())

    def check_rollout_gap(self, metrics: dict[str, float]) -> None:
        """Off-policy samples differ from the trainer by design; the limit applies to the samples of the trainer's
        own version (`rollout/same_version/*`), when a step has some on every rank."""
        tag = "rollout/same_version/"
        gap = {"rollout/" + k[len(tag):]: v for k, v in metrics.items() if k.startswith(tag)}
        if gap:
            super().check_rollout_gap(gap)

    def step_metrics(self, batch: dict[str, Any], info: dict) -> dict[str, float]:
        out = {k: v for k, v in info.items() if isinstance(v, float)}
        gap = batch.pop("fresh_gap", None)
        has = torch.tensor([1.0 if gap else 0.0])
        if dist.get_world_size(self.state.cpu_group) > 1:
            dist.all_reduce(has, op=dist.ReduceOp.MIN, group=self.state.cpu_group)
        if gap and has.item() > 0:  # every rank has same-version samples: the key set is the same everywhere
            out.update({k.replace("rollout/", "rollout/same_version/"): v for k, v in gap.items()})
        ids = [None] * self.state.world_size
        dist.all_gather_object(ids, (self.state.dp_rank, self.step_prompts), group=self.state.cpu_group)
        seen = {}
        for dp, prompts in ids:
            seen.setdefault(dp, prompts)
        self.trained_prompts += [p for dp in sorted(seen) for p in seen[dp]]
        return out

    def finish_step(self, batch, step_metrics: dict[str, float], timer: PhaseTimer) -> dict[str, float]:
        step_metrics["trainer/idle_ratio"] = timer.seconds["wait"] / max(timer.seconds["step"], 1e-9)
        return super().finish_step(batch, step_metrics, timer)

    def run_validation(self) -> dict[str, float]:
        """Validation on the rollout pool, with the actor's current weights (pushed first when the rollout
        does not have them)."""
        if self.val_set is None:
            return {}
        if self.pushed_version != self.step:
            self.push_weights()
        metrics = None
        if self.state.is_coordinator:
            self.command(("validate", self.step))
            self.pump(lambda: self.step in self.pending["val"], "validation")
            metrics, samples = self.pending["val"].pop(self.step)
            self.logger.log(self.step, metrics, kind="val")
            for s in samples:
                self.logger.text(f"[val sample] score={s['score']:.1f} | {s['prompt'][-120:]!r} -> "
                                 f"{s['response'][:200]!r}")
        return broadcast_object(metrics, group=self.state.cpu_group)

    def trainer_state(self) -> dict[str, Any]:
        return {**super().trainer_state(), "trained_prompts": self.trained_prompts,
                "dropped_prompts": self.dropped_prompts, "ledger": self.ledger.state_dict()}

    def load_trainer_state(self, state: dict) -> None:
        super().load_trainer_state(state)
        self.trained_prompts = list(state["trained_prompts"])
        self.dropped_prompts = list(state["dropped_prompts"])
        self.ledger.load_state_dict(state["ledger"])

    def stop_rollout(self) -> None:
        if self.state.is_coordinator:
            self.command(("stop",))


class OneStepOffTrainer(AsyncTrainerBase):
    """The rollout pool generates step k+1 while the training pool trains step k: step k's samples come from
    the weights after step k-2 (one update behind the actor that trains on them)."""

    def take_groups(self) -> tuple[list[list], list[int], dict]:
        return self.receive_step()  # step k's groups, generated while step k-1 trained

    def weights_due(self) -> bool:
        return self.step + 2 <= self.total_steps  # the weights step k+2 will be generated with

    def after_step(self) -> None:
        if self.step + 2 <= self.total_steps:  # after step k's validation and checkpoint
            self.post_generate(self.step + 2)

    def start(self) -> None:
        self.resume()
        self.open_logger()
        self.sampler_after: dict[int, dict] = {}
        self.plans: dict[int, list[list[int]]] = {}
        self.push_weights()
        if self.cfg.trainer.val_before_train and self.step == 0:
            self.run_validation()
        for k in (self.step + 1, self.step + 2):
            if k <= self.total_steps:
                self.post_generate(k)

    def post_generate(self, k: int) -> None:
        """Coordinator: draw step k's prompts, split them over DP ranks, and ask the rollout pool for them."""
        if not self.state.is_coordinator:
            return
        plan = self.split_over_dp(self.sampler.next_batch(self.cfg.data.train_batch_size))
        self.sampler_after[k] = copy.deepcopy(self.sampler.state_dict())
        for done in [j for j in self.sampler_after if j < self.step]:  # saved checkpoints need only this step's
            del self.sampler_after[done]
        self.plans[k] = plan
        prompts = [i for part in plan for i in part]
        dsts = [self.dp_ranks[d] for d, part in enumerate(plan) for _ in part]
        seed = self.cfg.trainer.seed * 100_003 + k  # the synchronous trainer's seed for step k
        self.command(("generate", k, prompts, seed, dsts))

    def receive_step(self) -> tuple[list[list], list[int], dict]:
        k, chosen, info = self.step, None, None
        if self.state.is_coordinator:
            plan = self.plans.pop(k)
            want = sum(len(p) for p in plan)
            ready = lambda: k in self.pending["stats"] and sum(m.step == k for m in self.ledger.queue.values()) == want  # noqa: E731
            wait_s = self.pump(ready, f"step {k}'s samples")
            by_pos = {m.pos: m for m in self.ledger.queue.values() if m.step == k}
            self.ledger.take(list(m.uid for m in by_pos.values()))
            chosen, start = [], 0
            for part in plan:
                chosen.append([by_pos[p] for p in range(start, start + len(part))])
                start += len(part)
            info = {**self.pending["stats"].pop(k), "trainer/wait_s": wait_s,
                    **staleness_metrics([m for part in chosen for m in part], k - 1, prefix="one_step_off"),
                    "one_step_off/count/producers": float(len({m.src for part in chosen for m in part}))}
        groups, info = self.pull_groups(chosen, info)
        plan_part = self.my_prompts(chosen)
        self.step_prompts = plan_part
        return groups, plan_part, info

    def my_prompts(self, chosen) -> list[int]:
        parts = broadcast_object([[m.prompt for m in part] for part in chosen] if chosen is not None else None,
                                 group=self.state.cpu_group)
        return parts[self.state.dp_rank]

    def trainer_state(self) -> dict[str, Any]:
        state = super().trainer_state()
        if self.state.is_coordinator:  # the sampler as it was after drawing this step: later ones are regenerated
            state["sampler"] = self.sampler_after[self.step]
        return state


class FullyAsyncTrainer(AsyncTrainerBase):
    """The rollout pool streams groups continuously; each step takes the oldest `require_batches` x
    `ppo_mini_batch_size` groups that are not staler than `staleness_threshold`, and the weights go to the
    rollout pool every `trigger_parameter_sync_step` steps."""

    def take_groups(self) -> tuple[list[list], list[int], dict]:
        return self.next_batch()  # the oldest fresh-enough groups on the bus

    def train_on(self, batch: dict[str, Any], t: PhaseTimer) -> dict[str, float]:
        metrics = super().train_on(batch, t)
        self.version = self.step
        return metrics

    def weights_due(self) -> bool:
        return self.step % self.cfg.async_training.trigger_parameter_sync_step == 0 or self.step == self.total_steps

    def start(self) -> None:
        self.outstanding: dict[int, int] = {}  # uid -> prompt: granted, not yet trained or dropped
        self.next_uid = 0
        self.regrant: list[int] = []  # prompts in flight at the checkpoint we resumed from
        self.resume()
        self.version = self.step  # the actor's policy version: updates done
        self.open_logger()
        self.latest_clock: dict[int, tuple] = {}  # producer rank -> its (idle_s, wall_s) at its latest group
        self.step_clock: dict[int, tuple] = {}  # ... when the previous step took its groups
        self.push_weights()
        if self.cfg.trainer.val_before_train and self.step == 0:
            self.run_validation()
        if self.state.is_coordinator:
            self.grant()

    def grant(self) -> None:
        """Coordinator: hand out prompts while (trained + queued + in flight) <= (threshold + version + 1) x a
        step's groups (the bound that keeps samples within the staleness threshold), round-robin over replicas."""
        a, g = self.cfg.async_training, self.cfg.data.train_batch_size
        limit = (a.staleness_threshold + self.version + 1) * g
        leaders = [self.layout.replica_leader(r) for r in range(self.layout.replicas)]
        grants: dict[int, list] = {r: [] for r in leaders}
        while self.ledger.trained + len(self.outstanding) < limit:
            prompt = self.regrant.pop(0) if self.regrant else self.sampler.next_batch(1)[0]
            uid, self.next_uid = self.next_uid, self.next_uid + 1
            self.outstanding[uid] = prompt
            grants[leaders[uid % len(leaders)]].append((uid, prompt))
        for rank, entries in grants.items():
            if entries:
                self.command(("grant", entries), [rank])

    def on_message(self) -> None:
        self.grant()

    def next_batch(self) -> tuple[list[list], list[int], dict]:
        a, g = self.cfg.async_training, self.cfg.data.train_batch_size
        chosen, info = None, None
        if self.state.is_coordinator:
            version = self.step - 1
            dropped: list[GroupMeta] = []

            def ready() -> bool:
                stale = self.ledger.drop_stale(version, a.staleness_threshold)
                for m in stale:
                    del self.outstanding[m.uid]
                    self.dropped_prompts.append(m.prompt)
                    self.command(("drop", [m.uid]), [m.src])
                dropped.extend(stale)
                return len(self.ledger) >= g

            self.grant()
            wait_s = self.pump(ready, f"step {self.step}'s {g} groups")
            metas = list(self.ledger.queue.values())[:g]  # the oldest first
            self.ledger.take([m.uid for m in metas])
            for m in metas:
                del self.outstanding[m.uid]
            parts = partition_balanced([m.tokens for m in metas], self.state.dims.dp, equal_size=True)
            chosen = [[metas[i] for i in part] for part in parts]
            for src, entries in send_orders(chosen, self.dp_ranks).items():
                self.command(("send", entries), [src])
            self.ledger.check()
            info = {"trainer/wait_s": wait_s, **self.bus_metrics(metas, dropped, version)}
        groups, info = self.pull_groups(chosen, info)
        prompts = broadcast_object([[m.prompt for m in part] for part in chosen] if chosen is not None else None,
                                   group=self.state.cpu_group)[self.state.dp_rank]
        self.step_prompts = prompts
        return groups, prompts, info

    def bus_metrics(self, metas: list[GroupMeta], dropped: list[GroupMeta], version: int) -> dict[str, float]:
        n = self.cfg.actor_rollout_ref.rollout.n
        out = staleness_metrics(metas, version)
        out.update({"fully_async/count/dropped_stale_samples": float(len(dropped) * n),
                    "fully_async/count/produced_samples": float(self.ledger.produced * n),
                    "fully_async/count/trained_samples": float(self.ledger.trained * n),
                    "fully_async/count/dropped_samples_total": float(self.ledger.dropped * n),
                    "fully_async/count/queued_samples": float(len(self.ledger) * n),
                    "fully_async/count/in_flight_samples": float((len(self.outstanding) - len(self.ledger)) * n),
                    "fully_async/count/producers": float(len({m.src for m in metas}))})  # rollout replicas
        for k in ("num_timeouts", "num_exceptions", "num_invalid"):
            out[f"reward/{k}"] = float(sum(m.stats.get(f"reward/{k}", 0.0) for m in metas))
        if self.cfg.actor_rollout_ref.rollout.multi_turn.enable:  # the step's trajectories (rows carry their own)
            from rlhf_mcore.agents.rollout import agent_metrics

            out.update(agent_metrics([info for m in metas for info in m.stats.get("agent", [])]))
            out.setdefault("agent/paused_turns", 0.0)  # model turns paused at a weight sync and continued
        for m in metas:  # each producer's clocks at its latest group
            if m.stats["wall_s"] >= self.latest_clock.get(m.src, (0.0, 0.0))[1]:
                self.latest_clock[m.src] = (m.stats["idle_s"], m.stats["wall_s"])
        idle = []
        for src, (idle_s, wall_s) in self.latest_clock.items():
            before = self.step_clock.get(src, (0.0, 0.0))
            if wall_s > before[1]:
                idle.append((idle_s - before[0]) / (wall_s - before[1]))
        self.step_clock = dict(self.latest_clock)
        out["rollouter/idle_ratio"] = sum(idle) / len(idle) if idle else 0.0
        return out

    def trainer_state(self) -> dict[str, Any]:
        state = super().trainer_state()
        state["regrant"] = list(self.outstanding.values())  # queued or in flight: regenerated after a resume
        state["next_uid"] = self.next_uid
        return state

    def load_trainer_state(self, state: dict) -> None:
        super().load_trainer_state(state)
        self.regrant = list(state["regrant"])
        self.next_uid = int(state["next_uid"])
        self.ledger.produced = self.ledger.trained + self.ledger.dropped  # what was queued is regenerated


def train_async(cfg: RLConfig, hooks=None) -> dict[str, float]:
    """Every rank of an asynchronous run: join its pool, then train (training pool) or generate (rollout pool).
    `hooks`: the training pool's step observers (:class:`rlhf_mcore.trainer.rl_trainer.StepHooks`)."""
    import os

    from rlhf_mcore.config import pool_sizes
    from rlhf_mcore.trainer.rollout_worker import RolloutWorker

    world = int(os.environ.get("WORLD_SIZE", "1"))
    train_size, rollout_size = pool_sizes(cfg, world)
    layout = PoolLayout(train_size, rollout_size, cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)
    pools = init_pools(layout, pick_device(cfg.trainer.device))
    if pools.is_rollout:
        worker = RolloutWorker(cfg, pools)
        try:
            worker.run()
        finally:
            dist.destroy_process_group()
        return {}
    mode = {"one_step_off": OneStepOffTrainer, "fully_async": FullyAsyncTrainer}[cfg.async_training.mode]
    trainer = mode(cfg, pools, hooks=hooks)
    try:
        return trainer.fit()
    finally:
        trainer.close()
