"""Rotary position embeddings in the NeoX / Hugging Face "rotate_half" layout, applied from precomputed tables.

The inverse frequencies (with Llama-3 scaling where the config asks for it) are the models' own
(:func:`rlhf_mcore.models.rope.rope_inv_freq`). The cos/sin tables are computed once in fp32 for every position
up to the engine's max length and indexed by position at run time, which keeps prefill and CUDA-graph decode
free of trigonometry.
"""

from __future__ import annotations

import torch


def rope_tables(inv_freq: torch.Tensor, max_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables (max_len, head_dim) in `dtype` from fp32 inverse frequencies (head_dim / 2,): cos repeated over both
    halves, and sin with the first half negated.

    Angles are computed in fp32 and then cast, as transformers does, so that
    x * cos + roll(x, head_dim/2) * sin == x * cos + rotate_half(x) * sin exactly.
    """
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
