"""Sync-free stand-ins for megatron-core's multi-tensor fallbacks (no Transformer Engine, no Apex).

Without TE or Apex, megatron-core's optimizer computes the gradient norm with
`megatron.core.utils.local_multi_tensor_l2_norm`: one `torch.norm` per gradient, then
`torch.tensor([...])` of those CUDA scalars, which reads each one back to the host — one device
synchronisation per parameter (~290 for a Qwen2.5-0.5B, at every optimizer step), each waiting for the
GPU to drain. Its `local_multi_tensor_scale` (gradient clipping, main -> model parameter copies) launches
two kernels per tensor. The versions here do the same arithmetic with torch's foreach kernels: a few
launches a step and no synchronisation (megatron's caller still reads the final norm once, as it must to
decide the clip).

:func:`install` swaps them in only where megatron-core fell back to its local functions; with TE or Apex
present their fused kernels stay.
"""
from __future__ import annotations

import torch

__all__ = ["foreach_l2_norm", "foreach_scale", "install"]


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for `amp_C.multi_tensor_l2norm`: (the global L2 norm as a 1-element fp32 tensor, the per-tensor
    norms or None), computed on the tensors' device without a host read."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=torch.cuda.current_device()), None
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)  # fp32 accumulation, as torch.norm does on fp32
    stacked = torch.stack(norms)
    total = torch.linalg.vector_norm(stacked).reshape(1)
    return total, (stacked if per_tensor else None)


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for `amp_C.multi_tensor_scale`: dst = src * scale for each pair (in place when they are the same
    tensors; a copy, with the dtype cast, when scale is 1)."""
    srcs, dsts = tensor_lists[0], tensor_lists[1]
    if not srcs:
        return
    if all(s is d for s, d in zip(srcs, dsts)):
        if scale != 1.0:
            torch._foreach_mul_(dsts, scale)
        return
    torch._foreach_copy_(dsts, srcs if scale == 1.0 else torch._foreach_mul(srcs, scale))


def install() -> list[str]:
    """Replace megatron-core's local fallbacks where it uses them; returns the module attributes replaced."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, optimizer

    replaced = []
    for module, name, local, ours in (
            (clip_grads, "l2_norm_impl", mcore_utils.local_multi_tensor_l2_norm, foreach_l2_norm),
            (clip_grads, "multi_tensor_scale_impl", mcore_utils.local_multi_tensor_scale, foreach_scale),
            (optimizer, "multi_tensor_scale_impl", mcore_utils.local_multi_tensor_scale, foreach_scale)):
        if getattr(module, name, None) is local:
            setattr(module, name, ours)
            replaced.append(f"{module.__name__}.{name}")
    return replaced
