"""From the run configuration to a ready :class:`TrainEngine` for the actor, the reference policy or the critic."""
from __future__ import annotations

import dataclasses

import torch

from rlhf_mcore.engine.config import EngineConfig
from rlhf_mcore.engine.train_engine import TrainEngine

__all__ = ["build_engine", "recompute_overrides"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _dtype(name: str):
    return None if name == "auto" else _DTYPES[name]


def recompute_overrides(enabled: bool) -> dict:
    """TransformerConfig overrides for full activation recomputation, one layer at a time (`{}` when not
    `enabled`): activation memory for long responses, paid for with a second forward pass of each layer."""
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if enabled else {}


def build_engine(cfg, state, *, role: str, total_steps: int = 0, load_weights: bool = True) -> TrainEngine:
    """Build the model of `role` ("actor", "ref" or "critic") from its HF directory and wrap it.

    cfg: the run's `RLConfig`; total_steps: PPO steps of the run (the LR schedule's horizon).
    """
    from rlhf_mcore.config import moe_overrides, pipeline_split
    from rlhf_mcore.models import build_model

    arr, dp = cfg.actor_rollout_ref, state.dims.dp
    if role == "actor":
        path = arr.model.path
        ecfg = EngineConfig.from_actor(arr.actor, arr.model, arr.rollout, dp)
        optim = dataclasses.replace(arr.actor.optim, total_training_steps=total_steps)
        megatron, dtype = arr.actor.megatron, _dtype(arr.model.dtype)
        recompute = arr.model.enable_gradient_checkpointing
    elif role == "ref":
        path = arr.model.path
        ecfg, optim = EngineConfig.from_ref(arr.ref, arr.model, arr.rollout), None
        megatron, dtype, recompute = arr.ref.megatron, _dtype(arr.model.dtype), False
    elif role == "critic":
        c = cfg.critic
        path = c.model.path or arr.model.path
        ecfg = EngineConfig.from_critic(c, arr.actor, arr.rollout, dp)
        optim = dataclasses.replace(c.optim, total_training_steps=total_steps)
        megatron, dtype, recompute = c.megatron, _dtype(c.model.dtype), c.model.enable_gradient_checkpointing
    else:
        raise ValueError(f"role={role!r}; choose actor, ref or critic")
    overrides = {**recompute_overrides(recompute), **pipeline_split(cfg),  # every role: the actor's stage split
                 **moe_overrides(megatron)}
    if megatron.sequence_parallel and state.dims.tp > 1:
        overrides["sequence_parallel"] = True
    chunks = build_model(path, state, role=role, dtype=dtype, load_weights=load_weights,
                         config_overrides=overrides or None)
    return TrainEngine(chunks, state, ecfg, optim, use_distributed_optimizer=megatron.use_distributed_optimizer,
                       hf_dir=str(path), param_offload=megatron.param_offload,
                       grad_offload=megatron.grad_offload, optimizer_offload=megatron.optimizer_offload)
