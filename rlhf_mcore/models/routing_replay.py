"""Routing replay for MoE models: record each MoE layer's top-k expert ids in one pass, force them in another,
through megatron-core's `RouterReplay` (transformer/moe/router_replay.py), and measure how often routes differ.

Why: in MoE RL a token routed to other experts in training than in the rollout gets a different MLP altogether,
the largest source of train/rollout mismatch. R3 replays the rollout's routes in the training passes, R2 the
old-log-prob pass's routes in the update passes (veRL's `router_replay.mode`).

The model must be built with `moe_enable_routing_replay=True` (`replay_config_overrides`), which gives every router a
`RouterReplay`. This module drives the routers of the given chunks directly (not megatron's process-wide list of
every router instance, which would mix the actor's and the reference's), in layer order.

Token order: the routers see a micro-batch as Megatron's (S, B) tokens flattened sequence-major; the ids here are
per layer (B, S, k) for a padded batch (or (1, T, k) packed), converted at the boundary.

What replay keeps exactly: the routed experts. Their weights are recomputed from this pass's router logits at the
replayed experts: with `norm_topk_prob` (Qwen3-MoE: a softmax over the k replayed logits) a change of the logits of
experts outside the replayed set changes nothing; without it (Qwen2-MoE: the softmax spans all experts) the weights
still move with every logit.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def replay_config_overrides() -> dict:
    """`TransformerConfig` overrides giving each router a `RouterReplay`."""
    return {"moe_enable_routing_replay": True}


def replay_routers(chunks) -> list:
    """The `RouterReplay` of every MoE layer of these chunks, in layer order (ValueError without replay enabled)."""
    out = []
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)
        for layer in chunk.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is None:
                continue
            if router.router_replay is None:
                raise ValueError("this model was built without routing replay: pass "
                                 "config_overrides=replay_config_overrides() to build_model.")
            out.append(router.router_replay)
    return out


def _to_router_order(ids: torch.Tensor) -> torch.Tensor:
    """(B, S, k) -> (S B, k), Megatron's sequence-major token order."""
    return ids.transpose(0, 1).reshape(-1, ids.shape[-1])


def _from_router_order(ids: torch.Tensor, batch: int) -> torch.Tensor:
    """(S B, k) -> (B, S, k)."""
    return ids.reshape(-1, batch, ids.shape[-1]).transpose(0, 1)


@contextmanager
def recording(chunks, batch: int) -> Iterator[list]:
    """Record the routes of the forward passes inside the block: yields a list that, on exit, holds each MoE
    layer's top-k ids (B, S, k) of the last forward (`batch` = B; 1 when packed)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = replay_routers(chunks)
    recorded: list = []
    for r in routers:
        r.clear_indices()
        r.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield recorded
        recorded.extend(_from_router_order(r.get_recorded_indices(), batch) for r in routers)
    finally:
        for r in routers:
            r.clear_router_replay_action()
            r.clear_indices()


@contextmanager
def replaying(chunks, ids: list) -> Iterator[None]:
    """Force each MoE layer's routes to `ids` (per layer (B, S, k)) in one forward pass inside the block (and in its
    backward's recomputation, if any)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = replay_routers(chunks)
    if len(ids) != len(routers):
        raise ValueError(f"{len(ids)} layers of routes for a model with {len(routers)} MoE layers")
    for r, layer_ids in zip(routers, ids):
        r.clear_indices()
        r.set_target_indices(_to_router_order(layer_ids))
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for r in routers:
            r.clear_router_replay_action()
            r.clear_indices()


def routing_mismatch(a: list, b: list, mask: torch.Tensor) -> dict:
    """The fraction of valid tokens whose top-k expert SET differs between two routings (per layer (B, S, k)),
    per layer: {"mean": over layers, "max": over layers, "per_layer": [...]}. mask (B, S): the tokens counted."""
    per_layer = []
    valid = mask.bool()
    n = int(valid.sum())
    for x, y in zip(a, b):
        differ = (x.sort(-1).values != y.sort(-1).values).any(-1)  # (B, S)
        per_layer.append(float((differ & valid).sum()) / max(n, 1))
    return {"mean": sum(per_layer) / max(len(per_layer), 1), "max": max(per_layer, default=0.0),
            "per_layer": per_layer}
