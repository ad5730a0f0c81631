"""The native engine's weights read back in Hugging Face layout (its `hf_weight_shards()`, for verifying a sync).

For every HF tensor name, the tensor the engine holds for it (a view into its storage, e.g. the q rows of the
fused QKV matrix) and which slice of the full HF tensor that should be: (name, tensor, dim, rank, size), an even
split along `dim` over the rollout TP ranks (`dim=None`: replicated). The slicing rules are written out here
independently of the loader (:mod:`.weights`): column-parallel q/k/v and gate/up rows, row-parallel o_proj/down
columns, everything else replicated; so a slicing bug in the loader shows up as a verification failure
(:mod:`rlhf_mcore.sync.verify`).
"""
from __future__ import annotations

from typing import Optional

import torch

from rlhf_mcore.rollout.native.moe import moe_hf_shards

__all__ = ["hf_weight_shards"]

Shard = tuple[str, torch.Tensor, Optional[int], int, int]  # (name, tensor, dim, rank, size)


def hf_weight_shards(w) -> list[Shard]:
    """The HF tensors held by `w` (a `ModelWeights`), as (name, tensor, dim, rank, size) with `tensor` a view into
    `w` (module docstring); RuntimeError when the weights are released."""
    if w is None:
        raise RuntimeError("cannot read back the native engine's weights while it sleeps at level 2; wake() it "
                           "before verifying a weight sync.")
    spec, rank, size = w.spec, w.tp_rank, w.tp_size
    hd = spec.head_dim
    q_rows, kv_rows = w.heads * hd, w.kv_heads * hd
    out: list[Shard] = []

    def add(name, tensor, dim=None):
        out.append((name, tensor, dim, rank, size) if dim is not None else (name, tensor, None, 0, 1))

    add("model.embed_tokens.weight", w.embed)
    add("model.norm.weight", w.final_norm)
    if not spec.tie_word_embeddings:
        add("lm_head.weight", w.lm_head)
    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", layer.input_norm)
        add(p + "post_attention_layernorm.weight", layer.post_norm)
        # fused qkv rows: [q of this rank's heads; k of its kv heads; v of its kv heads]
        add(p + "self_attn.q_proj.weight", layer.qkv[:q_rows], 0)
        add(p + "self_attn.k_proj.weight", layer.qkv[q_rows:q_rows + kv_rows], 0)
        add(p + "self_attn.v_proj.weight", layer.qkv[q_rows + kv_rows:q_rows + 2 * kv_rows], 0)
        if layer.qkv_bias is not None:
            add(p + "self_attn.q_proj.bias", layer.qkv_bias[:q_rows], 0)
            add(p + "self_attn.k_proj.bias", layer.qkv_bias[q_rows:q_rows + kv_rows], 0)
            add(p + "self_attn.v_proj.bias", layer.qkv_bias[q_rows + kv_rows:q_rows + 2 * kv_rows], 0)
        if layer.q_norm is not None:
            add(p + "self_attn.q_norm.weight", layer.q_norm)
            add(p + "self_attn.k_norm.weight", layer.k_norm)
        add(p + "self_attn.o_proj.weight", layer.o_proj, 1)
        if layer.router is not None:  # a MoE layer: experts split like dense MLPs, router and gates replicated
            moe_hf_shards(layer, p, add)
            continue
        # fused [gate; up] rows, each this rank's 1/size of the MLP width
        add(p + "mlp.gate_proj.weight", layer.gate_up[:w.inter], 0)
        add(p + "mlp.up_proj.weight", layer.gate_up[w.inter:2 * w.inter], 0)
        add(p + "mlp.down_proj.weight", layer.down, 1)
    return out
