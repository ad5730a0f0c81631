"""Rotary position embeddings (NeoX / Hugging Face "rotate_half" layout), with Llama-3 frequency scaling.

The cos/sin tables are computed once in fp32 for every position up to the engine's max length and indexed
by position at run time, which keeps prefill and CUDA-graph decode free of trigonometry.
"""

from __future__ import annotations

import math

import torch

from .config import RopeSpec


def inv_frequencies(head_dim: int, rope: RopeSpec) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) in fp32, computed as transformers does (so fp32 runs match it)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)  # (head_dim/2,)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Llama-3 scaling: long wavelengths are divided by `factor`, short ones kept, the band between blended."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def rope_tables(head_dim: int, rope: RopeSpec, max_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables (max_len, head_dim) in `dtype`: cos repeated over both halves, and sin with the first half negated.

    Angles are computed in fp32 and then cast, as transformers does, so that
    x * cos + roll(x, head_dim/2) * sin == x * cos + rotate_half(x) * sin exactly.
    """
    inv_freq = inv_frequencies(head_dim, rope)
    pos = torch.arange(max_len, dtype=torch.int64).to(torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # (max_len, head_dim/2)
    cos, sin = freqs.cos(), freqs.sin()
    cos_full = torch.cat((cos, cos), dim=-1).to(dtype)
    sin_signed = torch.cat((-sin, sin), dim=-1).to(dtype)
    return cos_full.to(device), sin_signed.to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (N, heads, head_dim) by per-token angles; cos, sin (N, head_dim) rows of `rope_tables`.

    roll by head_dim/2 swaps the halves: [x2, x1]; with the signed sin table this is HF's rotate_half."""
    rolled = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)
    return x * cos[:, None, :] + rolled * sin[:, None, :]
