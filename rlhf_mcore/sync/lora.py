"""Adapter-only weight sync of a LoRA actor: the training side sends the adapters (PEFT-named A and B, a few MB),
the rollout side merges them into its own copy of the base weights and loads `W0 + (alpha / r) * B @ A`.

The merged sync (the default, :func:`rlhf_mcore.sync.sync_actor_to_rollout` of `actor.export_hf_weights()`, which
folds the adapters in per tensor) sends every weight; this one (`actor_rollout_ref.rollout.lora_sync=adapter_only`)
sends `2 r (in + out)` numbers per adapted linear instead of `in * out`, and only the adapted tensors are reloaded
(the frozen rest already sits in the engine from the first, full, sync). The receiver pays for it with a copy of the
base weights of the adapted tensors (:class:`BaseWeights`, read once from the base's safetensors, kept on the host)
that goes to the engine's device at every sync, with the merge products. `launch/bench/bench_lora_sync.py` measures
both (BENCHMARKS.md): adapter-only is faster on CPU, merged by 64x at the 7B shape on an H200 (0.096 s against
6.1 s, where the host copy's 13 GB cross to the GPU), hence the default.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import torch

from .colocated import sync_actor_to_rollout


def base_name(peft_name: str) -> str:
    """`base_model.model.model.layers.N.<parent>.<t>.lora_A.weight` -> `model.layers.N.<parent>.<t>.weight`."""
    from rlhf_mcore.models.lora import PEFT_PREFIX

    stem = peft_name.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0]
    return f"{stem}.weight"


class BaseWeights:
    """The base model's full HF tensors of the adapted linears (host memory), read once from its safetensors."""

    def __init__(self, hf_dir, names):
        from safetensors import safe_open

        self.tensors = {}
        wanted = set(names)
        for f in sorted(Path(hf_dir).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                for name in wanted & set(sf.keys()):
                    self.tensors[name] = sf.get_tensor(name)
        missing = wanted - set(self.tensors)
        if missing:
            raise FileNotFoundError(f"the base model in {hf_dir} lacks {len(missing)} adapted weights (e.g. "
                                    f"{sorted(missing)[0]}): is it the base the adapters were trained on?")

    def merged(self, adapters: dict, scale: float, device, dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, W0 + scale * B @ A) for every adapted linear, on `device` in `dtype`."""
        for a_name in [n for n in adapters if ".lora_A." in n]:
            a, b = adapters[a_name], adapters[a_name.replace(".lora_A.", ".lora_B.")]
            name = base_name(a_name)
            w0 = self.tensors[name].to(device=device, dtype=torch.float32)
            delta = b.to(device=device, dtype=torch.float32) @ a.to(device=device, dtype=torch.float32)
            yield name, (w0 + scale * delta).to(dtype)


def sync_adapters_to_rollout(actor, rollout, state, base: BaseWeights, *, bucket_mb: float = 512
                             ) -> dict[str, float]:
    """Adapter-only sync into `rollout` (an engine that takes partial `update_weights`, e.g. the native one) after a
    first full sync. Returns `sync/*` metrics: `sync/adapter_bytes` (what crosses from training to rollout),
    `sync/gather_seconds` (the adapters' TP/PP gather), `sync/merge_load_seconds` (the receiver's merge + load),
    `sync/seconds` (both), and the load's own `sync/*` counters under `sync/load/`."""
    from rlhf_mcore.models.lora import adapter_tensors

    device = state.device
    t0 = time.perf_counter()
    adapters = adapter_tensors(actor.chunks, state)
    gathered = time.perf_counter()
    dtype = next(iter(actor.chunks[0].parameters())).dtype
    load = sync_actor_to_rollout(base.merged(adapters, actor.lora.scale, device, dtype), rollout, state,
                                 bucket_mb=bucket_mb)  # a partial load: sync_verify checks full syncs only
    done = time.perf_counter()
    out = {f"sync/load/{k.removeprefix('sync/')}": v for k, v in load.items()}
    out.update({"sync/adapter_bytes": float(sum(t.numel() * t.element_size() for t in adapters.values())),
                "sync/gather_seconds": gathered - t0, "sync/merge_load_seconds": done - gathered,
                "sync/seconds": done - t0})
    return out
