"""RoPE inverse frequencies equal to Hugging Face's, installed into Megatron's rotary module.

Megatron-Core's `RotaryEmbedding` computes `1 / theta^(2i/d)` like HF, but its Llama-3 scaling hard-codes
low_freq_factor=1, high_freq_factor=4 and original_max_position_embeddings=8192; checkpoints (and our tiny
test models) use other values. So the frequencies are computed here from the config, with the same float32
operations in the same order as transformers (so they agree bit for bit: see tests/test_models.py), and
written over the module's `inv_freq`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from rlhf_mcore.models.attention_ops import tensor_version
from rlhf_mcore.models.hf_config import ModelShape


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """(head_dim / 2,) float32: theta^(-2i/d) for i = 0 .. d/2-1."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta ** exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: float) -> torch.Tensor:
    """Llama 3's frequency-dependent scaling of RoPE frequencies.

    Wavelengths longer than original_ctx / low_freq_factor are slowed by `factor`; shorter than
    original_ctx / high_freq_factor are kept; those in between are interpolated linearly in
    original_ctx / wavelength between the two.
    """
    longest_kept = original_max_position_embeddings / high_freq_factor   # shorter wavelengths are unchanged
    shortest_scaled = original_max_position_embeddings / low_freq_factor  # longer wavelengths are / factor
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > shortest_scaled, inv_freq / factor, inv_freq)
    blend = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_between = ~(wavelength < longest_kept) * ~(wavelength > shortest_scaled)
    return torch.where(in_between, blended, scaled)


def rope_inv_freq(shape: ModelShape) -> torch.Tensor:
    """(head_dim / 2,) float32 inverse frequencies of the HF model described by `shape`."""
    inv_freq = default_inv_freq(shape.head_dim, shape.rope_theta)
    if shape.rope_llama3 is not None:
        inv_freq = llama3_inv_freq(inv_freq, *shape.rope_llama3)
    return inv_freq


def install_rope(model, shape: ModelShape, device) -> None:
    """Overwrite `model.rotary_pos_emb.inv_freq` with HF's frequencies (and drop Megatron's cached tables)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        raise ValueError("GPTModel has no rotary_pos_emb; build it with position_embedding_type='rope'.")
    rotary.inv_freq = rope_inv_freq(shape).to(device)
    cache_clear = getattr(type(rotary).forward, "cache_clear", None)  # forward is lru_cached on (self, len, ...)
    if cache_clear is not None:
        cache_clear()


# ---------------------------------------------------------------------------------------------------------------
# Packed (THD) RoPE without host synchronisation
#
# Megatron-Core's unfused THD RoPE (`rope_utils._apply_rotary_pos_emb_thd`) reads the document lengths on the host
# (`cu_seqlens.tolist()`) and slices the frequencies document by document, for the query and the key of every
# layer: 2 × layers device→host synchronisations and ~2 × documents small kernels per layer in every forward. The
# CPU can then never run ahead of the GPU, and on packed micro-batches of many short RL sequences the step is
# bound by the host. The fused THD kernel that avoids this needs Transformer
# Engine. Here the position of every packed token inside its document is computed on the device (no sync), the
# cos/sin tables are gathered once per forward (shared by all layers, query and key) and applied in one pass;
# the result is the same arithmetic as Megatron's, bit for bit (tests/test_models.py).
# ---------------------------------------------------------------------------------------------------------------

# a cu_seqlens tensor may carry its tokens' positions under this attribute ((total,) int64), when they do not restart
# at 0 in every document: shared-prompt packing (rlhf_mcore.engine.shared_prefix) places a response after its prompt
POSITIONS_ATTR = "rlhf_positions"
_PACKED_TABLES: tuple = (None, -1, None, 0, None, None)  # (cu_seqlens, its _version, freqs, total, dtype, (cos, sin))
_MEGATRON_APPLY = None  # megatron.core.transformer.attention.apply_rotary_pos_emb before install_packed_rope


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) int64: the position of each packed token inside its document (documents start at the offsets
    `cu_seqlens`, int, [0, ..., total]); computed on the device without reading it on the host."""
    cu = cu_seqlens.to(torch.int64)
    tokens = torch.arange(total, device=cu.device)
    doc = torch.searchsorted(cu[1:].contiguous(), tokens, right=True).clamp_(max=cu.numel() - 2)
    return tokens - cu[doc]


def clear_packed_tables() -> None:
    """Forget the cached packed cos/sin tables (a CUDA graph capture must compute them inside the graph)."""
    global _PACKED_TABLES
    _PACKED_TABLES = (None, -1, None, 0, None, None)


def _packed_cos_sin(freqs: torch.Tensor, cu_seqlens: torch.Tensor, total: int, dtype: torch.dtype, mscale: float):
    """(cos, sin) of shape (total, 1, 1, rot_dim) in `dtype` for the packed tokens; cached for the last batch
    (every layer and both query and key of one forward pass share them)."""
    global _PACKED_TABLES
    c = _PACKED_TABLES
    version = tensor_version(cu_seqlens)
    if c[0] is cu_seqlens and version is not None and c[1] == version and c[2] is freqs and c[3] == total and c[4] == (
            dtype, mscale):
        return c[5]
    positions = getattr(cu_seqlens, POSITIONS_ATTR, None)
    if positions is None or positions.numel() != total:
        positions = packed_positions(cu_seqlens, total)
    f = freqs.index_select(0, positions)  # (total, 1, 1, rot_dim)
    tables = ((torch.cos(f) * mscale).to(dtype), (torch.sin(f) * mscale).to(dtype))
    _PACKED_TABLES = (cu_seqlens, version, freqs, total, (dtype, mscale), tables)
    return tables


def apply_rope_packed(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens: Optional[torch.Tensor] = None,
                      mscale: float = 1.0, cp_group=None) -> torch.Tensor:
    """Drop-in for megatron's `apply_rotary_pos_emb` (same signature). Packed input `t` (total, heads, dim) with
    `cu_seqlens` and per-document frequencies `freqs` (max_len, 1, 1, rot_dim) takes the sync-free path; all
    other cases (unpacked, fused RoPE, context parallelism, multi-latent attention, interleaved rotation) go to
    Megatron's function unchanged.

    Positions restart at 0 in every document (how the engine packs), unless `cu_seqlens` carries its tokens'
    positions (`POSITIONS_ATTR`, shared-prompt packing). When `freqs` happens to be exactly as long
    as the packed tensor (`max_seqlen` = total, as in the CUDA graphs' static shapes), Megatron's function would
    switch to positions in the packed tensor (its mode for per-token frequency tables); this engine never builds
    those, and shifting all of a document's positions by one offset leaves rotary attention scores unchanged, so
    the per-document path is kept (it also never reads `cu_seqlens` on the host, which a graph capture forbids)."""
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    total = t.size(0)
    if (cu_seqlens is None or cp_group is None or cp_group.size() != 1 or config.apply_rope_fusion
            or config.multi_latent_attention or config.rotary_interleaved or t.dim() != 3):
        if cu_seqlens is not None and getattr(cu_seqlens, POSITIONS_ATTR, None) is not None:
            raise ValueError("shared-prompt packing (model.share_prompt_prefix) needs the engine's packed RoPE: "
                             "unfused RoPE, no context parallelism, no multi-latent attention, no interleaved rotation")
        return _MEGATRON_APPLY(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    rot_dim = freqs.size(-1)
    x = t.unsqueeze(1)  # (total, 1, heads, dim): the bshd layout Megatron rotates
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    cos, sin = _packed_cos_sin(freqs, cu_seqlens, total, x.dtype, mscale)
    if getattr(config, "fused_rope_kernel", False) and rot_dim == t.size(-1):
        from rlhf_mcore.kernels.fused_layer import rope_rotate, rope_supported

        cos2, sin2 = cos.view(total, rot_dim), sin.view(total, rot_dim)
        if rope_supported(t, cos2):
            return rope_rotate(t, cos2, sin2)
    out = x_rot * cos + _rotate_half(x_rot, False) * sin
    if x_pass.size(-1):
        out = torch.cat((out, x_pass), dim=-1)
    return out.squeeze(1)


def install_packed_rope() -> None:
    """Route megatron's self-attention RoPE through :func:`apply_rope_packed` (idempotent). Megatron offers no
    hook for this (its fused THD path needs Transformer Engine), so the name its attention module calls is
    rebound; anything but the packed, unfused, CP=1 case still runs Megatron's own function."""
    global _MEGATRON_APPLY
    import megatron.core.transformer.attention as attention

    if attention.apply_rotary_pos_emb is apply_rope_packed:
        return
    _MEGATRON_APPLY = attention.apply_rotary_pos_emb
    attention.apply_rotary_pos_emb = apply_rope_packed
