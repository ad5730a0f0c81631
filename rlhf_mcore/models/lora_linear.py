"""The GEMMs of a frozen Megatron linear, with or without its LoRA term, as one autograd function each.

Both replace a `ColumnParallelLinear` / `RowParallelLinear`'s `_forward_impl` (Megatron's keyword arguments) when
its weight is frozen (LoRA: `rlhf_mcore.models.lora.apply_lora` installs them).

:func:`frozen_linear` is Megatron's `LinearWithFrozenWeight` (same forward) whose input gradient is one GEMM over
all tokens. Megatron's `grad_output.matmul(weight)` folds the leading dimensions into one GEMM only when they are
contiguous or the weight requires grad (torch's `should_fold`); the LM head's gradient arrives as the transpose of
GPTModel's `logits.transpose(0, 1).contiguous()`, shape (s, 1, V) with strides (V, s V, 1), so with a frozen head
torch ran a batched GEMM of s products (1, V) x (V, h): one skinny GEMM per token, re-reading the head's weight each
time. Here the gradient is reshaped to (tokens, out) (a view there: the batch dimension has size 1) and multiplied
once.

:func:`lora_linear` computes the base and the low-rank term in three GEMMs forward and five backward, with no
activation-sized element-wise pass of its own:

    forward   y = x W^T (+ bias);  u = x A^T;  y += u Bs^T          (addmm_, in place into the base's output)
    backward  du = g Bs;  dx = g W;  dx += du A (addmm_);  dA = du^T x;  dBs = g^T u

`A` (R, in) stacks the fused parts' A matrices (R = the sum of their ranks) and `Bs` (out, R) is the block-structured
B with the scale folded in, whose rows are the fused weight's (:meth:`LoraAdapters.stacked`). Tensor parallelism,
as the base weight is split:

- column-parallel (A replicated, B's rows split): each rank's `du` is a partial sum, so `dx` (which Megatron's
  `allreduce_dgrad` sums anyway) is right after its all-reduce, and `dA` is all-reduced (R x in, weight-sized);
- row-parallel (A's columns split, B replicated): each rank adds `u_local Bs^T` to its partial output before the
  layer's own all-reduce, which so sums the rank-r products over TP before B (no separate all-reduce forward); the
  gradient `g` is the full one on every rank, and `dBs` (out x R) is all-reduced.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _FrozenLinear(torch.autograd.Function):
    """y = x W^T + b with W and b frozen; dx = g W as one GEMM over every token."""

    @staticmethod
    def forward(ctx, x, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad, ctx.tp_group = allreduce_dgrad, tp_group
        out = torch.matmul(x, weight.t())  # Megatron's frozen forward, operation for operation
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, g):
        (weight,) = ctx.saved_tensors
        dx = (g.reshape(-1, g.shape[-1]) @ weight).view(*g.shape[:-1], weight.shape[1])
        if ctx.allreduce_dgrad:
            dist.all_reduce(dx, group=ctx.tp_group)
        return dx, None, None, None, None


def frozen_linear(x, weight, bias=None, allreduce_dgrad=False, tp_group=None):
    return _FrozenLinear.apply(x, weight, bias, allreduce_dgrad, tp_group)


class _LoraLinear(torch.autograd.Function):
    """y = x W^T (+ b) + (x A^T) Bs^T with W, b frozen; gradients to x, A and Bs (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, bs, row_parallel, allreduce_dgrad, tp_group, tp):
        x2d = x.reshape(-1, x.shape[-1])
        out = x2d @ weight.t()
        if bias is not None:
            out = out + bias  # Megatron's order (matmul, then the bias): a zero B gives the base bitwise
        u = x2d @ a.t()  # (tokens, R)
        out.addmm_(u, bs.t())
        ctx.save_for_backward(x2d, weight, a, bs, u)
        ctx.row_parallel, ctx.allreduce_dgrad, ctx.tp_group, ctx.tp = row_parallel, allreduce_dgrad, tp_group, tp
        ctx.x_shape = x.shape
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        x2d, weight, a, bs, u = ctx.saved_tensors
        g2d = g.reshape(-1, g.shape[-1])
        du = g2d @ bs  # (tokens, R); column-parallel: this rank's part of the sum over TP
        dx = None
        if ctx.needs_input_grad[0]:  # not for the first layer's QKV under a frozen embedding
            dx = g2d @ weight
            dx.addmm_(du, a)
            if ctx.allreduce_dgrad:
                dist.all_reduce(dx, group=ctx.tp_group)
            dx = dx.view(ctx.x_shape)
        da = du.t() @ x2d if ctx.needs_input_grad[3] else None
        dbs = g2d.t() @ u if ctx.needs_input_grad[4] else None
        if ctx.tp > 1:  # the replicated factor's gradient sums over TP
            summed = dbs if ctx.row_parallel else da
            if summed is not None:
                dist.all_reduce(summed, group=ctx.tp_group)
        return dx, None, None, da, dbs, None, None, None, None


def lora_linear(x, weight, bias, a, bs, *, row_parallel=False, allreduce_dgrad=False, tp_group=None, tp=1):
    """The base linear plus its LoRA term: `x W^T (+ bias) + (x A^T) Bs^T` (x (..., in) -> (..., out))."""
    return _LoraLinear.apply(x, weight, bias, a, bs, row_parallel, allreduce_dgrad, tp_group, tp)


def frozen_impl(mod):
    """A `_forward_impl` for `mod`: :func:`frozen_linear` while its weight is frozen, else Megatron's own."""
    megatron_impl = type(mod)._forward_impl

    def impl(input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
             sequence_parallel=False, tp_group=None, **kwargs):
        if weight.requires_grad or sequence_parallel or kwargs.get("grad_output_buffer") is not None:
            return megatron_impl(mod, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                 sequence_parallel, tp_group=tp_group, **kwargs)
        group = tp_group if tp_group is not None else getattr(mod, "tp_group", None)
        return frozen_linear(input, weight, bias, allreduce_dgrad, group)

    return impl


def lora_impl(mod):
    """A `_forward_impl` for an adapted linear (`mod.lora`): :func:`lora_linear` while the adapters are on, else
    the frozen base (:func:`frozen_impl`: the forward of Megatron's frozen linear, so the reference is the base)."""
    frozen = frozen_impl(mod)

    def impl(input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
             sequence_parallel=False, tp_group=None, **kwargs):
        lora = mod.lora
        if not lora.enabled:
            return frozen(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                          tp_group=tp_group, **kwargs)
        a, bs = lora.stacked(input.dtype)
        return lora_linear(input, weight, bias, a, bs, row_parallel=lora.row_parallel,
                           allreduce_dgrad=allreduce_dgrad, tp_group=lora.tp_group, tp=lora.tp)

    return impl
