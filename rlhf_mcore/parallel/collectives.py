"""Small collectives every part uses: a Python object from one rank, a tensor reduced over a group.

Both are no-ops where there is nothing to communicate with (no process group, or one rank), so single-process
code and tests call them unconditionally.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlhf_mcore.parallel.dist import collective_device

__all__ = ["broadcast_object", "group_all_reduce"]


def broadcast_object(obj: Any, group=None, src: int = 0) -> Any:
    """Rank ``src``'s object on every rank (small control messages only)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def group_all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """`t` reduced with `op` over `group` (e.g. a sum over the data-parallel ranks, each holding a share of the
    batch), on `t`'s device; `t` itself when `group` is None, no process group is up or the group has one rank.
    The values travel on the device the group's backend needs (:func:`collective_device`); when that is `t`'s own
    device, `t` is reduced in place."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    out = t.to(collective_device(group))
    dist.all_reduce(out, op=op, group=group)
    return out.to(t.device)
