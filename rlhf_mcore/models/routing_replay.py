"""Routing replay for MoE models: force each MoE layer's top-k expert ids in a forward pass, record the ids the routers
pick, and measure how often two routings differ -- through megatron-core's `RouterReplay`
(transformer/moe/router_replay.py).

Why: in MoE RL a token routed to other experts in training than in the rollout gets a different MLP altogether,
the largest source of train/rollout mismatch. R3 replays the rollout's routes in the training passes, R2 the
old-log-prob pass's routes in the update passes (veRL's `router_replay.mode`; the train engine and the learner
apply them: rlhf_mcore.engine.routes, rlhf_mcore.trainer.learner).

The model must be built with `moe_enable_routing_replay=True` (`replay_config_overrides`), which gives every router a
`RouterReplay`. :func:`routed` drives the routers of one model chunk (not megatron's process-wide list of every
router instance, which would mix the actor's and the reference's), around one forward of that chunk.

Layouts. A model's routes are `(tokens, n, k)` integer tensors: for each token, the top-k expert ids of each of the
model's n MoE layers (`ModelShape.moe_layers` order), in the token order the routers see (Megatron's (S, B)
activations flattened sequence-major; packed: the packed order). The batch layout (B, L, n, k) and the conversion
are the train engine's (rlhf_mcore.engine.routes). Tokens without routes of their own (padding, a response's last
token, which the rollout never fed back) get :func:`filler` routes: experts 0..k-1.

What replay keeps exactly: the routed experts. Their weights are recomputed from this pass's router logits at the
replayed experts: with `norm_topk_prob` (Qwen3-MoE: a softmax over the k replayed logits) a change of the logits of
experts outside the replayed set changes nothing; without it (Qwen2-MoE: the softmax spans all experts) the weights
still move with every logit.

Recording reads the top-k each router computes from its own scores (its default top-k, also while replaying), by
wrapping the `RouterReplay`'s top-k call for the duration of the forward: the routes the pass would have taken.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch


def replay_config_overrides() -> dict:
    """`TransformerConfig` overrides giving each router a `RouterReplay`."""
    return {"moe_enable_routing_replay": True}


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds an expert id (routes travel and wait in it)."""
    return torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 2**15 else torch.int32


def filler(shape: tuple, k: int, dtype: torch.dtype = torch.int64, device=None) -> torch.Tensor:
    """Routes `shape + (k,)` of tokens that have none of their own: experts 0..k-1 (distinct, as real routes are)."""
    return torch.arange(k, dtype=dtype, device=device).expand(*shape, k).clone()


def chunk_routers(chunk) -> list[tuple[int, object]]:
    """(index among the model's MoE layers, router) of every MoE layer of one GPTModel chunk (DDP-wrapped or not),
    in layer order; ValueError when the model was built without routing replay."""
    inner = getattr(chunk, "module", chunk)
    moe_layers = list(inner.hf_shape.moe_layers)  # global layer indices
    out = []
    for layer in inner.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        if router.router_replay is None:
            raise ValueError("this model was built without routing replay: pass "
                             "config_overrides=replay_config_overrides() to build_model.")
        out.append((moe_layers.index(layer.layer_number - 1), router))
    return out


def _watch(replay) -> list:
    """Wrap `replay`'s top-k call so that each call appends the router's own top-k ids (T, k) to the returned list
    (undone by :func:`_unwatch`)."""
    picks: list = []
    inner = replay.get_replay_topk  # the bound method

    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        picks.append(default_compute_topk(scores, topk, num_groups, group_topk)[1].detach())
        return inner(scores, topk, num_groups, group_topk, default_compute_topk)

    replay.get_replay_topk = get_replay_topk
    return picks


def _unwatch(replay) -> None:
    replay.__dict__.pop("get_replay_topk", None)


@contextmanager
def routed(chunk, replay: Optional[torch.Tensor] = None, record: bool = False) -> Iterator[dict]:
    """One forward of `chunk` inside the block: with `replay` (T, n, k) each of the chunk's MoE layers routes token t
    to `replay[t, layer]` (the model's n MoE layers; this chunk uses its own); with `record`, yields a dict that
    holds on exit, per MoE layer index of this chunk, the (T, k) ids its router picked from its own scores."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = chunk_routers(chunk)
    recorded: dict = {}
    watched = {}
    try:
        for j, router in routers:
            r = router.router_replay
            r.clear_indices()
            if replay is not None:
                r.set_target_indices(replay[:, j].long())
                r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            if record:
                watched[j] = _watch(r)
        yield recorded
        for j, picks in watched.items():
            if len(picks) != 1:
                raise RuntimeError(f"MoE layer {j} routed {len(picks)} times in one forward; recording expects one")
            recorded[j] = picks[0]
    finally:
        for _, router in routers:
            r = router.router_replay
            _unwatch(r)
            r.clear_router_replay_action()
            r.clear_indices()


# ------------------------------------------------------------------------------------------------- measuring
def mismatch_counts(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per MoE layer, (tokens whose top-k expert SET differs between routes a and b, tokens counted): (n, 2) int64.
    a, b (..., n, k); valid (...) bool: the tokens counted."""
    differ = (a.long().sort(-1).values != b.long().sort(-1).values).any(-1)  # (..., n)
    v = valid.bool()[..., None]
    return torch.stack([(differ & v).flatten(0, -2).sum(0), v.expand_as(differ).flatten(0, -2).sum(0)], -1)


def fed_tokens(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: the tokens of a batch the rollout fed to its model, so recorded routes for -- every real token but
    each row's last (a response's last token is sampled, never fed back). attention_mask (B, L), rows right-aligned
    or not."""
    real = attention_mask.bool()
    fed = real.clone()
    fed[torch.arange(real.shape[0]), real.shape[1] - 1 - real.flip(1).long().argmax(1)] = False
    return fed


def expert_counts(routes: torch.Tensor, valid: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per MoE layer, the tokens routed to each expert: (n, E) int64. routes (..., n, k); valid (...) bool."""
    ids = routes[valid.bool()].long()  # (N, n, k)
    n = ids.shape[1]
    layer = torch.arange(n)[None, :, None].expand_as(ids)
    return torch.bincount((layer * num_experts + ids).flatten(), minlength=n * num_experts).view(n, num_experts)


def routing_summary(mismatch: Optional[torch.Tensor], counts: torch.Tensor, prefix: str) -> dict[str, float]:
    """Metrics from summed counts: `{prefix}moe_routing_mismatch/mean` and `/max` (over MoE layers, the fraction of
    tokens whose expert set differs) when `mismatch` (n, 2) is given, and `{prefix}moe_expert_load/mean` and `/max`
    (over MoE layers, the busiest expert's tokens over the mean per expert; 1 is a perfect balance)."""
    out = {}
    if mismatch is not None:
        frac = mismatch[:, 0].double() / mismatch[:, 1].clamp(min=1).double()  # (n,)
        out[f"{prefix}moe_routing_mismatch/mean"] = float(frac.mean())
        out[f"{prefix}moe_routing_mismatch/max"] = float(frac.max())
    load = counts.double().max(-1).values / counts.double().mean(-1).clamp(min=1e-12)  # (n,)
    out[f"{prefix}moe_expert_load/mean"] = float(load.mean())
    out[f"{prefix}moe_expert_load/max"] = float(load.max())
    return out
