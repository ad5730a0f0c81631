"""Attention for the native engine: packed prefill (SDPA on a right-padded batch) and decode over the cache.

Prefill: the new tokens of several prompts arrive packed (N, heads, hd). They are scattered into a
right-padded (P, Lmax) batch and attended with `scaled_dot_product_attention(is_causal=True)`: with right
padding the causal mask alone keeps every real query away from padding, so no explicit mask is needed and
SDPA can use its fused kernels. Only attention sees the padding; all GEMMs run on the packed tokens.

Prefill after a cached prefix (a session's next turn, see engine.py): such a sequence's new tokens continue
positions `offset ...` of its cache slot, which already holds the prefix's keys and values (and, by the time
attention runs, the new tokens' too). The query at position t attends over the slot's keys [0, t]
(`cached_prefix_attention`): on the torch path with SDPA and an explicit causal mask on absolute positions; on
the Triton path every new token is one row of the decode kernel (slot, length t + 1), which reads the cache in
place (no gathered copy of the prefix) at the cost of reading it once per new token: fine for the short
tool/environment messages a turn adds, not a tuned prefill kernel for long suffixes.

Decode: one query per sequence over its cached keys/values; `decode_attention_torch` is the reference (and
the CPU path); the GPU path is `triton_kernels.decode_attention`.
"""

from __future__ import annotations

import inspect
import logging
from typing import Sequence

import torch
import torch.nn.functional as F

from .kv_cache import dequantize_kv

log = logging.getLogger(__name__)
_VARLEN = {"checked": False, "fn": None, "kwargs": {}}


class PackedLayout:
    """Index maps for one prefill's packed new tokens (N,), built once per prefill.

    lengths: new tokens per sequence. offsets (default all 0): tokens each sequence already has in its cache
    slot `slots[p]`; its new tokens sit at positions offset, offset + 1, ... and attend to those cached ones.
    Sequences with offset 0 ("fresh") must come first: they are attended among themselves through a
    right-padded (P, Lmax) batch (or varlen flash attention), the others over their cache slots.
    """

    def __init__(self, lengths: Sequence[int], device, offsets: Sequence[int] | None = None,
                 slots: Sequence[int] | None = None):
        lengths = [int(n) for n in lengths]
        offsets = [0] * len(lengths) if offsets is None else [int(o) for o in offsets]
        num_fresh = sum(o == 0 for o in offsets)
        if len(offsets) != len(lengths) or any(offsets[:num_fresh]) or min(lengths) < 1:
            raise ValueError(f"PackedLayout: lengths {lengths} (each >= 1) and offsets {offsets} (the zeros first) "
                             "must pair up one per sequence.")
        self.num_seqs = len(lengths)
        self.lengths = torch.tensor(lengths, device=device)
        starts = torch.cumsum(self.lengths, 0) - self.lengths  # (P,)
        seq_of_token = torch.repeat_interleave(torch.arange(self.num_seqs, device=device), self.lengths)  # (N,)
        self.pos_in_seq = torch.arange(sum(lengths), device=device) - starts[seq_of_token]  # (N,) among new tokens
        self.positions = self.pos_in_seq + torch.tensor(offsets, device=device)[seq_of_token]  # (N,) absolute
        self.last_token = starts + self.lengths - 1  # (P,) index of each sequence's last token
        # fresh sequences: the first `fresh_tokens` packed tokens
        self.num_fresh, self.fresh_tokens = num_fresh, sum(lengths[:num_fresh])
        self.max_len = max(lengths[:num_fresh], default=0)
        nf = self.fresh_tokens
        self.padded_index = seq_of_token[:nf] * self.max_len + self.pos_in_seq[:nf]  # (Nf,) into P * Lmax
        self.cu_seqlens = torch.cat([starts[:num_fresh], starts[:num_fresh].new_full((1,), nf)]).to(torch.int32)
        # sequences after a cached prefix: the remaining packed tokens
        cached = range(num_fresh, self.num_seqs)
        self.cached_slots = torch.tensor([int(slots[p]) for p in cached] if cached else [], dtype=torch.int64,
                                         device=device)  # (Pc,)
        self.cached_offsets = torch.tensor([offsets[p] for p in cached], dtype=torch.int64, device=device)
        self.cached_max_new = max((lengths[p] for p in cached), default=0)
        self.cached_max_keys = max((offsets[p] + lengths[p] for p in cached), default=0)
        self.cached_padded_index = ((seq_of_token[nf:] - num_fresh) * self.cached_max_new
                                    + self.pos_in_seq[nf:])  # (N - Nf,) into Pc * max_new
        self.cached_token_slots = self.cached_slots[seq_of_token[nf:] - num_fresh]  # (N - Nf,)
        self.cached_token_lens = self.positions[nf:] + 1  # (N - Nf,) keys each new token sees


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
                      sm_scale: float, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                      attention: str = "torch", k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each packed sequence's new tokens. q (N, Hq, hd); k, v (N, Hkv, hd) -> (N, Hq, hd).

    Fresh sequences attend within their new tokens (k, v as computed, also over an FP8 cache); sequences after a
    cached prefix attend over their slot of k_cache / v_cache (S, L, Hkv, hd), which must already hold the new
    tokens' keys and values too (attention: "torch" | "triton", see `cached_prefix_attention`; k_scale, v_scale
    (S, L, Hkv): an FP8 cache's scales)."""
    nf = layout.fresh_tokens
    if layout.num_fresh == layout.num_seqs:
        return _fresh_attention(q, k, v, layout, sm_scale)
    if k_cache is None or v_cache is None:
        raise ValueError("prefill_attention: the layout has sequences after a cached prefix; pass k_cache, v_cache.")
    cached = cached_prefix_attention(q[nf:], k_cache, v_cache, layout, sm_scale, attention, k_scale, v_scale)
    if nf == 0:
        return cached
    return torch.cat([_fresh_attention(q[:nf], k[:nf], v[:nf], layout, sm_scale), cached])


def _fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
                     sm_scale: float) -> torch.Tensor:
    """Causal attention within each fresh packed sequence (the first layout.fresh_tokens tokens).

    On GPU, torch's varlen flash attention runs on the packed tokens directly; otherwise sequences are
    right-padded for SDPA."""
    P, L = layout.num_fresh, layout.max_len
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


def cached_prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: PackedLayout,
                            sm_scale: float, attention: str = "torch", k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the new tokens of sequences after a cached prefix. q (Nc, Hq, hd), packed as in `layout`
    after its fresh tokens; caches (S, L, Hkv, hd) hold every key and value of those sequences (prefix and new).
    Query at absolute position t sees cache positions [0, t]. Returns (Nc, Hq, hd).

    attention "triton": each query is a row of the decode kernel; "torch": SDPA over the gathered slots."""
    if attention == "triton":
        from .triton_kernels import decode_attention, num_splits_for

        splits = num_splits_for(q.shape[0], k_cache.shape[2], layout.cached_max_keys, q.shape[2])
        return decode_attention(q, k_cache, v_cache, layout.cached_token_slots, layout.cached_token_lens, sm_scale,
                                splits, k_scale=k_scale, v_scale=v_scale)
    P, Lq, Lk = layout.cached_slots.shape[0], layout.cached_max_new, layout.cached_max_keys
    Hq, hd = q.shape[1], q.shape[2]
    qp = q.new_zeros(P * Lq, Hq, hd).index_copy_(0, layout.cached_padded_index, q)
    qp = qp.view(P, Lq, Hq, hd).transpose(1, 2)  # (P, Hq, Lq, hd)
    keys = _rows(k_cache, k_scale, (layout.cached_slots, slice(None, Lk)), q.dtype).transpose(1, 2)  # (P, Hkv, Lk, hd)
    values = _rows(v_cache, v_scale, (layout.cached_slots, slice(None, Lk)), q.dtype).transpose(1, 2)
    q_pos = layout.cached_offsets[:, None] + torch.arange(Lq, device=q.device)[None, :]  # (P, Lq)
    # padded query rows still see key 0, so no row is all -inf (their outputs are dropped)
    mask = torch.arange(Lk, device=q.device)[None, None, :] <= q_pos[:, :, None]  # (P, Lq, Lk)
    groups = Hq // keys.shape[1]
    if q.is_cuda and groups > 1:  # GQA support of SDPA's masked kernels varies: expand the kv heads
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask[:, None], scale=sm_scale,
                                         enable_gqa=Hq != keys.shape[1])  # (P, Hq, Lq, hd)
    return out.transpose(1, 2).reshape(P * Lq, Hq, hd).index_select(0, layout.cached_padded_index)


def _rows(cache: torch.Tensor, scale: torch.Tensor | None, index: tuple, dtype: torch.dtype) -> torch.Tensor:
    """cache[index] in `dtype`: an FP8 cache's codes gathered as bytes (any device's indexing) and scaled."""
    if scale is None:
        return cache[index]
    return dequantize_kv(cache.view(torch.uint8)[index].view(cache.dtype), scale[index], dtype)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                           seq_lens: torch.Tensor, sm_scale: float, max_len: int, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference decode attention. q (B, Hq, hd); caches (S, L, Hkv, hd); keys beyond seq_lens[b] ignored.

    Reads cache positions [0, max_len) of each sequence's slot; max_len must be >= max(seq_lens). k_scale, v_scale
    (S, L, Hkv): the caches hold FP8 codes with these scales (dequantized to q's dtype here).
    """
    B, Hq, hd = q.shape
    Hkv = k_cache.shape[2]
    keys = _rows(k_cache, k_scale, (slots, slice(None, max_len)), q.dtype)  # (B, max_len, Hkv, hd)
    values = _rows(v_cache, v_scale, (slots, slice(None, max_len)), q.dtype)
    qg = q.view(B, Hkv, Hq // Hkv, hd)  # (B, Hkv, G, hd)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float() * sm_scale  # (B, Hkv, G, max_len)
    invalid = torch.arange(max_len, device=q.device)[None, :] >= seq_lens[:, None]  # (B, max_len)
    scores = scores.masked_fill(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # (B, Hkv, G, hd)
    return out.reshape(B, Hq, hd)
