"""Core attention with PyTorch's fused kernels, as a drop-in `core_attention` for Megatron's local layer spec.

Megatron's local `DotProductAttention` materialises the (B, heads, S, S) score matrix, softmaxes it with a
mask and multiplies again; it also refuses packed sequences. This module calls
`torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels on GPU) instead:

- no mask given, no packing: `is_causal=True`, the fast path;
- a boolean mask (B or 1, 1, S, S) with True = masked out (Megatron's convention; e.g. causal + left padding):
  passed to SDPA inverted. Rows that would mask everything (a padding query in a left-padded row) are allowed
  to attend to themselves, so they stay finite instead of NaN (their outputs are padding and never used);
- packed sequences (`PackedSeqParams(qkv_format="thd")`, documents back to back, cu_seqlens): on GPU in
  bf16/fp16 torch's variable-length Flash Attention (`torch.nn.attention.varlen`, where torch has it: 2.11
  and 2.13 do), else `flex_attention`, compiled, with a document-causal block mask; on CPU (where
  flex_attention has no backward) one causal SDPA call per document;
- grouped-query attention through `enable_gqa=True`: keys/values are never repeated in memory.

Megatron's attention hands over query (sq, b, np, hn), key/value (sk, b, ng, hn) — or (t, np, hn) when
packed — and expects (sq, b, np * hn) back; head counts are read from the tensors, so the TP layout (including
fewer query groups than TP ranks) needs no special case here.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from rlhf_mcore.models.attention_ops import (
    dense_attention,
    flex_block_mask,
    packed_attention_flex,
    packed_attention_per_document,
    packed_attention_varlen,
    shared_prefix_attention,
    shared_prefix_layout,
    varlen_available,
)


def _packed_boundaries(params: PackedSeqParams) -> torch.Tensor:
    """Document boundaries in the packed tensor (the padded ones when each document is padded in place)."""
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    if cu is None:
        raise ValueError("PackedSeqParams(qkv_format='thd') needs cu_seqlens_q (int32 document offsets, "
                         "starting at 0 and ending at the packed length).")
    return cu


class SDPACoreAttention(MegatronModule):
    """Megatron `core_attention` backed by SDPA / flex_attention (see the module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not implement context parallelism; set context_parallel_size=1"
                             " or use the Transformer Engine layer spec.")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding, AttnMaskType.padding_causal):
            raise ValueError(f"SDPACoreAttention supports causal attention only, got {attn_mask_type}.")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not take an attention_bias.")
        dropout_p = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params, dropout_p)  # (T, np, hn)
        if packed_seq_params is not None and packed_seq_params.qkv_format not in (None, "sbhd"):
            raise ValueError(f"qkv_format={packed_seq_params.qkv_format!r} is not supported; use 'thd' or 'sbhd'.")
        sq, b, n_heads, head_dim = query.shape
        # (s, b, n, hn) -> (b, n, s, hn)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = dense_attention(q, k, v, attention_mask, self.softmax_scale, dropout_p)  # (b, np, sq, hn)
        return out.permute(2, 0, 1, 3).reshape(sq, b, n_heads * head_dim)

    def _packed(self, query, key, value, params: PackedSeqParams, dropout_p: float) -> torch.Tensor:
        layout = shared_prefix_layout(params)
        if layout is not None:  # each prompt packed once for its responses (rlhf_mcore.engine.shared_prefix)
            if dropout_p:
                raise ValueError("shared-prompt packing (model.share_prompt_prefix) takes no attention dropout")
            return shared_prefix_attention(query, key, value, layout, self.softmax_scale)
        cu = _packed_boundaries(params)
        max_len = max(params.max_seqlen_q or 0, params.max_seqlen_kv or 0)
        if (query.is_cuda and dropout_p == 0.0 and query.dtype in (torch.bfloat16, torch.float16) and max_len > 0
                and varlen_available()):
            # Flash Attention over cu_seqlens: no mask to build, and faster than flex_attention's kernel
            return packed_attention_varlen(query, key, value, cu, max_len, self.softmax_scale)
        if query.is_cuda and dropout_p == 0.0:
            # one BlockMask per packed batch, shared by all layers: cached on the params object
            cached = getattr(params, "_rlhf_block_mask", None)
            if cached is None or cached[0] is not cu or cached[1] != query.size(0):
                cached = (cu, query.size(0), flex_block_mask(cu, query.size(0)))
                params._rlhf_block_mask = cached
            return packed_attention_flex(query, key, value, cached[2], self.softmax_scale, compiled=True)
        return packed_attention_per_document(query, key, value, cu, self.softmax_scale, dropout_p)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}  # no parameters
