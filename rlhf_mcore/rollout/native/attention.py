"""Attention for the native engine: packed prefill (SDPA on a right-padded batch) and decode over the cache.

Prefill: the new tokens of several prompts arrive packed (N, heads, hd). They are scattered into a
right-padded (P, Lmax) batch and attended with `scaled_dot_product_attention(is_causal=True)`: with right
padding the causal mask alone keeps every real query away from padding, so no explicit mask is needed and
SDPA can use its fused kernels. Only attention sees the padding; all GEMMs run on the packed tokens.

Decode: one query per sequence over its cached keys/values; `decode_attention_torch` is the reference (and
the CPU path); the GPU path is `triton_kernels.decode_attention`.
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
_VARLEN = {"checked": False, "fn": None, "kwargs": {}}


class PackedLayout:
    """Index maps between packed tokens (N,) and a right-padded (P, Lmax) batch, built once per prefill."""

    def __init__(self, lengths: list[int], device):
        self.num_seqs = len(lengths)
        self.max_len = max(lengths)
        self.lengths = torch.tensor(lengths, device=device)
        starts = torch.cumsum(self.lengths, 0) - self.lengths  # (P,)
        seq_of_token = torch.repeat_interleave(torch.arange(self.num_seqs, device=device), self.lengths)  # (N,)
        self.pos_in_seq = torch.arange(int(sum(lengths)), device=device) - starts[seq_of_token]  # (N,)
        self.padded_index = seq_of_token * self.max_len + self.pos_in_seq  # (N,) into P * Lmax
        self.last_token = starts + self.lengths - 1  # (P,) index of each sequence's last token
        self.cu_seqlens = torch.cat([starts, starts[-1:] + self.lengths[-1:]]).to(torch.int32)  # (P + 1,)


def _varlen_attention():
    """torch's flash-attention varlen entry point if this torch has one, with its causal-mask keyword."""
    if not _VARLEN["checked"]:
        _VARLEN["checked"] = True
        try:
            from torch.nn.attention.varlen import varlen_attn

            params = inspect.signature(varlen_attn).parameters
            if "window_size" in params:
                _VARLEN["kwargs"] = {"window_size": (-1, 0)}
            elif "is_causal" in params:
                _VARLEN["kwargs"] = {"is_causal": True}
            else:
                raise TypeError("varlen_attn has no causal option")
            _VARLEN["gqa"] = "enable_gqa" in params
            _VARLEN["fn"] = varlen_attn
        except (ImportError, TypeError) as e:
            log.info("varlen flash attention unavailable (%s); prefill pads sequences for SDPA", e)
    return _VARLEN["fn"]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
                      sm_scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence. q (N, Hq, hd); k, v (N, Hkv, hd) -> (N, Hq, hd).

    On GPU, torch's varlen flash attention runs on the packed tokens directly; otherwise sequences are
    right-padded for SDPA."""
    P, L = layout.num_seqs, layout.max_len
    groups = q.shape[1] // k.shape[1]
    varlen = _varlen_attention() if q.is_cuda and q.dtype != torch.float32 else None
    if varlen is not None:
        kwargs = dict(_VARLEN["kwargs"])
        if groups > 1 and _VARLEN.get("gqa"):
            kwargs["enable_gqa"] = True
        elif groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        try:
            return varlen(q.contiguous(), k.contiguous(), v.contiguous(), layout.cu_seqlens, layout.cu_seqlens, L, L,
                          **kwargs)
        except Exception as e:  # e.g. an older signature: fall back to padding for the rest of the run
            log.warning("varlen flash attention failed (%s: %s); using padded SDPA", type(e).__name__, e)
            _VARLEN["fn"] = None
        if not kwargs.get("enable_gqa"):
            groups = 1  # k, v are already expanded

    def pad(x):  # (N, H, hd) -> (P, H, L, hd)
        buf = x.new_zeros(P * L, x.shape[1], x.shape[2])
        buf.index_copy_(0, layout.padded_index, x)
        return buf.view(P, L, x.shape[1], x.shape[2]).transpose(1, 2)

    if q.is_cuda and groups > 1:  # expand kv heads so SDPA can pick its flash kernel (GQA support varies)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, scale=sm_scale,
                                         enable_gqa=q.shape[1] != k.shape[1])  # (P, Hq, L, hd)
    out = out.transpose(1, 2).reshape(P * L, q.shape[1], q.shape[2])
    return out.index_select(0, layout.padded_index)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                           seq_lens: torch.Tensor, sm_scale: float, max_len: int) -> torch.Tensor:
    """Reference decode attention. q (B, Hq, hd); caches (S, L, Hkv, hd); keys beyond seq_lens[b] ignored.

    Reads cache positions [0, max_len) of each sequence's slot; max_len must be >= max(seq_lens).
    """
    B, Hq, hd = q.shape
    Hkv = k_cache.shape[2]
    keys = k_cache[:, :max_len][slots]  # (B, max_len, Hkv, hd)
    values = v_cache[:, :max_len][slots]
    qg = q.view(B, Hkv, Hq // Hkv, hd)  # (B, Hkv, G, hd)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float() * sm_scale  # (B, Hkv, G, max_len)
    invalid = torch.arange(max_len, device=q.device)[None, :] >= seq_lens[:, None]  # (B, max_len)
    scores = scores.masked_fill(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # (B, Hkv, G, hd)
    return out.reshape(B, Hq, hd)
