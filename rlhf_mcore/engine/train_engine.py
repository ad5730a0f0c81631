"""The train engine: Megatron model chunks + DDP + optimizer + LR schedule, driven by RL batches.

One class serves the three roles of a PPO run:

- `actor`: `compute_log_probs` (old-policy log-probs and entropy, forward-only) and `update_policy` (policy
  loss + entropy bonus + KL loss, `ppo_epochs` × mini-batches × micro-batches);
- `critic`: `compute_values` and `update_critic` (clipped value loss);
- `ref`: the same model frozen, forward-only, no DDP, no optimizer.

Every call takes one DP rank's share of the batch (the coordinator has already balanced tokens across DP
ranks with :func:`rlhf_mcore.engine.balance.partition_balanced`); all ranks of a TP × PP model replica pass the
same batch. Forward-only results come back on every rank of the replica (broadcast from the last pipeline
stage). Micro-batches go through `megatron.core.pipeline_parallel.get_forward_backward_func`, so pipeline
schedules (interleaved with virtual stages) work unchanged. Loss normalisation across micro-batches and DP
ranks: see :mod:`rlhf_mcore.engine.losses`.
"""
from __future__ import annotations

import dataclasses
import math
import time
from contextlib import ExitStack, nullcontext
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from rlhf_mcore.engine import checkpoint as ckpt
from rlhf_mcore.engine.config import EngineConfig
from rlhf_mcore.engine.cuda_graphs import AUTO_MAX_TOKENS, DecoderGraphs, graphs_supported, static_shape
from rlhf_mcore.engine.flops import FlopShape, mfu, peak_flops, train_flops
from rlhf_mcore.engine.losses import (
    ACTOR_KEYS,
    CRITIC_KEYS,
    ON_POLICY_KEYS,
    LossContext,
    actor_loss,
    critic_loss,
    reduce_metrics,
    score_tokens,
    token_values,
)
from rlhf_mcore.engine.micro_batches import (
    MicroBatch,
    batch_size_of,
    make_micro_batches,
    plan_micro_batches,
    response_length_of,
    select_rows,
)
from rlhf_mcore.engine.offload import StorageOffloader, grad_storages, optimizer_storages, param_storages
from rlhf_mcore.engine.optim import (
    build_optimizer,
    build_scheduler,
    current_lr,
    ensure_tp_attributes,
    use_fused_adam,
    wrap_ddp,
)
from rlhf_mcore.engine.scored_rows import ScoredRowsHead, head_unsupported
from rlhf_mcore.models.fp8_training import invalidate_weight_amaxes, roll_activation_amaxes
from rlhf_mcore.trace import span

__all__ = ["TrainEngine"]


class TrainEngine:
    """Megatron chunks (one per virtual pipeline stage, as `rlhf_mcore.models.build_model` returns them)
    wrapped for training (`actor`, `critic`) or frozen for scoring (`ref`).

    The output layer runs only on the rows that predict response tokens (:mod:`rlhf_mcore.engine.scored_rows`):
    every loss and forward pass here reads the output there and nowhere else. A subclass whose loss reads other
    positions sets `SCORES_RESPONSE_ROWS = False`.

    Args:
        chunks: the unwrapped GPTModel chunks of this rank.
        state: the rank's :class:`~rlhf_mcore.parallel.ParallelState`.
        cfg: batching, loss and scoring settings (:class:`EngineConfig`).
        optim: an :class:`rlhf_mcore.config.OptimConfig` (required for actor and critic; none for ref; a reward
            engine without one is frozen).
        use_distributed_optimizer: shard optimizer state and master weights over DP (ZeRO-1).
        vocab_size: the real vocabulary (without Megatron's padding); defaults to the chunks' `hf_shape`
            (set by `build_model`), else the GPTModel's (padded) `vocab_size`.
        hf_dir: the Hugging Face directory the model came from (for `save_hf`); defaults to the chunks' `hf_dir`.
        param_offload, grad_offload, optimizer_offload: the role's `megatron.*_offload` config flags: what the
            trainer moves off the device around generation (:func:`rlhf_mcore.trainer.roles.colocated_rollout`);
            `param_offload` is also what :meth:`offload` does with parameters when not told.
    """

    SCORES_RESPONSE_ROWS = True  # the losses read the output only at `ModelInputs.rows` (see the class docstring)

    def __init__(self, chunks: list[torch.nn.Module], state, cfg: EngineConfig, optim=None, *,
                 use_distributed_optimizer: bool = True, vocab_size: Optional[int] = None,
                 hf_dir: Optional[str] = None, param_offload: bool = False, grad_offload: bool = False,
                 optimizer_offload: bool = False):
        if not chunks:
            raise ValueError("TrainEngine needs at least one model chunk")
        self.state, self.cfg = state, cfg
        ensure_tp_attributes(chunks)
        self.model_config = chunks[0].config
        if getattr(self.model_config, "calculate_per_token_loss", False):
            raise ValueError("the engine normalises losses itself (rlhf_mcore.engine.losses); build the model with "
                             "TransformerConfig.calculate_per_token_loss=False")
        if len(chunks) > 1 and state.dims.pp == 2:
            # megatron-core's batched p2p posts send_prev/recv_prev/send_next/recv_next in one order on both
            # ranks; at PP=2 prev == next, so the interleaved schedule's 4-way exchanges pair an activation
            # with a gradient (silently wrong when shapes agree). The unbatched path pairs them correctly.
            self.model_config.batch_p2p_comm = False
        hf_shape = getattr(chunks[0], "hf_shape", None)
        self.vocab_size = vocab_size or (hf_shape.vocab_size if hf_shape is not None else None) or getattr(
            chunks[-1], "vocab_size", None)
        self.hf_dir = hf_dir or getattr(chunks[0], "hf_dir", None)
        self.param_offload, self.grad_offload, self.optimizer_offload = param_offload, grad_offload, optimizer_offload
        # packed total / padded length must split evenly over TP ranks under sequence parallelism
        self._pad_multiple = state.dims.tp if getattr(self.model_config, "sequence_parallel", False) else 1
        self._explicit_mask = state.device.type != "cuda"  # Megatron's default causal mask is CUDA-only
        if cfg.share_prompt_prefix:
            _check_shared_prefix(chunks, cfg, state)
        # the critic ends in a width-1 value head, not the vocabulary projection
        head_width = 1 if cfg.role == "critic" else (self.vocab_size or 0)
        self.flop_shape = FlopShape.from_transformer_config(self.model_config, head_width)
        self.peak_flops = peak_flops(state.device)
        self.optimizer = self.scheduler = None
        if cfg.role == "ref" or (cfg.role == "reward" and optim is None):  # frozen, forward-only
            for c in chunks:
                c.requires_grad_(False)
                c.eval()
            self.modules = list(chunks)
        else:
            if optim is None:
                raise ValueError(f"a {cfg.role} engine trains: pass optim (rlhf_mcore.config.OptimConfig)")
            self.modules = wrap_ddp(chunks, use_distributed_optimizer)
            self.optimizer = build_optimizer(self.modules, optim, use_distributed_optimizer, cfg.grad_clip)
            self.scheduler = build_scheduler(self.optimizer, optim)
        self.global_steps = 0
        self._offloader = StorageOffloader(state.device)
        self._graphs = self._build_graphs(chunks)
        # the output layer on the scored rows (decided for the model, so that every stage counts the same FLOPs);
        # wrapped on the stage that holds it
        self._rows_only = self.SCORES_RESPONSE_ROWS and all(head_unsupported(c) is None for c in chunks)
        self._heads = [ScoredRowsHead(c) for c in chunks if self._rows_only and getattr(c, "post_process", False)
                       and getattr(c, "output_layer", None) is not None]

    def _build_graphs(self, chunks) -> list[DecoderGraphs]:
        """CUDA graphs of the decoder (:mod:`rlhf_mcore.engine.cuda_graphs`): `cfg.cuda_graphs` None turns them
        on where supported, True requires them, False leaves them off."""
        if self.cfg.cuda_graphs is False:
            return []
        why_not = graphs_supported(self.model_config, self.state, len(chunks), self.cfg.use_remove_padding)
        if why_not is None and self.cfg.share_prompt_prefix:
            why_not = "shared-prompt packing (model.share_prompt_prefix) gives every micro-batch its own layout"
        if why_not is None:
            return [DecoderGraphs(c, required=bool(self.cfg.cuda_graphs), key=self.cfg.graph_key) for c in chunks]
        if self.cfg.cuda_graphs:
            raise ValueError(f"{self.cfg.graph_key}=true, but CUDA graphs cannot run here: {why_not}. Set it to "
                             "false (or leave it unset: on where supported)")
        return []

    # ------------------------------------------------------------------ views

    @property
    def chunks(self) -> list[torch.nn.Module]:
        """The bare GPTModel chunks (unwrapped from DDP), e.g. for exporting weights."""
        return [getattr(m, "module", m) for m in self.modules]

    @property
    def _multiple_of(self) -> int:
        # the interleaved schedule runs micro-batches in groups of PP per virtual stage
        return self.state.dims.pp if len(self.modules) > 1 else 1

    # ------------------------------------------------------------------ forward-only

    @torch.no_grad()
    def compute_log_probs(self, batch: dict, with_entropy: Optional[bool] = None, record_routes: bool = False):
        """Log-probs and entropy of the response tokens under `softmax(logits / temperature)`.

        Returns `(log_probs (B, R), entropy (B, R) or None)`, fp32, zero where the response is padding, on
        every rank of the model replica, on the device of `batch["input_ids"]`. `with_entropy` defaults to True
        for the actor, False for the ref. Under routing replay (`cfg.router_replay`, :func:`routes.replay_key`) the
        MoE layers take the batch's routes. `record_routes` (a MoE model built with routing replay): a third
        element, the (B, L, n, k) expert ids this rank's MoE layers picked from their own scores (another pipeline
        stage's layers hold filler routes; :mod:`rlhf_mcore.engine.routes`).
        """
        if self.cfg.role in ("critic", "reward"):
            raise RuntimeError(f"a {self.cfg.role} engine has no log-probs (its head is a width-1 score)")
        if record_routes and self.moe_shape is None:
            raise ValueError("record_routes=True needs a mixture-of-experts model (this one has no routers)")
        with_entropy = self.cfg.role == "actor" if with_entropy is None else with_entropy
        keys = ("log_probs", "entropy") if with_entropy else ("log_probs",)

        def collect(output, mb: MicroBatch):
            lp, ent = score_tokens(output, mb.inputs, self.cfg, self.state.tp_group, self.vocab_size, with_entropy)
            return {"log_probs": lp, "entropy": ent} if with_entropy else {"log_probs": lp}

        out = self._forward_only(batch, collect, keys, self._replay_key("forward", batch), record_routes)
        if record_routes:
            return out["log_probs"], out.get("entropy"), out["routes"]
        return out["log_probs"], out.get("entropy")

    # ------------------------------------------------------------------ routing replay (MoE)

    @property
    def moe_shape(self):
        """The model's `ModelShape` when it is a mixture-of-experts model, else None."""
        shape = getattr(self.chunks[0], "hf_shape", None)
        return shape if shape is not None and shape.is_moe else None

    @property
    def local_moe_layers(self) -> list[int]:
        """The indices (among the model's MoE layers) of this rank's MoE layers: what its routes record."""
        from rlhf_mcore.models.routing_replay import chunk_routers

        return sorted(j for c in self.chunks for j, _ in chunk_routers(c))

    def _replay_key(self, phase: str, batch: dict) -> Optional[str]:
        """The batch key whose routes this pass replays (:func:`routes.replay_key`), checked to be there."""
        from rlhf_mcore.engine.routes import replay_key

        key = replay_key(self.cfg.router_replay, self.cfg.role, phase)
        if key is not None and key not in batch:
            raise KeyError(f"actor_rollout_ref.actor.router_replay.mode={self.cfg.router_replay} replays the batch's "
                           f"'{key}' in the {self.cfg.role}'s {phase} pass, but the batch has none (R3: the rollout "
                           f"records them with rollout.enable_rollout_routing_replay; R2: the old-log-prob pass)")
        return key

    @torch.no_grad()
    def compute_values(self, batch: dict) -> torch.Tensor:
        """The critic's values `(B, R)` at the positions that predict each response token (veRL's
        convention: the value of the state before the token); zero on padding."""
        if self.cfg.role != "critic":
            raise RuntimeError(f"compute_values needs a critic engine, this one is {self.cfg.role!r}")
        return self._forward_only(batch, lambda out, mb: {"values": token_values(out, mb.inputs)}, ("values",))[
            "values"]

    def _forward_only(self, batch: dict, collect, keys, replay_key: Optional[str] = None,
                      record_routes: bool = False) -> dict[str, torch.Tensor]:
        self._require_onloaded()
        home = batch["input_ids"].device  # results go back where the batch lives (the trainer keeps it on CPU)
        batch = self._to_device(batch)
        B, R = batch_size_of(batch), response_length_of(batch)
        seqlens = batch["attention_mask"].sum(-1).tolist()
        cfg = self.cfg
        shared = cfg.share_prompt_prefix
        plan = plan_micro_batches(seqlens, micro_batch_size=cfg.fwd_micro_batch_size,
                                  use_dynamic_bsz=cfg.fwd_use_dynamic_bsz, max_token_len=cfg.fwd_max_token_len,
                                  multiple_of=self._multiple_of, dp_group=self.state.dp_group, keys=cfg.forward_keys,
                                  shared_prefix_of=batch if shared else None)
        mbs = make_micro_batches(batch, plan, keys=(), packed=self.cfg.use_remove_padding,
                                 pad_to_multiple_of=self._pad_multiple, explicit_mask=self._explicit_mask,
                                 uniform_shape=self.state.dims.pp > 1,
                                 static_shape=self._static_shape(plan, seqlens, grad=False), routes_key=replay_key,
                                 share_prompt_prefix=shared)
        for m in self.modules:
            m.eval()

        def loss_func(mb, output):
            out = collect(output, mb)
            out["index"] = mb.index
            return torch.zeros((), device=output.device), out

        results = self._run_schedule(mbs, loss_func, forward_only=True, record_routes=record_routes)
        out = self._gather_grids(results, keys, B, R)
        if record_routes:
            out["routes"] = self._gather_recorded(batch, mbs)
        return {k: v.to(home) for k, v in out.items()}

    def _gather_grids(self, results: list[dict], keys, B: int, R: int) -> dict[str, torch.Tensor]:
        """The micro-batches' per-token `keys` (rows `index`) as (B, R) fp32 grids on every pipeline stage."""
        out = {k: torch.zeros(B, R, dtype=torch.float32, device=self.state.device) for k in keys}
        if self.state.is_last_stage:
            for r in results:
                for k in keys:
                    out[k].index_copy_(0, r["index"], r[k].float())
        self._broadcast_from_last_stage(list(out.values()))
        return out

    def _gather_recorded(self, batch: dict, mbs: list[MicroBatch]) -> torch.Tensor:
        """The routes the micro-batches recorded, as the batch layout (B, L, n, k)."""
        from rlhf_mcore.engine.routes import from_router_order
        from rlhf_mcore.models.routing_replay import route_dtype

        shape = self.moe_shape
        mask = batch["attention_mask"]
        n, k, dtype = len(shape.moe_layers), shape.moe_top_k, route_dtype(shape.num_experts)
        routes = torch.empty(*mask.shape, n, k, dtype=dtype, device=mask.device)
        for mb in mbs:
            routes[mb.index] = from_router_order(mb.recorded, mask.index_select(0, mb.index), mb.inputs, n, k, dtype)
        return routes

    # ------------------------------------------------------------------ training

    def update_policy(self, batch: dict, on_policy: bool = False) -> dict[str, float]:
        """The actor's PPO update (see :meth:`update`)."""
        if self.cfg.role != "actor":
            raise RuntimeError(f"update_policy needs an actor engine, this one is {self.cfg.role!r}")
        return self.update(batch, on_policy=on_policy)

    def update_critic(self, batch: dict, on_policy: bool = False) -> dict[str, float]:
        """The critic's value update (see :meth:`update`)."""
        if self.cfg.role != "critic":
            raise RuntimeError(f"update_critic needs a critic engine, this one is {self.cfg.role!r}")
        return self.update(batch, on_policy=on_policy)

    def on_policy_rows(self, batch_size: int) -> torch.Tensor:
        """The rows (of this rank's `batch_size`) of the update's first mini-batch: its forward, before any
        optimizer step, runs the model an old-log-prob (values) pass would run (:meth:`update`'s `on_policy`). The
        whole batch when the update is one mini-batch; a long tensor on the engine's device, in the update's
        order."""
        return self._epoch_order(batch_size, 0)[:self.cfg.mini_batch_size or batch_size]

    def update(self, batch: dict, on_policy: bool = False) -> dict[str, float]:
        """One PPO update on this rank's batch: `ppo_epochs` × mini-batches, one optimizer step each, then one
        LR-scheduler step. Returns metrics averaged over the optimizer steps (identical on every rank).

        `on_policy`: the first mini-batch of the first epoch (:meth:`on_policy_rows`) runs before any optimizer
        step, so its loss takes its own outputs, detached, as the old ones -- an actor's log-probs (the old
        log-probs), a critic's values (the old values its clipped loss reads): what the forward pass computes, so
        the same loss and gradient without the pass over those rows -- and they go into `batch` at those rows as
        the role's `ON_POLICY_KEYS` (the actor's `old_log_probs` and `old_entropy`, the critic's `values`, (B,
        R)), where the pass would have put them (the batch's own there are not read; the batch needs none when the
        first mini-batch is all of it). Later mini-batches and epochs read the batch's, those rows included."""
        if self.optimizer is None:
            raise RuntimeError(f"the {self.cfg.role} engine is frozen (built without an optimizer); it has no update")
        self._require_onloaded()
        self._sync_device()
        start = time.perf_counter()
        caller, batch = batch, self._to_device(batch)
        B = batch_size_of(batch)
        mini = self.cfg.mini_batch_size or B
        if B % mini:
            raise ValueError(f"this rank's batch of {B} sequences is not divisible by the mini-batch size {mini} "
                             "(ppo_mini_batch_size × rollout.n / DP): make the batch a multiple of it")
        if on_policy and self.cfg.role not in ON_POLICY_KEYS:
            raise ValueError(f"an on-policy update takes an actor's own log-probs or a critic's own values as the old "
                             f"ones; this is a {self.cfg.role} engine: update with on_policy=False")
        own_keys = ON_POLICY_KEYS.get(self.cfg.role, ())
        lr = current_lr(self.optimizer)
        captures = self.graph_captures
        steps, flops, tokens = [], 0.0, 0
        for epoch in range(self.cfg.ppo_epochs):
            order = self._epoch_order(B, epoch)
            for first in range(0, B, mini):
                with span(f"{self.cfg.role} mini-batch", epoch=epoch, index=first // mini,  # the run's trace
                          sequences=mini) as s:
                    sub = select_rows(batch, order[first:first + mini])
                    own = on_policy and epoch == 0 and first == 0  # no optimizer step yet: the old policy
                    metrics, seqlens = self.forward_backward(sub, own)
                    if own:  # its rows' old outputs, for later epochs and the caller
                        rows = order[:mini]
                        for k in own_keys:
                            grid = batch.get(k)
                            grid = sub[k].new_zeros((B, *sub[k].shape[1:])) if grid is None else grid
                            batch[k] = grid.to(sub[k].dtype).index_copy(0, rows, sub[k])
                    if math.isfinite(metrics.get("loss", 0.0)):
                        ok, grad_norm, _ = self.optimizer.step()
                        invalidate_weight_amaxes(self.chunks)  # FP8 tensorwise: W changed
                    else:  # a NaN/inf loss (reduced, so every rank agrees) poisons the gradients: skip this step
                        ok, grad_norm = False, None
                    roll_activation_amaxes(self.chunks)  # FP8 delayed scaling: this step's amaxes enter the history
                    s.args.update(micro_batches=int(metrics.get("num_micro_batches", 0)), tokens=sum(seqlens))
                metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
                metrics["update_skipped"] = 0.0 if ok else 1.0
                steps.append(metrics)
                flops += train_flops(self.flop_shape, seqlens, metrics.pop("head_rows", None))
                tokens += sum(seqlens)
        if on_policy:
            for k in own_keys:
                caller[k] = batch[k].to(caller["input_ids"].device)
        self.scheduler.step(1)
        self.global_steps += 1
        self._sync_device()
        elapsed = time.perf_counter() - start
        out = self._summarise(steps, lr, elapsed, flops, tokens)
        if getattr(self.chunks[0], "hf_shape", None) is not None and self.chunks[0].hf_shape.is_moe:
            from rlhf_mcore.models.moe import moe_loss_metrics

            out.update(moe_loss_metrics(self.state, self.cfg.role, int(sum(s["num_micro_batches"] for s in steps))))
        if self._graphs:
            out[f"perf/{self.cfg.role}/cuda_graph_captures"] = float(self.graph_captures - captures)
        return out

    def forward_backward(self, mini_batch: dict, on_policy: bool = False) -> tuple[dict[str, float], list[int]]:
        """Zero the gradients, then accumulate those of the loss of `mini_batch` (this rank's share) over its
        micro-batches; reduced over DP at the end (Megatron's finalize_model_grads). No optimizer step.

        Returns the mini-batch's metrics (identical on every rank) and the sequence lengths it processed; with the
        output layer on the scored rows only, `metrics["head_rows"]` is this rank's count of them (for the FLOPs).
        `on_policy` (see :meth:`update`): the loss's old log-probs (values) are its own, detached; they go into
        `mini_batch` as the role's `ON_POLICY_KEYS` (b, R).
        """
        self._require_onloaded()
        state, cfg = self.state, self.cfg
        sub = self._to_device(mini_batch)
        keys, loss_fn = self.loss_inputs(sub)
        own_keys = ON_POLICY_KEYS[cfg.role] if on_policy else ()
        keys = tuple(k for k in keys if k not in own_keys)
        mask = sub["response_mask"]  # (b, R)
        counts = torch.stack([mask.sum(), (mask.sum(-1) > 0).sum()]).to(torch.float64)  # (2,) tokens, sequences
        if state.dims.dp > 1:
            dist.all_reduce(counts, group=state.dp_group)
        seqlens = [int(s) for s in sub["attention_mask"].sum(-1).tolist()]
        shared = cfg.share_prompt_prefix
        plan = plan_micro_batches(seqlens, micro_batch_size=cfg.micro_batch_size, use_dynamic_bsz=cfg.use_dynamic_bsz,
                                  max_token_len=cfg.max_token_len, multiple_of=self._multiple_of,
                                  dp_group=state.dp_group, keys=cfg.update_keys,
                                  shared_prefix_of=sub if shared else None)
        mbs = make_micro_batches(sub, plan, keys=keys, packed=cfg.use_remove_padding,
                                 pad_to_multiple_of=self._pad_multiple, explicit_mask=self._explicit_mask,
                                 uniform_shape=self.state.dims.pp > 1,
                                 static_shape=self._static_shape(plan, seqlens, grad=True),
                                 routes_key=self._replay_key("update", sub), share_prompt_prefix=shared)
        ctx = LossContext(cfg, state.tp_group, self.vocab_size, global_tokens=counts[0], global_seqs=counts[1],
                          scale=float(len(mbs) * state.dims.dp), on_policy=on_policy)
        for m in self.modules:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        for m in self.modules:
            m.train()
        per_micro = self._run_schedule(mbs, lambda mb, out: loss_fn(out, mb, ctx), forward_only=False)
        if on_policy:  # the per-token outputs out of the metrics, as (b, R) grids
            tokens = [{k: d.pop(k) for k in ("index", *own_keys)} for d in per_micro]
            mini_batch.update(self._gather_grids(tokens, own_keys, len(seqlens), response_length_of(sub)))
        metrics = reduce_metrics(per_micro, sum_groups=[state.dp_group], src_group=state.pp_group,
                                 src_has_data=state.is_last_stage, device=state.device)
        metrics["num_micro_batches"] = float(len(mbs))
        if self._rows_only:  # the output layer ran on the scored rows only: what the FLOP count takes for it
            metrics["head_rows"] = sum(int(mb.inputs.rows.numel()) for mb in mbs)
        if shared:  # the tokens computed: each prompt once per micro-batch (the FLOP count and tokens/s take these;
            # a response's attention to its prompt is left out of the FLOPs: the count errs low)
            seqlens = [n for mb in mbs for n in mb.inputs.seqlens]
        return metrics, seqlens

    def loss_inputs(self, batch: dict) -> tuple[tuple[str, ...], object]:
        """The (b, R) batch keys the loss reads and the loss, `loss(output, micro_batch, ctx) -> (loss, metrics)`
        (see :mod:`rlhf_mcore.engine.losses`). A subclass with another objective overrides this."""
        if self.cfg.role == "critic":
            return CRITIC_KEYS, critic_loss
        if self.cfg.role != "actor":
            raise RuntimeError(f"a {self.cfg.role} engine has no built-in loss; subclass TrainEngine.loss_inputs")
        keys = ACTOR_KEYS
        if self.cfg.use_kl_loss:
            keys = keys + ("ref_log_prob",)
        if "rollout_is_weights" in batch:  # algorithm.rollout_correction.rollout_is
            keys = keys + ("rollout_is_weights",)
        return keys, actor_loss

    def _epoch_order(self, n: int, epoch: int) -> torch.Tensor:
        if not self.cfg.shuffle:
            return torch.arange(n, device=self.state.device)
        # the same permutation on every rank of a replica (they hold the same batch)
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.global_steps * 1009 + epoch)
        return torch.randperm(n, generator=g).to(self.state.device)

    def _summarise(self, steps: list[dict], lr: float, elapsed: float, flops: float, tokens: int) -> dict[str, float]:
        role, state = self.cfg.role, self.state
        keys = sorted({k for s in steps for k in s})
        out = {f"{role}/{k}": sum(s.get(k, 0.0) for s in steps) / len(steps) for k in keys if k != "n_tokens"}
        totals = torch.tensor([flops, float(tokens)], dtype=torch.float64, device=state.device)
        if state.dims.dp > 1:  # each replica counted its own share; the model's FLOPs span TP × PP ranks
            dist.all_reduce(totals, group=state.dp_group)
        if "ppo_kl" in steps[0]:  # before the first optimizer step the policy is the old one: numerics only
            out[f"{role}/ppo_kl_first_minibatch"] = steps[0]["ppo_kl"]
        out[f"{role}/lr"] = lr
        out[f"{role}/num_optimizer_steps"] = float(len(steps))
        out[f"perf/{role}/update_s"] = elapsed
        out[f"perf/{role}/tokens_per_s"] = float(totals[1]) / elapsed
        out[f"perf/{role}/tflops_per_gpu"] = float(totals[0]) / elapsed / state.world_size / 1e12
        util = mfu(float(totals[0]), elapsed, state.world_size, self.peak_flops)
        if util is not None:
            out[f"perf/{role}/mfu"] = util
        return out

    # ------------------------------------------------------------------ the pipeline schedule

    def _static_shape(self, plan: list[list[int]], seqlens: list, grad: bool) -> Optional[tuple[int, int, int]]:
        """The one packed shape of this call's micro-batches when the decoder runs as CUDA graphs, else None: a
        graph already captured for a slightly larger shape is reused (`DecoderGraphs.reuse`)."""
        if not self._graphs or self._graphs[0].failed:  # no graphs, or a capture failed here: eager, unpadded
            return None
        totals = [sum(int(seqlens[i]) for i in rows) for rows in plan]
        if self.cfg.cuda_graphs is None and max(totals) > AUTO_MAX_TOKENS:
            return None  # GPU-bound micro-batches: eager, no capture (cuda_graphs.AUTO_MAX_TOKENS)
        docs, longest = [len(rows) for rows in plan], max(int(seqlens[i]) for rows in plan for i in rows)
        shape = static_shape(totals, docs, longest)
        # one chunk: graphs need PP = 1 without virtual stages
        return self._graphs[0].reuse(shape, grad, totals, docs, longest)

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured so far (0 without graphs); a count that grows every step means shapes vary."""
        return sum(g.captures for g in self._graphs)

    def _run_schedule(self, mbs: list[MicroBatch], loss_func, forward_only: bool, record_routes: bool = False
                      ) -> list:
        """Run micro-batches through Megatron's schedule; `loss_func(mb, output) -> (loss, dict)` runs on the
        last pipeline stage. Returns the dicts (last stage only). A micro-batch's MoE layers replay `mb.routes`
        when set; `record_routes` fills `mb.recorded` (:func:`rlhf_mcore.models.routing_replay.routed`)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from rlhf_mcore.models.routing_replay import route_dtype, routed

        compact = route_dtype(self.moe_shape.num_experts) if record_routes else None  # kept until the pass ends

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            x = mb.inputs
            replay = mb.routes is not None or record_routes
            with routed(model, mb.routes, record_routes) if replay else nullcontext({}) as recorded, \
                    ExitStack() as heads:
                for head in self._heads:  # the output layer on the scored rows only
                    heads.enter_context(head.select(x.rows))
                images = {} if mb.pixel_values is None else {"pixel_values": mb.pixel_values}  # vision chunks
                output = model(x.input_ids, x.position_ids, x.attention_mask, packed_seq_params=x.packed_seq_params,
                               **images)
            mb.recorded.update({j: ids.to(compact) for j, ids in recorded.items()})
            if any(h.used for h in self._heads):  # the output holds exactly the rows, in order
                mb = dataclasses.replace(mb, inputs=dataclasses.replace(x, rows=None))
            return output, partial(loss_func, mb)

        iterators = [iter(mbs) for _ in self.modules] if len(self.modules) > 1 else iter(mbs)
        # stages exchange (seq, micro_batch, hidden) activations; all micro-batches share the shape (PP > 1)
        first = mbs[0].inputs.input_ids  # (B', S) or (1, total)
        with ExitStack() as graphs:
            for g in self._graphs:
                graphs.enter_context(g.active())
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iterators,
                model=self.modules if len(self.modules) > 1 else self.modules[0], num_microbatches=len(mbs),
                seq_length=first.shape[1], micro_batch_size=first.shape[0], forward_only=forward_only)

    # ------------------------------------------------------------------ offload / checkpoint

    def offload(self, params: Optional[bool] = None, grads: bool = True, optimizer: bool = True) -> dict[str, int]:
        """Move the chosen state off the device (see :mod:`rlhf_mcore.engine.offload`); `params` defaults to
        the engine's `param_offload` (the colocation plan keeps parameters unless asked).

        Returns bytes moved per kind and `device_freed` (GPU memory released, measured; on CPU the bytes
        released from the storages)."""
        params = self.param_offload if params is None else params
        for g in self._graphs:  # graphs read parameters in place and hold memory the rollout needs
            g.reset()
        invalidate_weight_amaxes(self.chunks)  # FP8 tensorwise: kept weight codes hold device memory too
        before = self._device_allocated()
        params_list = param_storages(self.modules)
        param_ptrs = {s.data_ptr() for s in params_list}
        moved = {}
        if optimizer and self.optimizer is not None:
            moved["optimizer"] = self._offloader.offload("optimizer", optimizer_storages(self.optimizer, param_ptrs))
        if grads and self.optimizer is not None:
            moved["grads"] = self._offloader.offload("grads", grad_storages(self.modules), keep_data=False)
        if params:
            moved["params"] = self._offloader.offload("params", params_list)
        self._empty_cache()
        after = self._device_allocated()
        moved["device_freed"] = (before - after) if before is not None else sum(moved.values())
        return moved

    def onload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict[str, int]:
        """Bring back what :meth:`offload` moved; returns bytes per kind and `device_restored`."""
        before = self._device_allocated()
        moved = {}
        for name, wanted in (("params", params), ("grads", grads), ("optimizer", optimizer)):
            if wanted and self._offloader.is_offloaded(name):
                moved[name] = self._offloader.onload(name)
        after = self._device_allocated()
        moved["device_restored"] = (after - before) if before is not None else sum(moved.values())
        return moved

    def save_checkpoint(self, path, extra: Optional[dict] = None) -> None:
        """Model, optimizer, scheduler and RNG into `path` (Megatron distributed checkpoint); collective."""
        self._require_onloaded()
        ckpt.save_checkpoint(path, self.modules, self.state, self.optimizer, self.scheduler,
                             extra={"global_steps": self.global_steps, **(extra or {})})

    def load_checkpoint(self, path, load_optimizer: bool = True) -> dict:
        """Load a checkpoint (any TP/PP layout for the model; see :mod:`rlhf_mcore.engine.checkpoint`)."""
        self._require_onloaded()
        for g in self._graphs:
            g.reset()
        loaded = ckpt.load_checkpoint(path, self.modules, self.state, self.optimizer if load_optimizer else None,
                                      self.scheduler, load_optimizer=load_optimizer and self.optimizer is not None)
        invalidate_weight_amaxes(self.chunks)
        if self.optimizer is not None:
            use_fused_adam(self.optimizer)  # loaded param groups carry the saving run's `fused` flag
        extra = loaded.get("extra") or {}
        self.global_steps = int(extra.get("global_steps", self.global_steps))
        return extra

    def export_hf_weights(self, dtype: Optional[torch.dtype] = None):
        """Full Hugging Face-named tensors of the model, streamed (see `rlhf_mcore.models.export_hf_weights`)."""
        from rlhf_mcore.models import export_hf_weights

        self._require_onloaded(("params",))  # the weight sync at the rollout's wake runs with the optimizer parked
        return export_hf_weights(self.chunks, self.state, dtype=dtype)

    def save_hf(self, out_dir, dtype: Optional[torch.dtype] = None) -> None:
        """Write the model as a Hugging Face directory (config, safetensors, tokenizer of `hf_dir`)."""
        from rlhf_mcore.models import save_hf_checkpoint

        if self.hf_dir is None:
            raise ValueError("save_hf needs the source Hugging Face directory: build the engine with hf_dir=")
        self._require_onloaded()
        save_hf_checkpoint(self.chunks, self.state, out_dir, self.hf_dir, dtype=dtype)

    # ------------------------------------------------------------------ helpers

    def _require_onloaded(self, kinds: tuple[str, ...] = ("params", "grads", "optimizer")) -> None:
        parked = [n for n in kinds if self._offloader.is_offloaded(n)]
        if parked:
            raise RuntimeError(f"the {self.cfg.role} engine's {', '.join(parked)} are offloaded; call onload() first")

    def _to_device(self, batch: dict) -> dict:
        dev = self.state.device
        return {k: (v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    def _broadcast_from_last_stage(self, tensors: list[torch.Tensor]) -> None:
        if self.state.dims.pp == 1:
            return
        src = dist.get_global_rank(self.state.pp_group, self.state.dims.pp - 1)
        for t in tensors:
            dist.broadcast(t, src=src, group=self.state.pp_group)

    def _sync_device(self) -> None:
        if self.state.device.type == "cuda":
            torch.cuda.synchronize(self.state.device)

    def _device_allocated(self) -> Optional[int]:
        if self.state.device.type == "cuda":
            torch.cuda.synchronize(self.state.device)
            return torch.cuda.memory_allocated(self.state.device)
        return None

    def _empty_cache(self) -> None:
        if self.state.device.type == "cuda":
            torch.cuda.empty_cache()


def _check_shared_prefix(chunks, cfg: EngineConfig, state) -> None:
    """Shared-prompt packing runs on packed sequences through this package's attention (SDPACoreAttention: the
    one that reads the layout), without pipeline or context parallelism, routing replay or images."""
    from rlhf_mcore.models.attention import SDPACoreAttention

    why = None
    if not cfg.use_remove_padding:
        why = "padded sequences (model.use_remove_padding=false): it packs"
    elif state.dims.pp > 1 or len(chunks) > 1:
        why = "pipeline parallelism (its stages exchange micro-batches of one shape)"
    elif cfg.router_replay != "disabled":
        why = f"routing replay ({cfg.router_replay})"
    else:
        cores = [m for c in chunks for m in c.modules() if type(m).__name__.endswith("Attention")
                 and hasattr(m, "core_attention")]
        other = {type(m.core_attention).__name__ for m in cores if not isinstance(m.core_attention, SDPACoreAttention)}
        if other:
            why = f"the attention {sorted(other)} (only the SDPA core attention reads the shared layout)"
    if why:
        raise ValueError(f"model.share_prompt_prefix=true does not run with {why}; set it to false")

