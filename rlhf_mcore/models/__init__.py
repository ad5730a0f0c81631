"""Model definitions: HF config -> Megatron TransformerConfig, layer specs, weight conversion, tiny test models.

    hf_config     config.json -> ModelShape -> TransformerConfig + GPTModel args (Qwen2/2.5, Llama 3, Qwen3)
    rope          HF-exact RoPE frequencies (Llama 3 scaling) installed into Megatron's rotary module; packed
                  (THD) RoPE without host syncs
    attention     SDPACoreAttention: Megatron core_attention on SDPA / flex_attention
    attention_ops its plain-torch math (causal, padding masks, packed THD document-causal, GQA)
    layer_specs   Transformer Engine spec when importable, else local spec + SDPA attention
    weight_map    HF tensor <-> Megatron shard index arithmetic (fused QKV per group, [gate; up], vocab padding)
    hf_loader     per-rank slice-wise safetensors loading (ReadLog)
    hf_export     streaming full-tensor export from any TP/PP layout; HF checkpoint directories
    value_head    the critic's width-1 head
    builder       build_model(hf_dir, state, role=...)
    mcore_checkpoint  Megatron distributed checkpoints of the model chunks
    tiny          tiny random HF models for tests and demos

Heavy imports (torch, megatron, transformers) happen on first use, so `import rlhf_mcore.models` (and its
torch-free `pipeline_layout`, which the config checks with) is cheap.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf_mcore.models.hf_config import ModelShape

_LAZY = {
    "ModelShape": "rlhf_mcore.models.hf_config",
    "UnsupportedModelError": "rlhf_mcore.models.hf_config",
    "load_hf_config": "rlhf_mcore.models.hf_config",
    "build_model": "rlhf_mcore.models.builder",
    "load_hf_weights": "rlhf_mcore.models.hf_loader",
    "ReadLog": "rlhf_mcore.models.hf_loader",
    "export_hf_weights": "rlhf_mcore.models.hf_export",
    "save_hf_checkpoint": "rlhf_mcore.models.hf_export",
    "save_mcore_checkpoint": "rlhf_mcore.models.mcore_checkpoint",
    "load_mcore_checkpoint": "rlhf_mcore.models.mcore_checkpoint",
}


def __getattr__(name):  # PEP 562: import torch- and megatron-dependent modules on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlhf_mcore.models' has no attribute {name!r}")


def model_spec(hf_dir) -> ModelShape:
    """What the FLOP model needs (layers, hidden, heads, kv heads, head_dim, ffn, vocab): `ModelShape`."""
    from rlhf_mcore.models.hf_config import ModelShape

    return ModelShape.from_hf_dir(hf_dir)


__all__ = ["model_spec", *_LAZY]
