"""RoPE inverse frequencies equal to Hugging Face's, installed into Megatron's rotary module.

Megatron-Core's `RotaryEmbedding` computes `1 / theta^(2i/d)` like HF, but its Llama-3 scaling hard-codes
low_freq_factor=1, high_freq_factor=4 and original_max_position_embeddings=8192; checkpoints (and our tiny
test models) use other values. So the frequencies are computed here from the config, with the same float32
operations in the same order as transformers (so they agree bit for bit: see tests/test_models.py), and
written over the module's `inv_freq`.
"""
from __future__ import annotations

import math

import torch

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
