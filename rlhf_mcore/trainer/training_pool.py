"""The asynchronous trainers' training pool: its link to the rollout pool (commands, the coordinator's message
pump, the weight push, pulling groups, validation on the rollout pool) and what both modes do with a step's groups.

The torchrun world is split (:mod:`rlhf_mcore.parallel.pools`): training ranks run the loops of
:mod:`rlhf_mcore.trainer.loops`, rollout ranks run :class:`rlhf_mcore.trainer.rollout_worker.RolloutWorker`.
Training rank 0 is the coordinator: it draws prompts, tells the rollout ranks what to do
(:mod:`rlhf_mcore.trainer.messages`), keeps the data bus's ledger (metadata only) and broadcasts to the training
ranks which groups to pull from which producer.

Policy versions: version v is the actor after v training steps. A group's staleness at step s is
(s - 1) - its oldest token's version.

Rewards: the rollout pool scores every sample with the rule functions (plus DAPO's overlong penalty) as it streams
them. A discriminative reward model (`reward_model.enable`) lives on the training pool, sharded like the critic:
each step, after its rows arrive over the data bus and before the forward passes, every data-parallel replica scores
its own rows and the reward pipeline composes them as the synchronous trainer's (:meth:`TrainingPool.to_batch`).
With `reward_model.megatron.param_offload` its weights are on the host except while it scores, so the training pool
alternates reward-model scoring and the actor's update without holding both on the device.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from rlhf_mcore import trace
from rlhf_mcore.parallel.collectives import broadcast_object
from rlhf_mcore.parallel.pools import Pools
from rlhf_mcore.rewards.pipeline import OverlongShaping, compose
from rlhf_mcore.sync import broadcast_weights
from rlhf_mcore.trainer.databus import GroupMeta, Ledger, pull, pull_orders
from rlhf_mcore.trainer.hooks import PhaseTimer
from rlhf_mcore.trainer.messages import GroupReady, StepStats, Stop, Validate, ValResult, Weights, unknown
from rlhf_mcore.trainer.stats import rollout_gap_metrics
from rlhf_mcore.trainer.step_batch import rows_to_batch

WAIT_TIMEOUT_S = 1800.0  # the coordinator's longest wait for a message of the rollout pool (then TimeoutError)


def dp_rank_table(state) -> list[list[int]]:
    """Every training rank together: the training ranks of each DP rank."""
    ranks = [None] * state.world_size
    dist.all_gather_object(ranks, state.dp_rank, group=state.cpu_group)
    return [[g for g, d in enumerate(ranks) if d == dp] for dp in range(state.dims.dp)]


class TrainingPool:
    """A training rank's side of the pools; the coordinator's bookkeeping (ledger, trained and dropped prompts)
    is checkpointed (:meth:`state_dict`)."""

    def __init__(self, run, pools: Pools, dp_ranks: list[list[int]], reward_model=None):
        """`dp_ranks[d]`: the training ranks of DP rank d (:func:`dp_rank_table`)."""
        self.run, self.pools, self.dp_ranks, self.reward_model = run, pools, dp_ranks, reward_model
        self.layout = pools.layout
        self.coord_box = pools.mailbox("coord") if run.state.is_coordinator else None
        self.ledger = Ledger()
        self.pushed_version = -1
        self.stats: dict[int, dict] = {}  # one_step_off: StepStats that arrived before they were needed
        self.val: dict[int, ValResult] = {}
        self.trained_prompts: list[int] = []  # dataset indices, every step's, in order (kept in checkpoints)
        self.dropped_prompts: list[int] = []  # fully_async: prompts whose groups were dropped as stale
        self.on_message: Callable[[], None] = lambda: None  # the coordinator, after each message it takes

    # ------------------------------------------------------------------------------------------- coordinator
    def command(self, msg, ranks: Optional[list[int]] = None) -> None:
        """Coordinator: append `msg` to the mailboxes of `ranks` (default: every rollout rank)."""
        for r in ranks if ranks is not None else self.layout.rollout_ranks:
            self.pools.mailbox(f"rank{r}").put(msg)

    def pump(self, until: Callable[[], bool], what: str) -> float:
        """Coordinator: take messages from the rollout pool until `until()`, calling `on_message` after each;
        returns the seconds spent waiting."""
        with trace.span("take messages", what=what) as s:
            self._pump(until, what)
        return s.seconds

    def _pump(self, until: Callable[[], bool], what: str) -> None:
        while not until():
            try:
                msg = self.coord_box.get(timeout_s=WAIT_TIMEOUT_S)
            except RuntimeError as e:  # the store's wait timed out
                raise TimeoutError(f"the coordinator waited {WAIT_TIMEOUT_S:.0f} s for {what} and the rollout pool "
                                   f"sent nothing: look for a failed or stuck rollout rank above ({e})") from None
            match msg:
                case GroupReady(meta):
                    self.ledger.add(meta)
                case StepStats(step, metrics):
                    self.stats[step] = metrics
                case ValResult(step=step):
                    self.val[step] = msg
                case _:
                    raise unknown(msg, "the coordinator")
            self.on_message()

    def push_weights(self, actor, version: int) -> dict[str, float]:
        """The actor's weights (`version`) to every rollout rank: all training ranks export (a collective),
        training rank 0 broadcasts over the weights link."""
        r = self.run.cfg.actor_rollout_ref.rollout
        if self.run.state.is_coordinator:
            self.command(Weights(version))
            with trace.span("broadcast weights", version=version):
                metrics = broadcast_weights(self.pools.weights, 0, actor.export_hf_weights(),
                                            bucket_mb=r.sync_bucket_mb, device=self.pools.weights.device,
                                            checksums=r.sync_verify)
        else:
            for _ in actor.export_hf_weights():
                pass
            metrics = {}
        self.pushed_version = version
        return broadcast_object(metrics, group=self.run.state.cpu_group)

    def validate(self, actor) -> dict[str, float]:
        """Validation on the rollout pool, with the actor's current weights (pushed first when the rollout
        does not have them)."""
        run = self.run
        if run.val_set is None:
            return {}
        if self.pushed_version != run.step:
            self.push_weights(actor, run.step)
        metrics = None
        if run.state.is_coordinator:
            self.command(Validate(run.step))
            self.pump(lambda: run.step in self.val, "validation")
            result = self.val.pop(run.step)
            metrics = result.metrics
            run.log_validation(metrics, result.samples)
        return broadcast_object(metrics, group=run.state.cpu_group)

    def stop(self) -> None:
        if self.run.state.is_coordinator:
            self.command(Stop())

    # ------------------------------------------------------------------------------------------- every rank
    def pull_groups(self, chosen: Optional[list[list[GroupMeta]]], info: Optional[dict]) -> tuple[list, list, dict]:
        """Every training rank: the coordinator's choice (groups per DP rank) and step info broadcast, then this
        rank's groups pulled from their producers. Returns (groups of rows, their dataset indices, info)."""
        cpu = self.run.state.cpu_group
        orders, info = broadcast_object((pull_orders(chosen), info) if chosen is not None else None, group=cpu)
        mine = orders[self.run.state.dp_rank]
        with trace.span("data-bus pull", step=self.run.step, groups=len(mine), bytes=sum(o[2] for o in mine)) as s:
            groups = pull(self.pools.bus, mine)
        info["timing_s/pull"] = s.seconds
        prompts = broadcast_object([[m.prompt for m in part] for part in chosen] if chosen is not None else None,
                                   group=cpu)[self.run.state.dp_rank]
        return groups, prompts, info

    def to_batch(self, groups: list[list], prompts: list[int], info: dict, t: PhaseTimer,
                 greedy_baseline: bool = False) -> tuple[dict[str, Any], list]:
        """This rank's groups as the padded batch (`prompts[pos]`: group pos's dataset index), each row's reward
        the rollout pool's composition or, with a reward model, composed again with the model's score (metrics
        into `info`), and `staleness` (B,): the trainer's policy before this step's update less each row's
        oldest token's version. Returns the batch and its rows."""
        rows = []
        for pos, group in enumerate(groups):
            for r in group:
                r.prompt_pos = pos
                rows.append(r)
        if self.reward_model is not None:
            with t("reward_model"):
                items = [self.run.train_set[p] for p in prompts]
                info.update(compose(rows, items, OverlongShaping.from_config(self.run.cfg),
                                    learned=self.reward_model, local=True))
        batch = rows_to_batch(rows, prompts, self.run.train_set, self.run.tokenizer.pad_token_id, greedy_baseline)
        version = self.run.step - 1  # the trainer's policy before this step's update
        batch["staleness"] = torch.tensor([version - min(r.versions) for r in rows])  # (B,)
        return batch, rows

    def step_metrics(self, batch: dict[str, Any], info: dict, prompts: list[int]) -> dict[str, float]:
        """The step info's metrics, the same-version rollout gap (`rollout/same_version/*`, when every rank has
        samples of the trainer's own version) and the step's prompts recorded (every DP rank's, in order)."""
        state = self.run.state
        out = {k: v for k, v in info.items() if isinstance(v, float)}
        fresh = batch["staleness"] == 0  # samples from the trainer's current weights: the gap is numerics only
        gap = None
        if "old_entropy" in batch and bool(fresh.any()):
            gap = rollout_gap_metrics(batch["rollout_log_probs"][fresh], batch["old_log_probs"][fresh],
                                      batch["response_mask"][fresh].float())
        has = torch.tensor([1.0 if gap else 0.0])
        if dist.get_world_size(state.cpu_group) > 1:
            dist.all_reduce(has, op=dist.ReduceOp.MIN, group=state.cpu_group)
        if gap and has.item() > 0:  # every rank has same-version samples: the key set is the same everywhere
            out.update({k.replace("rollout/", "rollout/same_version/"): v for k, v in gap.items()})
        ids = [None] * state.world_size
        dist.all_gather_object(ids, (state.dp_rank, prompts), group=state.cpu_group)
        seen = {}
        for dp, part in ids:
            seen.setdefault(dp, part)
        self.trained_prompts += [p for dp in sorted(seen) for p in seen[dp]]
        return out

    # ------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"trained_prompts": self.trained_prompts, "dropped_prompts": self.dropped_prompts,
                "ledger": self.ledger.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trained_prompts = list(state["trained_prompts"])
        self.dropped_prompts = list(state["dropped_prompts"])
        self.ledger.load_state_dict(state["ledger"])
