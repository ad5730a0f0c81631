"""The rollout pool of the asynchronous trainers: engine replicas that generate, score and put finished groups
on the data bus, driven by the coordinator's commands (a mailbox per rollout rank in the launcher's store).

Commands (:mod:`rlhf_mcore.trainer.messages`, dispatched with `match`):
    Weights(version)                         join the weight broadcast from training rank 0
    Generate(step, prompts, seed, dsts, prefetch)
                                             one_step_off: generate the step's prompts (dataset indices) over the
                                             pool, score them, send each group to its DP rank's ranks (`dsts`);
                                             with multi_turn.enable the prompts run their agent loops (rows
                                             carry the trajectories' response masks and `agent/*` metrics);
                                             with `prefetch` (a version), receive that version's push in the
                                             background meanwhile and load it at its Weights message
    Grant([(uid, prompt), ...])              fully_async: prompts to stream (all n samples of each; with
                                             multi_turn.enable, n agent-loop trajectories: sample_streams.py)
    Send([(uid, ranks), ...])                fully_async: groups the trainer takes, and where they go
    Drop([uid, ...])                         fully_async: stale groups the trainer will not take
    Validate(step)                           run validation on the current weights, report to the coordinator
    Stop()

Messages to the coordinator ("coord" mailbox): GroupReady(meta), StepStats(step, metrics) and
ValResult(step, metrics, samples).
"""
from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlhf_mcore import trace
from rlhf_mcore.config import RLConfig, load_plugins
from rlhf_mcore.data.rows import Row
from rlhf_mcore.data.seeds import step_seed
from rlhf_mcore.models.tokenizer import decode_texts
from rlhf_mcore.parallel import pick_device
from rlhf_mcore.parallel.pools import IdleBackoff, Pools
from rlhf_mcore.rewards import reward_metrics
from rlhf_mcore.rewards.pipeline import OverlongShaping, compose, set_rule_scores
from rlhf_mcore.rewards.scorer import failure_error
from rlhf_mcore.rewards.stream import ScoringStream
from rlhf_mcore.startup import resume_gc
from rlhf_mcore.sync import StagedReceive, receive_weights
from rlhf_mcore.trainer import roles
from rlhf_mcore.trainer.databus import GroupMeta, GroupStore
from rlhf_mcore.trainer.messages import (
    Drop,
    Generate,
    Grant,
    GroupReady,
    Send,
    StepStats,
    Stop,
    Validate,
    ValResult,
    Weights,
    unknown,
)
from rlhf_mcore.trainer.rollout_phase import ENGINE_METRIC_PREFIXES, generate_and_score, response_budgets
from rlhf_mcore.trainer.sample_streams import SampleStream, TrajectoryStream
from rlhf_mcore.trainer.validation import validate


def stream_seed(cfg: RLConfig) -> int:
    """The fully asynchronous rollout's sampling seed (each group's uid keys its own random streams)."""
    return step_seed(cfg.trainer.seed, 7)


class RolloutWorker:
    def __init__(self, cfg: RLConfig, pools: Pools):
        self.cfg, self.pools = cfg, pools
        load_plugins(cfg.trainer.plugins)
        self.tokenizer, self.train_set, self.val_set = roles.build_data(cfg)
        self.scorer = roles.build_scorer(cfg)
        device = pick_device(cfg.trainer.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.state = SimpleNamespace(device=device, rank=dist.get_rank(), world_size=dist.get_world_size())
        self.engine = roles.build_rollout(cfg, self.state)
        self.agents = roles.build_agent_runner(cfg, self.engine, self.tokenizer)  # multi-turn; None when off
        resume_gc()  # start-up is over (rlhf_mcore/startup.py)
        self.tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        self.leader = self.state.rank % self.tp == 0
        replica = (pools.rank - pools.layout.train_size) // self.tp
        trace.open_trace(trace.trace_path(cfg.trainer.trace, roles.run_dir(cfg)), pools.rank,  # the global rank
                         f"rollout replica {replica} · tp {self.state.rank % self.tp}", pools.layout.world_size)
        self.inbox = pools.mailbox(f"rank{pools.rank}")
        self.coord = pools.mailbox("coord")
        self.store = GroupStore(pools.bus)
        self.version = -1
        self.staged: tuple[int, StagedReceive] | None = None  # one_step_off: a push being received meanwhile
        self.idle_s, self.t0 = 0.0, time.perf_counter()
        self.unreported: dict[str, float] = {}  # fully_async: reward counters not yet attached to a group
        self.shaping = OverlongShaping.from_config(cfg)

    # ------------------------------------------------------------------------------------------- shared
    def run(self) -> None:
        try:
            if self.cfg.async_training.mode == "one_step_off":
                self.run_one_step_off()
            else:
                self.run_fully_async()
            self.store.reap(wait=True)  # every ordered send was received before the trainer said stop
        finally:
            self.scorer.close()
            self.engine.shutdown()

    def next_command(self):
        with trace.span("wait") as s:
            cmd = self.inbox.get()
            s.args["command"] = type(cmd).__name__
        self.idle_s += s.seconds
        return cmd

    def receive_weights(self, version: int) -> None:
        """Join the broadcast of `version`, or load it where it was staged meanwhile (`prefetch_weights`)."""
        verify = self.cfg.actor_rollout_ref.rollout.sync_verify
        if self.staged is not None:
            staged_version, staged = self.staged
            if staged_version != version:
                raise RuntimeError(f"rollout rank {self.state.rank}: the coordinator pushed weights version {version} "
                                   f"but announced version {staged_version} for the background receive")
            self.staged = None
            with trace.span("load staged weights", version=version):
                staged.load_into(self.engine, verify=verify)
        else:
            with trace.span("receive weights", version=version):
                receive_weights(self.pools.weights, 0, self.engine, device=self.pools.weights.device, verify=verify)
        self.version = version
        trace.flush()

    def stage_weights(self, version: int) -> None:
        """Start receiving `version`'s push in the background (loaded at its Weights message)."""
        if self.staged is not None:
            raise RuntimeError(f"rollout rank {self.state.rank}: a background receive of version {self.staged[0]} "
                               f"is still pending when version {version} is announced")
        self.staged = version, StagedReceive(self.pools.weights, 0, device=self.pools.weights.device,
                                             verify=self.cfg.actor_rollout_ref.rollout.sync_verify, version=version)

    def validate(self, step: int) -> None:
        with trace.span("validation", step=step, version=self.version):
            metrics, samples = validate(self.engine, self.scorer, self.tokenizer, self.val_set,
                                        roles.val_sampling_params(self.cfg), rollout_tp=self.tp,
                                        batch_size=self.cfg.data.val_batch_size, agent_runner=self.agents)
        if self.state.rank == 0:
            metrics["val/policy_version"] = float(self.version)
            self.coord.put(ValResult(step, metrics, samples[: self.cfg.trainer.log_val_generations]))

    def clocks(self) -> dict[str, float]:
        """This replica's seconds idle (nothing to generate) and alive, cumulative."""
        return {"idle_s": self.idle_s, "wall_s": time.perf_counter() - self.t0}

    def idle_ratio(self) -> float:
        """The idle fraction since the last call."""
        now = self.clocks()
        last = getattr(self, "_last_clocks", {"idle_s": 0.0, "wall_s": 0.0})
        self._last_clocks = now
        return (now["idle_s"] - last["idle_s"]) / max(now["wall_s"] - last["wall_s"], 1e-9)

    # ------------------------------------------------------------------------------------------- one step off
    def run_one_step_off(self) -> None:
        """Commands in order: the weights, then each step's generation (with the weights of two steps back)."""
        while True:
            match self.next_command():
                case Weights(version):
                    self.receive_weights(version)
                case Generate(step, prompts, seed, dsts, prefetch):
                    if prefetch is not None:
                        self.stage_weights(prefetch)
                    self.generate_step(step, prompts, seed, dsts)
                case Validate(step):
                    self.validate(step)
                case Stop():
                    return
                case cmd:
                    raise unknown(cmd, "rollout worker (one_step_off)")
            self.store.reap()

    def generate_step(self, step: int, prompt_ids: list[int], seed: int, dsts: list[list[int]]) -> None:
        """All rollout ranks generate the step's prompts together (replicas split them as the synchronous
        trainer's replicas do); each replica's first rank sends the groups it made to their DP rank's ranks.
        Multi-turn: the synchronous trainer's agent-loop rollout (`generate_and_score` with the agent runner);
        its `agent/*` metrics go with the step's stats."""
        cfg = self.cfg
        items = [self.train_set[i] for i in prompt_ids]
        with trace.span("generate + score", step=step, prompts=len(prompt_ids), version=self.version) as s:
            rows, stats = generate_and_score(self.engine, self.scorer, [it["input_ids"] for it in items], items,
                                             roles.train_sampling_params(cfg, seed=seed), self.tokenizer,
                                             rollout_tp=self.tp, agent_runner=self.agents)
            compose(rows, items, self.shaping)  # no learned score here: a reward model scores on the training pool
            s.args["samples"] = len(rows)
        gen_s = s.seconds
        for r in rows:
            r.versions = [self.version] * len(r.response_ids)
        if self.state.rank == 0:
            metrics = {**reward_metrics(stats), "timing_s/rollout_gen": gen_s,
                       "rollouter/idle_ratio": self.idle_ratio(),
                       **{k: v for k, v in stats.items() if k.startswith(("agent/", *ENGINE_METRIC_PREFIXES))}}
            metrics.update(self.shaping.metrics(rows))
            self.coord.put(StepStats(step, metrics))
        if not self.leader:
            return
        replicas, replica = self.state.world_size // self.tp, self.state.rank // self.tp
        share = set(np.array_split(np.arange(len(prompt_ids)), replicas)[replica].tolist())
        groups: dict[int, list[Row]] = {}
        for r in rows:
            if r.prompt_pos in share:
                groups.setdefault(r.prompt_pos, []).append(r)
        for pos, group in sorted(groups.items()):
            uid = step * len(prompt_ids) + pos
            meta = self.describe(uid, prompt_ids[pos], group, step=step, pos=pos)
            self.store.send(uid, dsts[pos])
            self.coord.put(GroupReady(meta))
        trace.flush()

    def describe(self, uid: int, prompt: int, group: list[Row], **extra: Any) -> GroupMeta:
        """Keep the group's rows under `uid` and say what they are."""
        nbytes = self.store.put(uid, group)
        versions = [v for r in group for v in (r.versions or [self.version])]
        return GroupMeta(uid=uid, src=self.pools.rank, nbytes=nbytes, prompt=prompt,
                         tokens=sum(len(r.prompt_ids) + len(r.response_ids) for r in group),
                         min_version=min(versions), max_version=max(versions),
                         partial=any(len(set(r.versions or [])) > 1 for r in group),
                         spanning=sum(len(set(r.versions or [])) > 1 for r in group),
                         stats=self.clocks(), **extra)

    # ------------------------------------------------------------------------------------------- fully async
    def run_fully_async(self) -> None:
        """Stream: keep the engine full with granted prompts, score each group as its last sample finishes and
        put it on the bus; between engine steps, act on the coordinator's commands. At a weight sync, in-flight
        samples (multi-turn: model turns) are paused and continued under the new weights (partial_rollout) or
        finished first (sample_streams.py)."""
        cfg = self.cfg
        n, partial = cfg.actor_rollout_ref.rollout.n, cfg.async_training.partial_rollout
        slots = cfg.actor_rollout_ref.rollout.max_num_seqs  # keep the engine's waiting queue short
        params = roles.train_sampling_params(cfg, seed=stream_seed(cfg))
        first = self.next_command()  # the trainer sends its weights before anything else
        if not isinstance(first, Weights):
            raise unknown(first, "rollout worker (fully_async, waiting for the first weights)")
        self.receive_weights(first.version)
        stream = TrajectoryStream(self.agents, params) if self.agents is not None else SampleStream(self.engine, params)
        stream.version = self.version
        self.engine.open_stream(params)
        scoring = ScoringStream(self.scorer)  # RewardLoop: samples are scored as they finish
        todo: deque = deque()  # granted (uid, prompt) not yet started
        live: dict[int, dict] = {}  # uid -> {"prompt", "rows": [Row|None]*n, "scores": [float|None]*n}
        sync_to = None  # a weight version waiting for this replica
        idle = IdleBackoff()
        try:
            while True:
                for cmd in self.inbox.poll():
                    match cmd:
                        case Grant(entries):
                            todo.extend(entries)
                        case Send(entries):
                            for uid, dsts in entries:
                                self.store.send(uid, dsts)
                        case Drop(uids):
                            for uid in uids:
                                self.store.drop(uid)
                        case Weights(version):
                            sync_to = version
                        case Validate(step):  # the engine and the reward workers are the validation's meanwhile
                            stream.pause()
                            self.engine.close_stream()
                            scoring.finish()
                            self.collect(scoring, live)
                            self.validate(step)
                            scoring = ScoringStream(self.scorer)
                            self.engine.open_stream(params)
                            stream.resume()
                        case Stop():
                            self.engine.abort()
                            self.engine.close_stream()
                            scoring.finish()
                            return
                        case _:
                            raise unknown(cmd, "rollout worker (fully_async)")
                if sync_to is not None and (partial or stream.drained()):
                    if partial:
                        stream.pause()
                    self.receive_weights(sync_to)
                    stream.version, sync_to = self.version, None
                    stream.resume()
                while todo and sync_to is None and stream.load + n <= max(slots, n):
                    uid, prompt = todo.popleft()
                    item = self.train_set[prompt]
                    live[uid] = {"prompt": prompt, "rows": [None] * n, "scores": [None] * n}
                    stream.add(uid, item, (response_budgets([item], params.max_new_tokens) or [None])[0])
                with trace.span("engine step", running=stream.load) as s:
                    finished = stream.step(submit=sync_to is None)
                    s.args["finished"] = len(finished)
                    if not finished and not self.engine.num_pending:  # an idle turn (the loop sleeps below)
                        s.drop()
                for uid, row in finished:
                    live[uid]["rows"][row.sample] = row
                self.submit_scoring(scoring, finished, live)
                scored = self.collect(scoring, live)
                if not self.engine.num_pending and not scored and not finished:
                    self.idle_s += idle.wait()
                else:
                    idle.reset()
                self.store.reap()
                if finished or scored:
                    trace.flush()
        finally:
            stream.close()

    def submit_scoring(self, scoring: ScoringStream, finished: list[tuple[int, Row]], live: dict) -> None:
        """Each finished sample to the reward function: its response decoded (multi-turn: tool messages
        included, as the synchronous trainer scores trajectories)."""
        items = [self.train_set[live[uid]["prompt"]] for uid, _ in finished]
        scoring.submit([(uid, r.sample) for uid, r in finished], [it["data_source"] for it in items],
                       decode_texts(self.tokenizer, [r.response_ids for _, r in finished]),
                       [it["ground_truth"] for it in items], [it.get("extra_info") for it in items])

    def collect(self, scoring: ScoringStream, live: dict) -> int:
        """Scores that came back: groups whose samples are all scored go on the bus. Returns how many came."""
        scores, stats = scoring.take()
        for (uid, j), score in scores.items():
            live[uid]["scores"][j] = score
        self.check_rewards(stats)
        for k, v in reward_metrics(stats).items():
            self.unreported[k] = self.unreported.get(k, 0.0) + v
        done = [uid for uid in {uid for uid, _ in scores} if all(x is not None for x in live[uid]["scores"])]
        if done:
            self.publish([(uid, live.pop(uid)) for uid in done])
        return len(scores)

    def check_rewards(self, stats: dict) -> None:
        error = failure_error(stats, self.scorer.max_failure_ratio) if stats.get("num_items") else None
        if error is not None:
            raise error

    def publish(self, done: list[tuple[int, dict]]) -> None:
        """Put each scored group on the bus; the first carries the reward counters not reported yet. A trajectory
        that scored itself (an environment) keeps its reward."""
        counts, self.unreported = self.unreported, {}
        with trace.span("publish", groups=len(done)):
            self._publish(done, counts)

    def _publish(self, done: list[tuple[int, dict]], counts: dict[str, float]) -> None:
        for k, (uid, g) in enumerate(done):
            group = g["rows"]
            set_rule_scores(group, g["scores"])
            compose(group, None, self.shaping)  # no learned score here: a reward model scores on the training pool
            meta = self.describe(uid, g["prompt"], group)
            meta.stats.update(counts if k == 0 else {})  # the reward counters, once
            if self.agents is not None:  # for the step's agent/* metrics
                meta.stats["agent"] = [r.agent for r in group]
            self.coord.put(GroupReady(meta))
