"""Transformer layer specs: Transformer Engine's when it imports, else Megatron's local spec with SDPA attention.

`backend`:
- "auto": "te" when `transformer_engine` imports, else "sdpa";
- "te": Megatron's TE spec (fused layernorm+linear, TE attention). Not exercised by this project's tests,
  which run without Transformer Engine;
- "sdpa": the local spec (ColumnParallelLinear/RowParallelLinear, torch RMSNorm) with `SDPACoreAttention`
  replacing `core_attention` (fused attention kernels, GQA without repeats, packed sequences);
- "local": Megatron's local spec unchanged (`DotProductAttention`; no packed sequences) — the baseline of
  `launch/bench_attention.py`.
"""
from __future__ import annotations

import copy
import importlib.util

from rlhf_mcore.models.hf_config import ModelShape

BACKENDS = ("auto", "te", "sdpa", "local")


def te_available() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions import transformer_engine as _te_ext  # noqa: F401
    except Exception:  # a broken TE install (e.g. CUDA mismatch) must not stop the local path
        return False
    return True


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}.")
    if backend == "auto":
        return "te" if te_available() else "sdpa"
    if backend == "te" and not te_available():
        raise ValueError("attention backend 'te' requested but transformer_engine does not import; "
                         "install Transformer Engine or use 'sdpa'.")
    return backend


def layer_spec(shape: ModelShape, backend: str = "auto", fused_swiglu: bool = False):
    """The `ModuleSpec` of one transformer layer for this model family and backend. fused_swiglu (the "sdpa"
    backend only): the MLP's activation is `fused_layers.FusedSwiGLU` (the config then needs
    `use_te_activation_func=True`, which makes Megatron's MLP call a module activation)."""
    backend = resolve_backend(backend)
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=shape.qk_norm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=shape.qk_norm)
    if backend == "local":
        return spec
    from rlhf_mcore.models.attention import SDPACoreAttention

    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if fused_swiglu:
        from rlhf_mcore.models.fused_layers import FusedSwiGLU

        spec.submodules.mlp.submodules.activation_func = FusedSwiGLU
    return spec
