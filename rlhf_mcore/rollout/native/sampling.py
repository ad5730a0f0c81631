"""Token sampling with per-sequence, batch-independent randomness.

Each sequence carries a 32-bit key derived from (seed, request id, sample index). The uniform draw of generation
step `t` is a pure function of (key, t) -- a counter-based hash (`uniform_draw`: 53 bits, one double per row) -- so a
seeded sample is the same whatever slot, batch or step of the engine it runs in. Sampling is by the inverse
distribution function: the token is the first vocabulary id whose cumulative probability under `softmax(logits / T)`
exceeds the draw, which draws from that distribution exactly and needs one exp per logit and one number per row (the
Gumbel-max sampler before it, argmax(logits / T + g), needed a hash and two logs per logit besides: BENCHMARKS.md
session 51). The fused kernel (`triton_kernels.sample_fused`) takes the cumulative sums in two levels, vocabulary
chunks then the chosen chunk's tokens.

Top-k / top-p mask the scaled logits to -inf outside the kept set before the same draw, so the sample comes from the
renormalised distribution, and the reported log-prob is taken under it.

`sample_torch` is the reference implementation (CPU, and GPU when top-k/top-p are on): fp64 cumulative sums. The
Triton kernel's are fp32, so a draw within ~1e-6 of a boundary between two tokens' intervals may pick the neighbour;
otherwise the tokens are the same, and the log-probs agree within fp32 rounding.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
HASH_M1, HASH_M2 = 0x7FEB352D, 0x846CA68B  # "lowbias32" multipliers (C. Wellons' integer hash prospector)
STEP_MUL = 0x9E3779B9  # golden-ratio increment, decorrelates consecutive steps
DRAW_SALT_HI, DRAW_SALT_LO = 0x5851F42D, 0x14057B7E  # two independent 32-bit words of a row's step from its hash


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


def uniform_draw(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row (B,) fp64 from sequence keys (B,) and step indices (B,) (int64): 53 bits,
    from two hashes of the row's step hash, exact in fp64."""
    row = _mix32(keys ^ ((steps * STEP_MUL) & MASK32))  # (B,)
    hi, lo = _mix32(row ^ DRAW_SALT_HI), _mix32(row ^ DRAW_SALT_LO)
    return (((hi << 21) | (lo >> 11)).to(torch.float64) + 0.5) * (1.0 / (1 << 53))


def inverse_cdf(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index of each row of x (B, V) fp32 scaled logits (-inf: excluded) whose cumulative probability
    exceeds u (B,) in (0, 1); fp64 sums. A draw past the last sum by rounding takes the last token of positive
    probability."""
    cdf = x.double().sub_(x.max(-1, keepdim=True).values.double()).exp_().cumsum_(-1)  # (B, V), one fp64 copy
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous()).squeeze(-1)  # where the sum is reached: mass > 0
    return torch.minimum(tok, last)


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
    greedy (B,) bool: argmax, no draw, no top-k/top-p, log-prob under softmax(logits).
    """
    x = logits.float() * inv_temp[:, None]  # (B, V)
    if top_k > 0 or top_p < 1.0:
        x = torch.where(greedy[:, None], x, filter_top_k_top_p(x, top_k, top_p))
    tokens = torch.where(greedy, torch.argmax(x, dim=-1), inverse_cdf(x, uniform_draw(keys, steps)))  # (B,)
    lse = torch.logsumexp(x, dim=-1)
    logprobs = x.gather(-1, tokens[:, None]).squeeze(-1) - lse
    return tokens, logprobs
