"""Routing replay in the train engine: a batch's routes and each micro-batch's router order.

A batch carries routes as `(B, L, n, k)` expert ids aligned with `input_ids (B, L)` (every MoE layer of the model,
`rlhf_mcore.models.routing_replay`): the rollout's under `routed_experts` (R3), the old-log-prob pass's under
`old_routed_experts` (R2). A micro-batch's routers see its tokens in another order (packed, or the real tokens moved
to the front and the (S, B) layout flattened) and padding tokens besides; `ModelInputs.router_index` maps one to the
other. Which pass replays which key is :func:`replay_key`.
"""
from __future__ import annotations

from typing import Optional

import torch

from rlhf_mcore.engine.packing import ModelInputs
from rlhf_mcore.models.routing_replay import filler

ROLLOUT_ROUTES = "routed_experts"  # (B, L, n, k): the rollout's routes (R3); veRL's and slime's name
OLD_ROUTES = "old_routed_experts"  # (B, L, n, k): the old-log-prob pass's routes (R2)
MODES = ("disabled", "R2", "R3")


def replay_key(mode: str, role: str, phase: str) -> Optional[str]:
    """The batch key whose routes a pass replays, or None. phase: "forward" (old log-probs; the reference's
    log-probs) or "update"."""
    if mode not in MODES:
        raise ValueError(f"router_replay mode={mode!r}; choose one of {MODES}")
    if mode == "R3" and role in ("actor", "ref"):
        return ROLLOUT_ROUTES
    if mode == "R2" and role == "actor" and phase == "update":
        return OLD_ROUTES
    return None


def to_router_order(routes: torch.Tensor, valid: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """A micro-batch's routes (b, L, n, k) with real tokens `valid` (b, L) as the routers' (T, n, k) int64, T the
    model's token count (padding tokens get filler routes)."""
    n, k = routes.shape[-2:]
    out = filler((inputs.input_ids.numel(), n), k, device=routes.device)
    out[inputs.router_index] = routes[valid.bool()].long()
    return out


def from_router_order(recorded: dict, valid: torch.Tensor, inputs: ModelInputs, n: int, k: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The (T, k) ids recorded per MoE layer index as the batch layout (b, L, n, k) (`dtype`); layers not recorded
    (another pipeline stage's) and padding hold filler routes."""
    b, length = valid.shape
    out = filler((b, length, n), k, dtype=dtype, device=valid.device)
    rows = valid.bool()
    for j, ids in recorded.items():
        layer = out[:, :, j]  # (b, L, k) view
        layer[rows] = ids.index_select(0, inputs.router_index).to(dtype)
    return out
