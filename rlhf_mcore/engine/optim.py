"""Megatron DDP wrapping, the optimizer (distributed by default) and the learning-rate schedule.

Precision: bf16 parameters on GPU train with fp32 master weights in the optimizer and gradients reduced in
fp32 (`grad_reduce_in_fp32`); fp32 parameters (the CPU default) train in fp32 throughout.

What Megatron's own training loop wires up and a bare `get_forward_backward_func` does not:
`config.finalize_model_grads_func` (DP gradient reduction, tied-embedding and layernorm all-reduces at the
end of a step) and `config.no_sync_func` (no reduction between micro-batches); without them data-parallel
gradients are never reduced. :func:`wrap_ddp` sets both.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["wrap_ddp", "build_optimizer", "use_fused_adam", "build_scheduler", "current_lr", "ensure_tp_attributes",
           "group_settings", "resume_schedule"]


def ensure_tp_attributes(chunks: list[torch.nn.Module]) -> int:
    """Mark tensor-parallel weights as such where Megatron left them unmarked; returns how many were fixed.

    megatron-core sets `tensor_model_parallel` / `partition_dim` on a parallel layer's weight only inside its
    weight-initialisation helpers, so a model built with `perform_initialization=False` (weights about to be
    loaded) has TP-split weights that look replicated. The optimizer's gradient norm then counts only TP
    rank 0's shards of them (`param_is_not_tensor_parallel_duplicate`): the norm, and so the clipping, is
    wrong at TP > 1.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    fixed = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                dim = 0
            elif isinstance(module, RowParallelLinear):
                dim = 1
            else:
                continue
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.nn.Parameter) and not hasattr(weight, "tensor_model_parallel"):
                for attr in ("partition_dim", "partition_stride"):
                    if hasattr(weight, attr):
                        delattr(weight, attr)
                set_tensor_model_parallel_attributes(weight, True, dim, 1)
                fixed += 1
    return fixed


def wrap_ddp(chunks: list[torch.nn.Module], use_distributed_optimizer: bool, pg_collection=None
             ) -> list[torch.nn.Module]:
    """Wrap each model chunk in Megatron's DistributedDataParallel and hook gradient finalisation."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                               grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    wrapped = []
    for i, chunk in enumerate(chunks):
        kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
        # Megatron-LM's convention: only the first virtual stage gets bucketed (its reduction is the one
        # that can overlap with the pipeline's backward)
        wrapped.append(DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                               disable_bucketing=i > 0, **kwargs))
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [w.no_sync for w in wrapped]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return wrapped


def build_optimizer(ddp_chunks: list[torch.nn.Module], optim, use_distributed_optimizer: bool, clip_grad: float,
                    pg_collection=None):
    """Adam(W) over the wrapped chunks from an :class:`rlhf_mcore.config.OptimConfig`, clipping the global
    gradient norm at `clip_grad` (<= 0: no clipping)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from rlhf_mcore.engine import multi_tensor

    multi_tensor.install()  # the gradient norm without one host sync per parameter (no TE/Apex)
    params_dtype = next(ddp_chunks[0].parameters()).dtype
    betas = list(optim.betas)
    if len(betas) != 2:
        raise ValueError(f"optim.betas must hold two numbers (beta1, beta2), got {betas}")
    config = OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.lr * optim.min_lr_ratio, weight_decay=optim.weight_decay,
        adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=optim.eps, clip_grad=max(float(clip_grad), 0.0),
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16, params_dtype=params_dtype,
        use_distributed_optimizer=use_distributed_optimizer)
    kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
    optimizer = get_megatron_optimizer(config, ddp_chunks, **kwargs)
    use_fused_adam(optimizer)
    return optimizer


def use_fused_adam(optimizer) -> int:
    """Switch the torch Adam(W) inside a Megatron optimizer to its fused CUDA kernel; returns groups switched.

    Without Transformer Engine or apex, megatron-core falls back to `torch.optim.AdamW` with the default
    `foreach` implementation, which allocates temporaries as large as all the (fp32 master) parameters at every
    step (`_foreach_sqrt` of the second moments, ...): 30 GB for a 7B model, the difference between fitting on one
    141 GB GPU or not. `fused=True` updates in one kernel per chunk with no such temporaries (and is faster).
    Only where every parameter of the group is on CUDA; CPU runs keep the default. Idempotent: call it again
    after loading optimizer state (a checkpoint's param groups carry their own `fused` flag).
    """
    from rlhf_mcore.engine.offload import torch_optimizers

    switched = 0
    for opt in torch_optimizers(optimizer):
        if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in opt.param_groups:
            if group["params"] and all(p.is_cuda and p.dtype == torch.float32 for p in group["params"]):
                group["fused"], group["foreach"] = True, False
                for p in group["params"]:  # the fused kernel wants its step counters on the device, in fp32
                    state = opt.state.get(p)
                    if state and isinstance(state.get("step"), torch.Tensor):
                        state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
                switched += 1
    return switched


def _warmup_steps(optim) -> int:
    if optim.lr_warmup_steps is not None and optim.lr_warmup_steps >= 0:
        return int(optim.lr_warmup_steps)
    total = optim.total_training_steps
    if optim.lr_warmup_steps_ratio > 0:
        if total is None or total <= 0:
            raise ValueError("optim.lr_warmup_steps_ratio needs optim.total_training_steps (set by the trainer); "
                             "or give optim.lr_warmup_steps directly")
        return int(optim.lr_warmup_steps_ratio * total)
    return 0


def build_scheduler(optimizer, optim):
    """Megatron's OptimizerParamScheduler: linear warmup from 0, then constant, cosine or linear decay to
    `lr · min_lr_ratio` at `total_training_steps`. One scheduler step per engine update (a PPO step)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    style = optim.lr_scheduler
    if style not in ("constant", "cosine", "linear"):
        raise ValueError(f"optim.lr_scheduler={style!r}; choose constant, cosine or linear")
    warmup = _warmup_steps(optim)
    total: Optional[int] = optim.total_training_steps
    if style != "constant" and (total is None or total <= 0):
        raise ValueError(f"optim.lr_scheduler={style} decays over optim.total_training_steps, which is "
                         f"{total}; set it (the trainer fills it in) or use lr_scheduler=constant")
    decay_steps = max(total if total and total > 0 else 0, warmup + 1)
    if style != "constant" and warmup >= decay_steps:
        raise ValueError(f"optim.lr_warmup_steps={warmup} must be < optim.total_training_steps={total}")
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup > 0 else optim.lr, max_lr=optim.lr, min_lr=optim.lr * optim.min_lr_ratio,
        lr_warmup_steps=warmup, lr_decay_steps=decay_steps, lr_decay_style=style,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=decay_steps,
        wd_incr_style="constant")


def current_lr(optimizer) -> float:
    """The learning rate of the first parameter group (what the scheduler set last)."""
    return float(optimizer.param_groups[0]["lr"])


# What the config sets, by the names users know: the scheduler's state-dict keys and a param group's keys.
_SCHEDULE_NAMES = {"max_lr": "lr", "min_lr": "min_lr (lr * min_lr_ratio)", "lr_warmup_steps": "warmup steps",
                   "lr_decay_style": "lr_scheduler", "lr_decay_steps": "decay steps (total_training_steps)",
                   "start_wd": "weight_decay"}  # end_wd: the same (a constant weight decay)
_GROUP_KEYS = {"max_lr": None, "min_lr": None, "betas": "betas", "eps": "eps"}  # None: reported with the schedule


def group_settings(optimizer) -> list[dict]:
    """The config's hyperparameters in each param group (before a checkpoint's replace them on load)."""
    return [{k: g[k] for k in _GROUP_KEYS if k in g} for g in optimizer.param_groups]


def _show(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else repr(list(v) if isinstance(v, tuple) else v)


def _same(a, b) -> bool:
    return tuple(a) == tuple(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b


def resume_schedule(optimizer, scheduler, saved_schedule: Optional[dict], config_groups: Optional[list[dict]]
                    ) -> list[str]:
    """After a checkpoint's optimizer and scheduler state were loaded: put the config's settings back in effect
    (its lr, warmup, schedule, min_lr, weight decay, betas, eps: Megatron-LM's `override_opt_param_scheduler`) at the
    checkpoint's step count, and set the param groups' lr for it. `scheduler` is the one built from the config (not
    loaded); `config_groups` what :func:`group_settings` gave before the load (None: the optimizer was not loaded).
    Returns ``"name: old -> new"`` for each setting the checkpoint had otherwise."""
    changes = []
    fresh = scheduler.state_dict()
    saved = saved_schedule or {}
    constant = fresh["lr_decay_style"] == saved.get("lr_decay_style") == "constant"
    for key, name in _SCHEDULE_NAMES.items():
        if key == "lr_decay_steps" and constant:  # no decay: its length (total_training_steps) changes nothing
            continue
        if key in saved and not _same(saved[key], fresh[key]):
            changes.append(f"{name}: {_show(saved[key])} -> {_show(fresh[key])}")
    if optimizer is not None and config_groups is not None:
        groups = optimizer.param_groups
        if len(groups) != len(config_groups):
            raise ValueError(f"the checkpoint's optimizer has {len(groups)} parameter groups, this model's "
                             f"{len(config_groups)}")
        for i, (group, wanted) in enumerate(zip(groups, config_groups)):
            for key, value in wanted.items():
                if i == 0 and _GROUP_KEYS[key] and key in group and not _same(group[key], value):
                    changes.append(f"{_GROUP_KEYS[key]}: {_show(group[key])} -> {_show(value)}")
                group[key] = value
    scheduler.num_steps = 0
    scheduler.step(increment=int(saved.get("num_steps", 0)))  # sets every group's lr and weight decay
    return changes
