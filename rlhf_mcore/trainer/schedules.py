"""The coordinator's schedule of each asynchronous mode: which prompts the rollout pool is asked for, and which
groups a step trains on. Every training rank holds one; only the coordinator's draws, commands and keeps state."""
from __future__ import annotations

import copy
from typing import Any

from rlhf_mcore.data.seeds import step_seed
from rlhf_mcore.engine.balance import partition_balanced
from rlhf_mcore.trainer.databus import GroupMeta, send_orders, staleness_metrics
from rlhf_mcore.trainer.messages import Drop, Generate, Grant, Send


class OneStepOff:
    """The rollout pool generates step k+1 while the training pool trains step k: step k's samples come from
    the weights after step k-2 (one update behind the actor that trains on them)."""

    def __init__(self, run, pool):
        self.run, self.pool = run, pool
        self.sampler_after: dict[int, dict] = {}  # the sampler after drawing step k (a checkpoint of step k's)
        self.plans: dict[int, list[list[int]]] = {}

    def weights_due(self) -> bool:
        return self.run.step + 2 <= self.run.total_steps  # the weights step k+2 will be generated with

    def post_generate(self, k: int) -> None:
        """Coordinator: draw step k's prompts, split them over DP ranks, and ask the rollout pool for them."""
        run = self.run
        if not run.state.is_coordinator:
            return
        plan = run.split_over_dp(run.draw(run.cfg.data.train_batch_size))
        self.sampler_after[k] = copy.deepcopy(run.sampler.state_dict())
        for done in [j for j in self.sampler_after if j < run.step]:  # saved checkpoints need only this step's
            del self.sampler_after[done]
        self.plans[k] = plan
        prompts = [i for part in plan for i in part]
        dsts = [self.pool.dp_ranks[d] for d, part in enumerate(plan) for _ in part]
        seed = step_seed(run.cfg.trainer.seed, k)  # the synchronous trainer's seed for step k
        self.pool.command(Generate(k, prompts, seed, dsts, prefetch=self.pushed_during(k)))

    def pushed_during(self, k: int) -> int | None:
        """The weights version pushed while step k generates, when `async_training.prefetch_weights` lets the
        rollout pool take it meanwhile: version k-1 (after step k-1 trains, before step k's samples are needed)
        if step k-1 pushes (`weights_due`) and it was not pushed already (the run's first step k pushes none)."""
        run, v = self.run, k - 1
        due = v > self.pool.pushed_version and v + 2 <= run.total_steps
        return v if due and run.cfg.async_training.prefetch_weights else None

    def receive_step(self) -> tuple[list[list], list[int], dict]:
        """Step k's groups, generated while step k-1 trained."""
        k, chosen, info, pool = self.run.step, None, None, self.pool
        if self.run.state.is_coordinator:
            plan = self.plans.pop(k)
            want = sum(len(p) for p in plan)
            ready = lambda: k in pool.stats and sum(m.step == k for m in pool.ledger.queue.values()) == want  # noqa: E731
            wait_s = pool.pump(ready, f"step {k}'s samples")
            by_pos = {m.pos: m for m in pool.ledger.queue.values() if m.step == k}
            pool.ledger.take(list(m.uid for m in by_pos.values()))
            chosen, start = [], 0
            for part in plan:
                chosen.append([by_pos[p] for p in range(start, start + len(part))])
                start += len(part)
            info = {**pool.stats.pop(k), "trainer/wait_s": wait_s,
                    **staleness_metrics([m for part in chosen for m in part], k - 1, prefix="one_step_off"),
                    "one_step_off/count/producers": float(len({m.src for part in chosen for m in part}))}
        return pool.pull_groups(chosen, info)

    def state_dict(self) -> dict[str, Any]:
        """The sampler as it was after drawing this step (coordinator): later steps' prompts are regenerated."""
        return {"sampler": self.sampler_after[self.run.step]} if self.run.state.is_coordinator else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing of its own to restore: its one key, the sampler, is restored by the run context (run.resume)."""


class FullyAsync:
    """The rollout pool streams groups continuously; each step takes the oldest `require_batches` x
    `ppo_mini_batch_size` groups that are not staler than `staleness_threshold`, and the weights go to the
    rollout pool every `trigger_parameter_sync_step` steps."""

    def __init__(self, run, pool):
        self.run, self.pool = run, pool
        self.outstanding: dict[int, int] = {}  # uid -> prompt: granted, not yet trained or dropped
        self.next_uid = 0
        self.regrant: list[int] = []  # prompts in flight at the checkpoint we resumed from
        self.version = 0  # the actor's policy version: updates done
        self.latest_clock: dict[int, tuple] = {}  # producer rank -> its (idle_s, wall_s) at its latest group
        self.step_clock: dict[int, tuple] = {}  # ... when the previous step took its groups
        pool.on_message = self.grant  # coordinator: each message the pool takes may leave room for more prompts

    def weights_due(self) -> bool:
        a, run = self.run.cfg.async_training, self.run
        return run.step % a.trigger_parameter_sync_step == 0 or run.step == run.total_steps

    def grant(self) -> None:
        """Coordinator: hand out prompts while (trained + queued + in flight) <= (threshold + version + 1) x a
        step's groups (the bound that keeps samples within the staleness threshold), round-robin over replicas."""
        a, g, layout = self.run.cfg.async_training, self.run.cfg.data.train_batch_size, self.pool.layout
        limit = (a.staleness_threshold + self.version + 1) * g
        leaders = [layout.replica_leader(r) for r in range(layout.replicas)]
        grants: dict[int, list] = {r: [] for r in leaders}
        while self.pool.ledger.trained + len(self.outstanding) < limit:
            prompt = self.regrant.pop(0) if self.regrant else self.run.draw(1)[0]
            uid, self.next_uid = self.next_uid, self.next_uid + 1
            self.outstanding[uid] = prompt
            grants[leaders[uid % len(leaders)]].append((uid, prompt))
        for rank, entries in grants.items():
            if entries:
                self.pool.command(Grant(entries), [rank])

    def next_batch(self) -> tuple[list[list], list[int], dict]:
        """The oldest fresh-enough groups on the bus (the stale ones dropped, their producers told)."""
        run, pool = self.run, self.pool
        a, g = run.cfg.async_training, run.cfg.data.train_batch_size
        chosen, info = None, None
        if run.state.is_coordinator:
            version = run.step - 1
            dropped: list[GroupMeta] = []

            def ready() -> bool:
                stale = pool.ledger.drop_stale(version, a.staleness_threshold)
                for m in stale:
                    del self.outstanding[m.uid]
                    pool.dropped_prompts.append(m.prompt)
                    pool.command(Drop([m.uid]), [m.src])
                dropped.extend(stale)
                return len(pool.ledger) >= g

            self.grant()
            wait_s = pool.pump(ready, f"step {run.step}'s {g} groups")
            metas = list(pool.ledger.queue.values())[:g]  # the oldest first
            pool.ledger.take([m.uid for m in metas])
            for m in metas:
                del self.outstanding[m.uid]
            parts = partition_balanced([m.tokens for m in metas], run.state.dims.dp, equal_size=True)
            chosen = [[metas[i] for i in part] for part in parts]
            for src, entries in send_orders(chosen, pool.dp_ranks).items():
                pool.command(Send(entries), [src])
            pool.ledger.check()
            info = {"trainer/wait_s": wait_s, **self.bus_metrics(metas, dropped, version)}
        return pool.pull_groups(chosen, info)

    def bus_metrics(self, metas: list[GroupMeta], dropped: list[GroupMeta], version: int) -> dict[str, float]:
        n, ledger = self.run.cfg.actor_rollout_ref.rollout.n, self.pool.ledger
        out = staleness_metrics(metas, version)
        out.update({"fully_async/count/dropped_stale_samples": float(len(dropped) * n),
                    "fully_async/count/produced_samples": float(ledger.produced * n),
                    "fully_async/count/trained_samples": float(ledger.trained * n),
                    "fully_async/count/dropped_samples_total": float(ledger.dropped * n),
                    "fully_async/count/queued_samples": float(len(ledger) * n),
                    "fully_async/count/in_flight_samples": float((len(self.outstanding) - len(ledger)) * n),
                    "fully_async/count/producers": float(len({m.src for m in metas}))})  # rollout replicas
        for k in ("num_timeouts", "num_exceptions", "num_invalid"):
            out[f"reward/{k}"] = float(sum(m.stats.get(f"reward/{k}", 0.0) for m in metas))
        if self.run.cfg.actor_rollout_ref.rollout.multi_turn.enable:  # the step's trajectories (rows carry theirs)
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

    def state_dict(self) -> dict[str, Any]:
        return {"regrant": list(self.outstanding.values()),  # queued or in flight: regenerated after a resume
                "next_uid": self.next_uid}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the pool's (its ledger): what was queued is regenerated, so it counts as not produced."""
        self.regrant = list(state["regrant"])
        self.next_uid = int(state["next_uid"])
        self.version = self.run.step  # the updates done before the checkpoint (run.resume restored the step)
        self.pool.ledger.produced = self.pool.ledger.trained + self.pool.ledger.dropped
