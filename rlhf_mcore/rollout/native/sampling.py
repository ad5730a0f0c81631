"""Token sampling with per-sequence, batch-independent randomness.

Each sequence carries a 32-bit key derived from (seed, request id, sample index). The Gumbel noise for
vocabulary entry `v` at generation step `t` is a pure function of (key, t, v) — a counter-based hash — so a
seeded sample is the same whatever slot, batch or step of the engine it runs in. Sampling is Gumbel-max:
`argmax(logits / T + g)` draws from `softmax(logits / T)` exactly, needs no sort and no normalised
probabilities, and fuses into one pass over the logits (see `triton_kernels.sample_fused`).

Top-k / top-p mask the scaled logits to -inf outside the kept set before the same Gumbel-max, so the sample
comes from the renormalised distribution, and the reported log-prob is taken under it.

`sample_torch` is the reference implementation (CPU, and GPU when top-k/top-p are on); the Triton kernel must
produce identical tokens and log-probs.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
HASH_M1, HASH_M2 = 0x7FEB352D, 0x846CA68B  # "lowbias32" multipliers (C. Wellons' integer hash prospector)
STEP_MUL = 0x9E3779B9  # golden-ratio increment, decorrelates consecutive steps


def mix32_int(x: int) -> int:
    """The 32-bit integer hash on Python ints (host side)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * HASH_M1) & MASK32
    x ^= x >> 15
    x = (x * HASH_M2) & MASK32
    x ^= x >> 16
    return x


def sequence_key(seed: int, request_id: int, sample_index: int) -> int:
    """32-bit key of one sequence's random stream."""
    h = mix32_int(seed & MASK32)
    h = mix32_int(h ^ ((seed >> 32) & MASK32))
    h = mix32_int(h ^ (request_id & MASK32))
    h = mix32_int(h ^ ((request_id >> 32) & MASK32))
    return mix32_int(h ^ (sample_index & MASK32))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The hash on int64 tensors holding values in [0, 2^32) (products wrap mod 2^64; the low 32 bits are exact)."""
    x = x ^ (x >> 16)
    x = (x * HASH_M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * HASH_M2) & MASK32
    return x ^ (x >> 16)


def gumbel_noise(keys: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise (B, vocab) fp32 from sequence keys (B,) and step indices (B,) (int64)."""
    row = _mix32(keys ^ ((steps * STEP_MUL) & MASK32))  # (B,)
    cols = _mix32(torch.arange(vocab, device=keys.device, dtype=torch.int64))  # (V,)
    h = _mix32(row[:, None] ^ cols[None, :])  # (B, V)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1), exact in fp32
    return -torch.log(-torch.log(u))


def filter_top_k_top_p(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask scaled logits x (B, V) fp32 to -inf outside the top-k, then outside the smallest set whose
    probability reaches top_p (the most likely token is always kept)."""
    if top_k > 0 and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]  # (B, 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly better tokens
        remove_sorted = mass_before >= top_p
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        x = x.masked_fill(remove, float("-inf"))
    return x


def sample_torch(logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, inv_temp: torch.Tensor,
                 greedy: torch.Tensor, top_k: int = -1, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (tokens (B,) int64, log-probs (B,) fp32).

    logits (B, V) any float dtype; keys, steps (B,) int64; inv_temp (B,) fp32 (1 for greedy rows);
    greedy (B,) bool: argmax, no noise, no top-k/top-p, log-prob under softmax(logits).
    """
    x = logits.float() * inv_temp[:, None]  # (B, V)
    if top_k > 0 or top_p < 1.0:
        x = torch.where(greedy[:, None], x, filter_top_k_top_p(x, top_k, top_p))
    noise = gumbel_noise(keys, steps, x.shape[-1])
    y = torch.where(greedy[:, None], x, x + noise)
    tokens = torch.argmax(y, dim=-1)  # (B,)
    lse = torch.logsumexp(x, dim=-1)
    logprobs = x.gather(-1, tokens[:, None]).squeeze(-1) - lse
    return tokens, logprobs
