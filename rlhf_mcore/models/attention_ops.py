"""Attention math for `SDPACoreAttention`, in plain torch (no Megatron): causal SDPA with Megatron-style
boolean masks, and packed (THD) document-causal attention per document or via flex_attention.

Shapes: dense functions take (B, heads, S, head_dim); packed functions take (T, heads, head_dim) for T packed
tokens with document offsets `cu_seqlens` (int32, [0, ..., T]). Key/value may have fewer heads than the query
(grouped-query attention, handled by `enable_gqa`, without repeating keys in memory).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

_COMPILED_FLEX = None
_VARLEN = None  # (varlen_attn, its keyword parameters) once looked up; False where torch has none


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                    scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention. q (B, np, S, hn), k/v (B, ng, S, hn); mask bool (B|1, 1, S, S), True = masked out, or
    None for plain causal. Returns (B, np, S, hn)."""
    gqa = q.size(1) != k.size(1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_allowed_mask(mask), dropout_p=dropout_p,
                                          scale=scale, enable_gqa=gqa)


def tensor_version(t: torch.Tensor) -> int | None:
    """t's version counter (moves at every in-place write), or None for a tensor made under `torch.inference_mode`,
    which has none: a cache keyed by it then never hits (a log-prob pass a caller runs under inference mode)."""
    return None if t.is_inference() else t._version


_LAST_MASK: tuple = (None, -1, None)  # (Megatron mask, its _version, SDPA mask): every layer gets the same mask


def sdpa_allowed_mask(mask: torch.Tensor) -> torch.Tensor:
    """Megatron's mask (True = masked out) -> SDPA's (True = may attend), with fully masked query rows allowed
    to see themselves so they stay finite. Computed once per forward: cached for the last mask seen."""
    global _LAST_MASK
    version = tensor_version(mask)
    if _LAST_MASK[0] is mask and version is not None and _LAST_MASK[1] == version:
        return _LAST_MASK[2]
    allowed = ~mask
    dead_rows = ~allowed.any(dim=-1, keepdim=True)  # (B, 1, S, 1): queries that may see nothing
    eye = torch.eye(allowed.size(-2), allowed.size(-1), dtype=torch.bool, device=allowed.device)
    allowed = allowed | (dead_rows & eye)  # no host sync: a no-op for rows that see something
    _LAST_MASK = (mask, version, allowed)
    return allowed


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) int: the document index of every packed token (tokens past cu_seqlens[-1] get len(docs))."""
    positions = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)


def packed_attention_per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                  scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Packed (THD) attention as one causal SDPA call per document (tokens past cu_seqlens[-1], if any, form
    one more). q (T, np, hn), k/v (T, ng, hn) -> (T, np, hn).

    The work is sum(len_i^2), not T^2 as with a dense (T, T) document mask: on CPU, with micro-batches of
    dozens of short documents packed together, this is many times faster. Reads the offsets on the host.
    """
    total = q.size(0)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[-1] < total:
        bounds.append(total)
    gqa = q.size(1) != k.size(1)
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # (heads, len, hn)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout_p, is_causal=True, scale=scale,
                                                   enable_gqa=gqa).transpose(0, 1))
    return torch.cat(outs) if outs else q.new_empty(q.shape)


def flex_block_mask(cu_seqlens: torch.Tensor, total: int):
    """flex_attention BlockMask for document-causal attention over `total` packed tokens."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids(cu_seqlens, total)

    def doc_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(doc_causal, B=None, H=None, Q_LEN=total, KV_LEN=total, device=cu_seqlens.device)


def compiled_flex_attention():
    """`flex_attention` compiled once, with dynamic shapes (`dynamic=True`).

    Every micro-batch of an RL step packs a different number of tokens. Compiled with static shapes, each new
    packed length recompiled, and after dynamo's recompile limit (8) the call silently
    fell back to eager flex_attention, which materialises the (T, T) score matrix. With symbolic lengths there
    is one graph per grad mode (log-prob forward, training forward/backward) for every length above one
    128-token block (a first call of at most 128 tokens adds one specialised graph). No padding is needed:
    `create_block_mask` pads its block grid itself and the kernel bounds the last, partial block, so lengths
    that are not multiples of the block size give the same results (tests/test_models.py checks both)."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
    return _COMPILED_FLEX


def packed_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float,
                          compiled: bool) -> torch.Tensor:
    """Packed (THD) attention with flex_attention. q (T, np, hn), k/v (T, ng, hn) -> (T, np, hn).
    `compiled` uses the fused kernel (GPU); eager runs anywhere but has no backward on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = compiled_flex_attention() if compiled else flex_attention
    out = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=block_mask,
             scale=scale, enable_gqa=q.size(1) != k.size(1))  # (1, np, T, hn)
    return out[0].transpose(0, 1)


def varlen_available() -> bool:
    """Whether torch has Flash Attention over cu_seqlens (CUDA only) in a form this module can drive: its aten
    operators, or `torch.nn.attention.varlen.varlen_attn` with a causal mode."""
    return _flash_ops() is not None or _varlen() is not False


def _varlen():
    global _VARLEN
    if _VARLEN is None:
        try:
            import inspect

            from torch.nn.attention.varlen import varlen_attn

            params = set(inspect.signature(varlen_attn).parameters)
            _VARLEN = (varlen_attn, params) if ({"is_causal"} & params or {"window_size"} & params) else False
        except (ImportError, AttributeError, TypeError, ValueError):
            _VARLEN = False
    return _VARLEN


def _flash_ops():
    """torch's Flash Attention operators (aten::_flash_attention_forward/_backward), or None."""
    fwd = getattr(torch.ops.aten, "_flash_attention_forward", None)
    bwd = getattr(torch.ops.aten, "_flash_attention_backward", None)
    return (fwd, bwd) if fwd is not None and bwd is not None else None


class _FlashVarlen(torch.autograd.Function):
    """Causal Flash Attention over cu_seqlens through the aten operators themselves: grouped keys/values go in
    as they are (Flash Attention takes fewer key heads than query heads), the scale is an argument, and no
    Python-level custom-op dispatch runs per call — the wrapper `torch.nn.attention.varlen.varlen_attn`
    costs several times the kernel's own launch on the host, and in some torch versions repeats the key and
    value heads for GQA. Query and key documents may differ (`cu_k`, `max_k`): a key document longer than its
    query document is causal aligned at the bottom right (Flash Attention's rule)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_seqlen, scale, cu_k=None, max_k=None):
        cu_k = cu if cu_k is None else cu_k
        max_k = max_seqlen if max_k is None else max_k
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu_k, max_seqlen, max_k, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, cu_k, rng_state, unused)
        ctx.max_seqlen, ctx.max_k, ctx.scale = max_seqlen, max_k, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu, cu_k, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu, cu_k, ctx.max_seqlen, ctx.max_k, 0.0, True, rng_state,
            unused, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None, None


def packed_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float) -> torch.Tensor:
    """Packed (THD) causal attention with variable-length Flash Attention (no mask at all: each document is
    its own sequence). q (T, np, hn), k/v (T, ng, hn) -> (T, np, hn); CUDA, bf16/fp16.

    Through torch's Flash Attention operators directly (`_FlashVarlen`) where torch has them; else through
    `torch.nn.attention.varlen.varlen_attn`, adapting to its signature: causal via `window_size=(-1, 0)` or
    `is_causal=True`; grouped keys via `enable_gqa` (else repeated); `scale` (else folded into the query)."""
    if q.is_cuda and _flash_ops() is not None:
        return _FlashVarlen.apply(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens.to(torch.int32),
                                  int(max_seqlen), float(scale))
    return _packed_attention_varlen_wrapper(q, k, v, cu_seqlens, max_seqlen, scale)


def _packed_attention_varlen_wrapper(q, k, v, cu_seqlens, max_seqlen, scale):
    """`packed_attention_varlen` through `torch.nn.attention.varlen.varlen_attn`."""
    found = _varlen()
    if found is False:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn is not available in this torch")
    fn, params = found
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if q.size(1) != k.size(1):
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "scale" in params:
        kwargs["scale"] = scale
    else:
        q = q * (scale * q.size(-1) ** 0.5)
    cu = cu_seqlens.to(torch.int32)
    return fn(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Shared-prompt packing (rlhf_mcore.engine.shared_prefix): query documents and key/value documents differ


SHARED_PREFIX_ATTR = "rlhf_shared_prefix"  # the PackedSeqParams attribute that carries a SharedPrefixLayout


@dataclass
class SharedPrefixLayout:
    """How packed queries attend when a prompt is packed once for all its responses: query document d is the
    packed tokens `cu_q[d]:cu_q[d+1]`; it attends to the packed tokens `kv_index[cu_kv[d]:cu_kv[d+1]]`, causal
    aligned at the bottom right (query i of a document of nq sees its keys 0 .. i + nk - nq)."""

    cu_q: torch.Tensor  # (D + 1,) int32
    cu_kv: torch.Tensor  # (D + 1,) int32, offsets into the gathered keys
    kv_index: torch.Tensor  # (Tkv,) int64: the packed token behind each gathered key/value
    max_q: int
    max_kv: int
    positions: torch.Tensor  # (T,) int64: each packed token's RoPE position


def shared_prefix_layout(packed_seq_params) -> Optional[SharedPrefixLayout]:
    """The shared-prompt layout a PackedSeqParams carries, or None."""
    return getattr(packed_seq_params, SHARED_PREFIX_ATTR, None) if packed_seq_params is not None else None


def shared_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SharedPrefixLayout,
                            scale: float) -> torch.Tensor:
    """q (T, np, hn), k/v (T, ng, hn) in packed order -> (T, np, hn). The keys and values are gathered per
    document (a prompt's once per response: key heads are few, the copy is small), then Flash Attention over
    (cu_q, cu_kv) on CUDA in bf16/fp16, or one SDPA call per document with its bottom-right causal mask."""
    kg, vg = k.index_select(0, layout.kv_index), v.index_select(0, layout.kv_index)
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _flash_ops() is not None:
        return _FlashVarlen.apply(q.contiguous(), kg.contiguous(), vg.contiguous(), layout.cu_q, int(layout.max_q),
                                  float(scale), layout.cu_kv, int(layout.max_kv))
    bq = [int(x) for x in layout.cu_q.tolist()]
    bk = [int(x) for x in layout.cu_kv.tolist()]
    gqa = q.size(1) != k.size(1)
    outs = []
    for d in range(len(bq) - 1):
        nq, nk = bq[d + 1] - bq[d], bk[d + 1] - bk[d]
        if nq == 0:
            continue
        qs = q[bq[d]:bq[d + 1]].transpose(0, 1)  # (heads, nq, hn)
        ks, vs = (x[bk[d]:bk[d + 1]].transpose(0, 1) for x in (kg, vg))  # (groups, nk, hn)
        if nq == nk:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            allowed = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(diagonal=nk - nq)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(0, 1))
    out = torch.cat(outs) if outs else q.new_empty(q.shape)
    if out.size(0) < q.size(0):  # tokens past the last document (none are built): zeros, never read
        out = torch.cat([out, out.new_zeros(q.size(0) - out.size(0), *out.shape[1:])])
    return out
