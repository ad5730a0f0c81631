"""Save and load a training engine through Megatron's distributed checkpointing (`dist_checkpointing`).

One directory holds the model (every tensor as a global `ShardedTensor`, so any TP/PP layout can read it),
the optimizer, the LR scheduler and the RNG states. Every rank calls :func:`save_checkpoint` /
:func:`load_checkpoint` (collective); each writes/reads only its own shards.

The directory also holds `hf_meta/` (the HF config, tokenizer and chat template of the model's source
directory), so a training checkpoint converts to HF on its own (`launch/convert_checkpoint.py`).

LoRA models (:mod:`rlhf_mcore.models.lora`): the model part holds only what trains -- the adapters (and a critic's
value head) -- with their optimizer state; `lora_base` names the base HF directory with a hash of it, checked on
load.

Resharding:
- model: loadable under any TP/PP/VPP/DP layout (the tensors are stored in their global shape);
- optimizer: the distributed optimizer is saved in Megatron's `fully_reshardable` form (gathered per
  parameter into canonical, unsharded tensors), so it too loads under a different TP/PP/DP; the plain
  (non-distributed) optimizer is saved per parameter as well;
- RNG states are per (PP, TP, DP) rank and are restored only under the same layout (a different layout
  starts from the seeded generators, as Megatron-LM does); so are the amax histories of FP8 delayed scaling
  (`fp8_recipe=delayed`: per rank, saved beside its RNG states; a different layout primes them again from its
  first casts);
- scheduler: plain values, layout-independent.

Loading executes nothing from the files (:mod:`rlhf_mcore.engine.safe_load`): tensors and plain data only, so the
RNG states are stored as tensors and numbers (checkpoints that hold them as numpy arrays still load).

Every entry script that saves must have an `if __name__ == "__main__":` guard: the writer starts helper
processes, and without the guard the save hangs inside `multiprocessing.Manager()`.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from rlhf_mcore.engine.optim import group_settings, resume_schedule
from rlhf_mcore.engine.safe_load import load_common, load_distributed, tensor_keys

__all__ = ["save_checkpoint", "load_checkpoint", "OPTIMIZER_SHARDING"]

OPTIMIZER_SHARDING = "fully_reshardable"
LORA_BASE_KEY = "lora_base"  # a LoRA checkpoint: {path, sha256} of the base HF directory and the adapters' spec
_LAYOUT_KEY = "layout"


def _fp8_amaxes(modules) -> list:
    """The FP8 delayed-scaling amax histories of the model chunks (`ActivationAmaxes`; None for a chunk without)."""
    found = []
    for m in modules:
        while getattr(m, "fp8_activation_amaxes", None) is None and hasattr(m, "module"):  # DDP, Float16Module
            m = m.module
        found.append(getattr(m, "fp8_activation_amaxes", None))
    return found


def _rng_state(modules=()) -> dict:
    """This rank's RNG states as tensors, numbers and strings (what `weights_only` loading reads), and the chunks'
    FP8 amax histories where the delayed recipe keeps them (per-rank state like the generators)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
             "numpy_mt": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
             "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    amaxes = _fp8_amaxes(modules)
    if any(a is not None for a in amaxes):
        state["fp8_amaxes"] = [a.state_dict() if a is not None else None for a in amaxes]
    return state


def _set_rng_state(state: dict, modules=()) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(int(x) for x in internal.tolist()), gauss))
        name, keys, pos, has_gauss, cached = state["numpy_mt"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    else:  # written before the states were stored as tensors: Python's tuple and numpy's array as they were
        random.setstate(state["random"])
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    for amaxes, saved in zip(_fp8_amaxes(modules), state.get("fp8_amaxes", ())):
        if amaxes is not None and saved is not None:
            amaxes.load_state_dict(saved)


def _layout(state) -> dict:
    return {"tp": state.dims.tp, "pp": state.dims.pp, "dp": state.dims.dp, "vpp": state.dims.vpp}


def _model_sharded_state_dict(modules: list[torch.nn.Module]) -> dict:
    """The model's tensors; with LoRA only what trains (the adapters, a critic's head): the base is its HF
    directory (`lora_base`)."""
    from rlhf_mcore.models.lora import has_lora, trainable_sharded_state_dict

    sd = {}
    for i, m in enumerate(modules):
        inner = getattr(m, "module", m)  # unwrap DDP
        sd["model" if len(modules) == 1 else f"model{i}"] = (
            trainable_sharded_state_dict(inner) if has_lora([inner]) else inner.sharded_state_dict())
    return sd


def _inner_optimizers(optimizer) -> list:
    if hasattr(optimizer, "chained_optimizers"):
        return [o for c in optimizer.chained_optimizers for o in _inner_optimizers(c)]
    return [optimizer]


def _ensure_optimizer_state(optimizer) -> None:
    """Give a fresh Adam its state tensors (zero moments, step 0) so Megatron can describe — and then load —
    its state dict. Megatron's own `init_state_fn` omits torch Adam's `step`, which the distributed
    optimizer's `state_dict()` requires when neither Apex nor Transformer Engine is installed."""
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if len(inner.state[p]) == 0:
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p.data),
                                      "exp_avg_sq": torch.zeros_like(p.data)}


def _keep_step_on_load(optimizer) -> None:
    """Work around megatron-core 0.16's distributed optimizer with torch's Adam (no Apex / Transformer Engine):
    `load_state_dict` puts torch Adam's `step` into every parameter's state, then the per-parameter loaders
    (`fully_reshardable`, `fully_sharded_model_space`) copy *every* state key from the checkpoint tensors,
    which have no `step` -> KeyError. The step itself is restored from the param groups; the patch, on this
    optimizer instance only, lets the per-parameter copy keep it."""
    for opt in _inner_optimizers(optimizer):
        if not hasattr(opt, "_set_main_param_and_optimizer_states") or getattr(opt, "_rlhf_step_patch", False):
            continue
        original = opt._set_main_param_and_optimizer_states

        def patched(model_param, tensors, _opt=opt, _original=original):
            group_index, group_order = _opt.model_param_group_index_map[model_param]
            main_param = _opt.optimizer.param_groups[group_index]["params"][group_order]
            state = _opt.optimizer.state.get(main_param, {})
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
            return _original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = patched
        opt._rlhf_step_patch = True


def _unshare_steps(optimizer) -> None:
    """Give every parameter its own Adam `step` tensor after a load. megatron-core 0.16 (torch Adam path) puts
    one shared tensor into every parameter's state; torch's Adam increments each parameter's step in place,
    so the shared one would advance once per parameter per update and skew Adam's bias correction."""
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        for state in (inner.state.values() if inner is not None else []):
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _sharded_state_dict(modules, optimizer, scheduler, state, is_loading: bool, with_rng: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd = _model_sharded_state_dict(modules)
    if optimizer is not None:
        if is_loading:
            _ensure_optimizer_state(optimizer)
        # the optimizer's entries are keyed by the model's ShardedTensors; it needs the model's state dict
        sd["optimizer"] = optimizer.sharded_state_dict(
            dict(sd), is_loading=is_loading, metadata={"distrib_optim_sharding_type": OPTIMIZER_SHARDING})
    if scheduler is not None:
        sd["scheduler"] = scheduler.state_dict()
    if with_rng:
        d = state.dims
        sd["rng_state"] = ShardedObject("rng_state", _rng_state(modules), (d.pp, d.tp, d.dp),
                                        (state.pp_rank, state.tp_rank, state.dp_rank), replica_id=0)
    sd[_LAYOUT_KEY] = _layout(state)
    base = _lora_base(modules)
    if base is not None:
        sd[LORA_BASE_KEY] = base
    return sd


def _lora_base(modules) -> Optional[dict]:
    """A LoRA model's base: its HF directory and `lora.base_hash` of it, and the adapters' spec (None without LoRA)."""
    from rlhf_mcore.models.hf_loader import unwrap_model
    from rlhf_mcore.models.lora import base_hash, has_lora

    model = unwrap_model(modules[0])
    if not has_lora([model]):
        return None
    spec = model.lora_spec
    return {"path": str(model.hf_dir), "sha256": base_hash(model.hf_dir), "rank": spec.rank, "alpha": spec.alpha,
            "target_modules": list(spec.targets)}


def save_checkpoint(path: str | Path, modules: list[torch.nn.Module], state, optimizer=None, scheduler=None,
                    extra: Optional[dict] = None, hf_dir: Optional[str] = None) -> None:
    """Write model (+ optimizer, scheduler, RNG, `extra` plain values) into the directory `path`, and the
    model's HF config and tokenizer into `path/hf_meta/` (from `hf_dir`, default the chunks' own `hf_dir`), so
    that `launch/convert_checkpoint.py --direction mcore2hf` needs nothing but the checkpoint."""
    from megatron.core import dist_checkpointing

    from rlhf_mcore.models.hf_loader import unwrap_model
    from rlhf_mcore.models.mcore_checkpoint import write_hf_meta

    path = Path(path)
    if state.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sd = _sharded_state_dict(modules, optimizer, scheduler, state, is_loading=False, with_rng=True)
    if extra:
        sd["extra"] = extra
    dist_checkpointing.save(sd, str(path))
    model = unwrap_model(modules[0])
    hf_dir = hf_dir or getattr(model, "hf_dir", None)
    if state.rank == 0 and hf_dir is not None:
        write_hf_meta(path, hf_dir, getattr(model, "model_role", "actor"), state)
    dist.barrier()


def load_checkpoint(path: str | Path, modules: list[torch.nn.Module], state, optimizer=None, scheduler=None,
                    load_optimizer: bool = True, load_rng: bool = True) -> dict:
    """Load what `save_checkpoint` wrote into the given modules/optimizer/scheduler (in place).

    The optimizer's state (moments, step counts) and the scheduler's step count come from the checkpoint; its
    settings (lr, schedule, warmup, min_lr, weight decay, betas, eps) stay those `optimizer` and `scheduler` were
    built with (the run's config): rank 0 prints the LR in effect and each setting that differs from the saved one.
    Returns the checkpoint's plain entries (`layout`, `extra`). The RNG is restored only when the
    checkpoint was written under the same TP/PP/DP layout.
    """
    path = Path(path)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"{path} is not a Megatron distributed checkpoint (no metadata.json); pass the "
                                "directory given to save_checkpoint")
    common = load_common(path)
    saved_layout = common.get(_LAYOUT_KEY, {})
    same_layout = {k: saved_layout.get(k) for k in ("tp", "pp", "dp")} == \
        {k: v for k, v in _layout(state).items() if k != "vpp"}
    if load_optimizer and optimizer is not None and "optimizer" not in common and not _has_optimizer(path):
        raise ValueError(f"{path} holds no optimizer state; load with load_optimizer=False")
    sd = _sharded_state_dict(modules, optimizer if load_optimizer else None,
                             scheduler if "scheduler" in common else None, state, is_loading=True,
                             with_rng=load_rng and same_layout)
    _check_lora_base(path, common.get(LORA_BASE_KEY), sd.get(LORA_BASE_KEY))
    loaded = load_distributed(sd, path)
    for i, m in enumerate(modules):
        inner = getattr(m, "module", m)
        if LORA_BASE_KEY in sd:
            from rlhf_mcore.models.lora import load_trainable_state_dict

            load_trainable_state_dict(inner, loaded["model" if len(modules) == 1 else f"model{i}"])
        else:
            inner.load_state_dict(loaded["model" if len(modules) == 1 else f"model{i}"], strict=True)
    config_groups = None
    if load_optimizer and optimizer is not None:
        config_groups = group_settings(optimizer)  # the loaded param groups replace these: put back below
        _keep_step_on_load(optimizer)
        optimizer.load_state_dict(loaded["optimizer"])
        _unshare_steps(optimizer)
    if scheduler is not None and "scheduler" in loaded:  # the config's schedule at the checkpoint's step
        changes = resume_schedule(optimizer if config_groups is not None else None, scheduler, loaded["scheduler"],
                                  config_groups)
        if state.is_coordinator:
            lr = optimizer.param_groups[0]["lr"] if optimizer is not None else scheduler.get_lr({})
            print(f"{path}: optimizer resumed at scheduler step {scheduler.num_steps}, LR in effect {lr:.6g}; "
                  + (f"the config's settings replace the checkpoint's: {'; '.join(changes)}" if changes else
                     "settings as saved"), flush=True)
    if load_rng and same_layout and "rng_state" in loaded:
        _set_rng_state(loaded["rng_state"], modules)
    return {k: loaded.get(k) for k in (_LAYOUT_KEY, "extra")}


def _check_lora_base(path: Path, saved: Optional[dict], mine: Optional[dict]) -> None:
    """A LoRA checkpoint loads only into a LoRA model of the same spec on the same base (and a full one only into
    a model without adapters)."""
    if saved is None and mine is None:
        return
    if saved is None:
        raise ValueError(f"{path} is a full-model checkpoint, but this model has LoRA adapters: set "
                         "actor_rollout_ref.model.lora_rank=0 (critic.model.lora_rank for a critic) to resume it.")
    if mine is None:
        raise ValueError(f"{path} holds LoRA adapters (rank {saved['rank']}), but this model has none: set "
                         f"lora_rank={saved['rank']}, lora_alpha={saved['alpha']:g}, target_modules="
                         f"{saved['target_modules']} to resume it.")
    for key in ("rank", "alpha", "target_modules"):
        if saved[key] != mine[key]:
            raise ValueError(f"{path} holds LoRA adapters with {key}={saved[key]!r}, this model's is {mine[key]!r}: "
                             "set the lora_* keys to the checkpoint's.")
    if saved["sha256"] != mine["sha256"]:
        raise ValueError(f"{path} holds LoRA adapters trained on the base {saved['path']} (sha256 "
                         f"{saved['sha256'][:12]}), but this model's base {mine['path']} differs (sha256 "
                         f"{mine['sha256'][:12]}): point actor_rollout_ref.model.path at the checkpoint's base.")


def _has_optimizer(path: Path) -> bool:
    return any(k.startswith("optimizer.") for k in tensor_keys(path))
