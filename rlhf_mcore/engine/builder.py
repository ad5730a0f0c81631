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


def recompute_overrides(enabled: bool, method: str | None = None, num_layers: int | None = None) -> dict:
    """TransformerConfig overrides for full activation recomputation (`{}` when not `enabled`): activation memory
    for long responses, paid for with a second forward pass of the recomputed layers. Unset, every layer, one at a
    time; `method="block"` recomputes only the first `num_layers` layers of each model chunk."""
    if not enabled:
        return {}
    return dict(recompute_granularity="full", recompute_method=method or "uniform",
                recompute_num_layers=num_layers or 1)


def recompute_overrides_for(model, megatron) -> dict:
    """A training role's recompute (its `model` section's enable_gradient_checkpointing and its `megatron`
    override_transformer_config keys, checked by the config) as TransformerConfig overrides."""
    from rlhf_mcore.config import recompute_mode

    o, mode = megatron.override_transformer_config, recompute_mode(model, megatron)
    if mode == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": list(o.recompute_modules)}
    return recompute_overrides(mode == "full", o.recompute_method, o.recompute_num_layers)


def _replay_overrides(path, role: str, ecfg: EngineConfig) -> dict:
    """Routers with a `RouterReplay` (rlhf_mcore.models.routing_replay) for a MoE actor (which also records its
    routes for the routing metrics) and for a reference that replays the rollout's routes; none otherwise."""
    from rlhf_mcore.engine.routes import replay_key
    from rlhf_mcore.models import ModelShape
    from rlhf_mcore.models.routing_replay import replay_config_overrides

    if role not in ("actor", "ref") or not ModelShape.from_hf_dir(path).is_moe:
        return {}
    if role == "actor" or replay_key(ecfg.router_replay, role, "forward") is not None:
        return replay_config_overrides()
    return {}


def build_engine(cfg, state, *, role: str, total_steps: int = 0, load_weights: bool = True) -> TrainEngine:
    """Build the model of `role` ("actor", "ref" or "critic") from its HF directory and wrap it.

    cfg: the run's `RLConfig`; total_steps: PPO steps of the run (the LR schedule's horizon). With
    `model.lora_rank > 0` (actor, critic) the model gets LoRA adapters and only they train
    (:mod:`rlhf_mcore.models.lora`).
    """
    from rlhf_mcore.config import moe_overrides, pipeline_split
    from rlhf_mcore.models import build_model
    from rlhf_mcore.models.lora import LoraSpec

    arr, dp = cfg.actor_rollout_ref, state.dims.dp
    lora = None
    if role == "actor":
        path = arr.model.path
        ecfg = EngineConfig.from_actor(arr.actor, arr.model, arr.rollout, dp)
        optim = dataclasses.replace(arr.actor.optim, total_training_steps=total_steps)
        megatron, dtype = arr.actor.megatron, _dtype(arr.model.dtype)
        model = arr.model  # its recompute (with megatron.override_transformer_config's keys)
        lora = LoraSpec.from_config(arr.model, "actor_rollout_ref.model")
    elif role == "ref":
        path = arr.model.path
        ecfg, optim = EngineConfig.from_ref(arr.ref, arr.model, arr.rollout, arr.actor.router_replay.mode), None
        megatron, dtype, model = arr.ref.megatron, _dtype(arr.model.dtype), None  # no backward: no recompute
    elif role == "critic":
        c = cfg.critic
        path = c.model.path or arr.model.path
        ecfg = EngineConfig.from_critic(c, arr.actor, arr.rollout, dp)
        optim = dataclasses.replace(c.optim, total_training_steps=total_steps)
        megatron, dtype, model = c.megatron, _dtype(c.model.dtype), c.model
        lora = LoraSpec.from_config(c.model, "critic.model")
    else:
        raise ValueError(f"role={role!r}; choose actor, ref or critic")
    if lora is not None:
        # a captured decoder graph would replay with the adapters on when the reference pass switches them off
        if ecfg.cuda_graphs:
            raise ValueError(f"{ecfg.graph_key}=true with LoRA (lora_rank={lora.rank}): the reference pass switches "
                             "the adapters off, which a captured CUDA graph cannot see; set it to false or leave it "
                             "unset (off with LoRA).")
        ecfg = dataclasses.replace(ecfg, cuda_graphs=False)
    overrides = {**(recompute_overrides_for(model, megatron) if model is not None else {}),
                 **pipeline_split(cfg),  # every role: the actor's stage split
                 **moe_overrides(megatron), **_replay_overrides(path, role, ecfg)}
    if model is not None and megatron.override_transformer_config.gradient_accumulation_fusion:
        from rlhf_mcore.models.grad_accum_fusion import install

        install()  # megatron-core's linears then accumulate weight gradients into main_grad without APEX
        overrides["gradient_accumulation_fusion"] = True
        ecfg = dataclasses.replace(ecfg, cuda_graphs=False)  # graphed layers see aliases without main_grad
    if megatron.sequence_parallel and state.dims.tp > 1:
        overrides["sequence_parallel"] = True
    chunks = build_model(path, state, role=role, dtype=dtype, load_weights=load_weights,
                         config_overrides=overrides or None, lora=lora, lora_seed=megatron.seed)
    if megatron.fp8 is not None:
        from rlhf_mcore.models.fp8_training import enable_fp8_training

        key = "critic.megatron.fp8" if role == "critic" else f"actor_rollout_ref.{role}.megatron.fp8"
        enable_fp8_training(chunks, megatron.fp8, key, megatron.fp8_recipe, megatron.fp8_weight_cache,
                            megatron.fp8_amax_history_len)
    engine = TrainEngine(chunks, state, ecfg, optim, use_distributed_optimizer=megatron.use_distributed_optimizer,
                       hf_dir=str(path), param_offload=megatron.param_offload,
                       grad_offload=megatron.grad_offload, optimizer_offload=megatron.optimizer_offload)
    engine.lora = lora  # None, or the adapters' spec (PEFT export: rlhf_mcore.models.lora.save_peft_adapter)
    return engine
