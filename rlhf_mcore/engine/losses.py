"""Per-micro-batch losses of the actor and the critic, normalised over the whole mini-batch.

Normalisation across micro-batches and DP ranks. Every loss here is an `agg_loss` with the mini-batch's
global counts (`global_tokens`, `global_seqs`: valid response tokens / sequences of the mini-batch summed
over all micro-batches and DP ranks), so each micro-batch returns its exact *share* and the shares sum to
the loss of the whole mini-batch. Megatron then averages instead of summing twice: the pipeline schedule
divides each micro-batch's loss by the number of micro-batches, and DDP's gradient reduction averages over
DP ranks. The loss handed to Megatron is therefore the share × `num_microbatches` × `dp_size`, which makes
the final gradient exactly that of the mini-batch loss, whatever the split (tested: 1×8 = 8×1 micro-batches,
dynamic = fixed, DP=2 = DP=1).

Metrics come back as sums that reduce correctly over micro-batches and ranks: loss shares add up to the
mini-batch value; per-token means (clip fraction, KL estimates) are carried as `mean × tokens` with the token
count, and divided at the end (:func:`reduce_metrics`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from rlhf_mcore.algos import agg_loss, compute_entropy_loss, compute_kl_loss, compute_value_loss, get_policy_loss
from rlhf_mcore.engine.config import EngineConfig
from rlhf_mcore.engine.logprobs import get_logprob_backend
from rlhf_mcore.engine.micro_batches import MicroBatch
from rlhf_mcore.engine.packing import ModelInputs

__all__ = ["LossContext", "score_tokens", "token_values", "actor_loss", "critic_loss", "reduce_metrics",
           "ACTOR_KEYS", "CRITIC_KEYS", "ON_POLICY_KEYS"]

ACTOR_KEYS = ("response_mask", "old_log_probs", "advantages")  # + rollout_is_weights (b, R) when present
CRITIC_KEYS = ("response_mask", "values", "returns")
# by role, the (b, R) grids an on-policy update computes itself (its first mini-batch, before any optimizer step,
# runs the model the forward pass would run) and returns per token with its loss's metrics (and `index`): the
# actor's log-probs and entropy (the old ones), the critic's values (the old values of the clipped loss)
ON_POLICY_KEYS = {"actor": ("old_log_probs", "old_entropy"), "critic": ("values",)}
# token-weighted means among the policy loss's metrics
_TOKEN_MEANS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "approx_kl", "vf_clipfrac", "vpred_mean")


@dataclass
class LossContext:
    cfg: EngineConfig
    tp_group: Optional[dist.ProcessGroup]
    vocab_size: Optional[int]
    global_tokens: torch.Tensor  # () valid response tokens of the mini-batch, all DP ranks
    global_seqs: torch.Tensor  # () sequences with a valid response token, all DP ranks
    scale: float  # num_microbatches × dp_size: undoes Megatron's two averages
    # no optimizer step yet: the old model is this forward's own, so its log-probs (the actor) or values (the
    # critic), detached, are the old ones (ratio exactly 1, no clipping) and come back per token (`ON_POLICY_KEYS`)
    on_policy: bool = False


def score_tokens(output: torch.Tensor, inputs: ModelInputs, cfg: EngineConfig, tp_group, vocab_size,
                 compute_entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropy) of the response tokens from vocab-parallel logits, as (B, R) grids. With
    `cfg.token_range` (lo, hi) the softmax is over ids lo..hi-1 only (:func:`_range_logits`)."""
    fn = get_logprob_backend(cfg.logprob_backend)
    if cfg.token_range is not None:
        lo, hi = cfg.token_range
        logits, labels = _range_logits(output, inputs, tp_group, lo, hi)
        logp, ent = fn(logits, labels, rows=None, tp_group=None, temperature=cfg.temperature, vocab_size=None,
                       compute_entropy=compute_entropy, chunk_size=cfg.logprob_chunk_size)
        return inputs.to_grid(logp), (inputs.to_grid(ent) if ent is not None else None)
    logp, ent = fn(output, inputs.labels, rows=inputs.rows, tp_group=tp_group, temperature=cfg.temperature,
                   vocab_size=vocab_size, compute_entropy=compute_entropy, chunk_size=cfg.logprob_chunk_size)
    return inputs.to_grid(logp), (inputs.to_grid(ent) if ent is not None else None)  # (B, R) each


def _range_logits(output: torch.Tensor, inputs: ModelInputs, tp_group, lo: int, hi: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The scored rows' logits over ids lo..hi-1, (M, hi - lo), TP-gathered (differentiable: the gather's backward
    hands each rank its slice), and the labels shifted to that range. Only the M response rows are gathered, so
    the cost is M x V, small for a VLA's action chunks. A label outside the range is an error (the rollout
    restricted its sampling to these ids)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    flat = output.reshape(-1, output.shape[-1])  # (M, V_local): the scored rows (rows=None) or every row
    if inputs.rows is not None:
        flat = flat.index_select(0, inputs.rows)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        flat = gather_from_tensor_model_parallel_region(flat, group=tp_group)  # (M, V_padded)
    if hi > flat.shape[-1]:
        raise ValueError(f"token_range=({lo}, {hi}) exceeds the logits' vocabulary of {flat.shape[-1]}")
    labels = inputs.labels - lo
    if labels.numel() and (labels.min() < 0 or labels.max() >= hi - lo):
        bad = int(inputs.labels[(labels < 0) | (labels >= hi - lo)][0])
        raise ValueError(f"response token {bad} lies outside token_range=({lo}, {hi}): a batch scored over an "
                         "action vocabulary must hold action tokens only in its responses")
    return flat[:, lo:hi], labels


def token_values(output: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """Critic values `[.., S, 1]` at the positions that predict each response token, as a (B, R) grid."""
    flat = output.reshape(-1)  # (B·S,) or (total,); (M,) when the head ran on the scored rows only (rows=None)
    return inputs.to_grid((flat if inputs.rows is None else flat.index_select(0, inputs.rows)).float())  # (B, R)


def _token_weighted(metrics: dict, n_tokens: torch.Tensor) -> dict:
    return {k: (v.float() * n_tokens if k in _TOKEN_MEANS else v.float()) for k, v in metrics.items()}


def actor_loss(output: torch.Tensor, mb: MicroBatch, ctx: LossContext) -> tuple[torch.Tensor, dict]:
    """Policy loss (+ entropy bonus, + KL to the reference) of one micro-batch; see the module docstring."""
    cfg = ctx.cfg
    mask = mb.data["response_mask"]  # (b, R)
    log_prob, entropy = score_tokens(output, mb.inputs, cfg, ctx.tp_group, ctx.vocab_size, compute_entropy=True)
    common = dict(loss_agg_mode=cfg.loss_agg_mode, global_tokens=ctx.global_tokens, global_seqs=ctx.global_seqs,
                  loss_scale_factor=cfg.loss_scale_factor)
    old_log_prob = log_prob.detach() if ctx.on_policy else mb.data["old_log_probs"]
    pg_loss, pg_metrics = get_policy_loss(cfg.policy_loss)(
        old_log_prob, log_prob, mb.data["advantages"], mask, clip_ratio=cfg.clip_ratio,
        clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
        rollout_is_weights=mb.data.get("rollout_is_weights"), **common)
    loss = pg_loss
    metrics = {"pg_loss": pg_loss.detach()}
    if cfg.entropy_coeff != 0:
        ent_loss, ent_metrics = compute_entropy_loss(entropy, mask, entropy_coeff=cfg.entropy_coeff, **common)
        loss = loss + ent_loss
        metrics["entropy"] = ent_metrics["entropy"]
    else:  # reported, not trained on: no backward through the entropy
        metrics["entropy"] = agg_loss(entropy.detach(), mask, cfg.loss_agg_mode, global_tokens=ctx.global_tokens,
                                      global_seqs=ctx.global_seqs, loss_scale_factor=cfg.loss_scale_factor)
    if cfg.use_kl_loss:
        if "ref_log_prob" not in mb.data:
            raise KeyError("use_kl_loss=true needs `ref_log_prob` [B, R] in the batch (the reference policy's "
                           "log-probs)")
        kl_loss, kl_metrics = compute_kl_loss(log_prob, mb.data["ref_log_prob"], mask, kl_loss_coef=cfg.kl_loss_coef,
                                              kl_loss_type=cfg.kl_loss_type, **common)
        loss = loss + kl_loss
        metrics["kl_loss"] = kl_metrics["kl_loss"]
    n_tokens = mask.sum().float()
    metrics = _token_weighted({**metrics, **{k: v for k, v in pg_metrics.items() if k in _TOKEN_MEANS}}, n_tokens)
    metrics["loss"] = loss.detach().float()
    metrics["n_tokens"] = n_tokens
    if ctx.on_policy:  # per token, not summed: the engine takes them out before reducing the metrics
        metrics.update(index=mb.index, old_log_probs=log_prob.detach(), old_entropy=entropy.detach())
    return loss * ctx.scale, metrics


def critic_loss(output: torch.Tensor, mb: MicroBatch, ctx: LossContext) -> tuple[torch.Tensor, dict]:
    """Clipped value loss of one micro-batch; see the module docstring."""
    cfg = ctx.cfg
    mask = mb.data["response_mask"]  # (b, R)
    vpreds = token_values(output, mb.inputs)  # (b, R)
    old = vpreds.detach() if ctx.on_policy else mb.data["values"]
    loss, vf_metrics = compute_value_loss(
        vpreds, mb.data["returns"], old, mask, cliprange_value=cfg.cliprange_value,
        loss_agg_mode=cfg.loss_agg_mode, global_tokens=ctx.global_tokens, global_seqs=ctx.global_seqs,
        loss_scale_factor=cfg.loss_scale_factor)
    n_tokens = mask.sum().float()
    metrics = _token_weighted({"vf_loss": loss.detach(), **vf_metrics}, n_tokens)
    metrics["loss"] = loss.detach().float()
    metrics["n_tokens"] = n_tokens
    if ctx.on_policy:  # per token, not summed: the engine takes them out before reducing the metrics
        metrics.update(index=mb.index, values=old)
    return loss * ctx.scale, metrics


def reduce_metrics(per_micro: list[dict], *, sum_groups: list, src_group=None, src_has_data: bool = True,
                   device=None) -> dict[str, float]:
    """Sum micro-batch metric dicts, then over `sum_groups` (DP); token-weighted means become means.

    `src_group`: the pipeline group; only its last stage computed the metrics (`src_has_data`), so the sums
    are all-reduced over it too (other stages contribute zeros). Every rank returns the same dict.
    """
    keys = sorted({k for d in per_micro for k in d})
    if src_group is not None and dist.get_world_size(src_group) > 1:
        # stages without the loss do not know the keys: take them from the last stage
        holder = [keys if src_has_data else None]
        gathered = [None] * dist.get_world_size(src_group)
        dist.all_gather_object(gathered, holder[0], group=src_group)
        keys = next(k for k in gathered if k is not None)
    totals = torch.zeros(len(keys), dtype=torch.float64, device=device)
    if src_has_data:
        for d in per_micro:
            for i, k in enumerate(keys):
                if k in d:
                    totals[i] += d[k].double().to(totals.device)
    groups = list(sum_groups) + ([src_group] if src_group is not None else [])
    for g in groups:
        if g is not None and dist.get_world_size(g) > 1:
            dist.all_reduce(totals, group=g)
    sums = dict(zip(keys, totals.tolist()))
    tokens = sums.pop("n_tokens", 0.0)
    return {k: (v / tokens if k in _TOKEN_MEANS and tokens > 0 else v) for k, v in sums.items()} | {"n_tokens": tokens}
