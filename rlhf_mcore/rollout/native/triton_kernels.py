"""Triton kernels for the native engine's decode step (GPU; testable on CPU with TRITON_INTERPRET=1).

- `decode_attention`: flash-decoding over a slot-indexed KV cache. Each (sequence, kv head, split) program
  reads only the filled part of its sequence's cache row (its own length, not the batch maximum), attends
  with all query heads of its GQA group at once (one `tl.dot` per block), and a second small kernel merges
  the splits with their log-sum-exp weights. Reading the cache once is the memory floor of decoding.
- `sample_fused`: one pass over a row of logits (in the model's dtype) that scales by 1/T and keeps an online
  log-sum-exp per vocabulary chunk (a greedy row its arg-max), then one program per row that draws the row's
  uniform (the same hash as `sampling.uniform_draw`) and finds its token by the cumulative sums, chunks then the
  chosen chunk's tokens — no fp32 (B, V) tensor, no sort, one exp per logit. It matches `sampling.sample_torch` up
  to the last bits of the sums (a draw within ~1e-6 of a boundary may take the neighbouring token).
- `qkv_rope_cache`, `linear`: the decode step's layer GEMMs (small M), with what follows the QKV projection
  (RoPE, the cache write) and gate_up (silu*mul) in their epilogues; o_proj / down_proj split K and leave fp32
  partials for `add_rms_norm` to sum.

Programmatic dependent launch (Hopper and later, `pdl_enabled`): every kernel here waits for its predecessor with
`griddepcontrol.wait` before it reads an activation or writes anything, then lets its successor launch, so the next
kernel's programs are scheduled while this one runs instead of after it ends (the CUDA graph's ~0.8 us between
dependent kernels, BENCHMARKS.md round 5). Every program waits unconditionally: a kernel completes only after its
predecessor did, so whatever ran earlier is complete too. The engine's decode steps use it except at the batch sizes
of `PDL_OFF_ROWS` (`pdl_for_batch`); `RLHF_MCORE_DECODE_PDL=0` turns it off everywhere, `=1` on at every batch.
(Prefetching the GEMMs' weights into L2 before the wait was measured slower, 1.742 against 1.690 ms a step: not
kept.)

Reference implementations: `attention.decode_attention_torch`, `sampling.sample_torch`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import triton
import triton.language as tl

from rlhf_mcore.kernels.fp8 import FP8_MAX, Fp8Rows

from .sampling import DRAW_SALT_HI, DRAW_SALT_LO, HASH_M1, HASH_M2, STEP_MUL

# The kernels spell these constants as literals (Triton jit code cannot read module globals); keep in sync.
assert (HASH_M1, HASH_M2, STEP_MUL) == (0x7FEB352D, 0x846CA68B, 0x9E3779B9)
assert (DRAW_SALT_HI, DRAW_SALT_LO) == (0x5851F42D, 0x14057B7E)


# The decode batches (padded rows, first and last included) that launch without PDL. One H100, one process, PDL on
# and off alternating (BENCHMARKS.md session 48): on was 4.8 / 3.6 / 0.7 / 1.7 / 0.6% faster a step at 64 / 96 / 128 /
# 160 / 192 rows and 3.5% slower at 256 (2.01 against 1.95 ms); session 19's H200 measured 256 rows the same either
# way. Above 256 rows o_proj and down_proj run on cuBLAS and the decode (TRL's GRPO at 512) was measured with PDL on
# only: it stays on there.
PDL_OFF_ROWS = (225, 256)
_PDL_IN_SCOPE: ContextVar[bool] = ContextVar("pdl_in_scope", default=True)


def pdl_enabled() -> bool:
    """Whether the kernels launch with programmatic dependent launch (module docstring): a CUDA GPU of compute
    capability >= 9, not Triton's interpreter, and then `RLHF_MCORE_DECODE_PDL` (read at each call): "0" off, "1" on,
    unset as `pdl_for_batch` says (on outside one)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or not _sm90():
        return False
    forced = os.environ.get("RLHF_MCORE_DECODE_PDL")
    if forced is not None:
        return forced != "0"
    return _PDL_IN_SCOPE.get()


@contextmanager
def pdl_for_batch(rows: int):
    """The kernels launched (or captured into a CUDA graph) inside use PDL unless `rows` is within PDL_OFF_ROWS."""
    low, high = PDL_OFF_ROWS
    token = _PDL_IN_SCOPE.set(not low <= rows <= high)
    try:
        yield
    finally:
        _PDL_IN_SCOPE.reset(token)


_SM90: list[bool] = []


def _sm90() -> bool:
    if not _SM90:
        _SM90.append(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9)
    return _SM90[0]


def _launch(pdl: bool) -> dict:
    """Launch options: `launch_pdl` only where it is on (the interpreter takes no such option)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel (its writes visible), then let the next one launch (module docstring)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (wrapping multiplies, logical shifts)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _sample_chunk_kernel(logits_ptr, stride_row, V, CHUNK, inv_temp_ptr, greedy_ptr, part_ptr,
                         NCHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Stage 1, one program per (row, vocabulary chunk): the online max m and sum-exp s of x = logits / T over the
    chunk, and in a greedy row its arg-max (the lowest id among ties) and x there. Writes (m, s, best x, best index)
    to part[row, chunk]. One exp per logit: no per-logit random number (`sampling.inverse_cdf`)."""
    _pdl_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_t = tl.load(inv_temp_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    offs = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    best_x = m
    best_idx = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    lo = chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for v0 in range(lo, hi, BLOCK):
        cols = v0 + offs
        cmask = cols < hi
        x = tl.load(logits_ptr + row * stride_row + cols, mask=cmask, other=float("-inf")).to(tl.float32) * inv_t
        bm = tl.max(x, 0)
        m_new = tl.maximum(m, bm)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # excluded (-inf) logits so far: no nan from -inf - -inf
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), 0)
        m = m_new
        if greedy:  # the first block at the chunk's maximum, its lowest id there (tl.argmax: the first index)
            take = bm > best_x
            best_idx = tl.where(take, v0 + tl.argmax(x, 0), best_idx)
            best_x = tl.where(take, bm, best_x)
    out = part_ptr + (row * NCHUNK + chunk) * 4
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, best_x)
    tl.store(out + 3, best_idx.to(tl.float32))  # exact: vocabulary ids < 2^24


@triton.jit
def _sample_pick_kernel(logits_ptr, stride_row, V, CHUNK, nchunk, part_ptr, keys_ptr, steps_ptr, inv_temp_ptr,
                        greedy_ptr, tok_ptr, lp_ptr, NCHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Stage 2, one program per row: the log-sum-exp from the chunks' (m, s); a greedy row takes the chunks' arg-max
    (the first chunk among ties); a sampled row draws u (`sampling.uniform_draw`: the same hash) and finds the token
    whose cumulative probability first exceeds u -- the chunk from the chunks' sums, then the token from the chunk's
    own exps (re-read: one chunk of the row). A draw past a sum by rounding takes the last token of positive
    probability there."""
    _pdl_wait(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, NCHUNK)
    live = c < nchunk
    base = part_ptr + (row * NCHUNK + c) * 4
    m = tl.load(base, mask=live, other=float("-inf"))
    s = tl.load(base + 1, mask=live, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_all))  # each chunk's sum-exp against the row's max
    total = tl.sum(w, 0)
    lse = m_all + tl.log(total)
    inv_t = tl.load(inv_temp_ptr + row)
    if tl.load(greedy_ptr + row) != 0:
        bx = tl.load(base + 2, mask=live, other=float("-inf"))
        idx = tl.load(base + 3, mask=live, other=0.0)
        win = tl.argmax(bx, 0)
        tok = tl.sum(tl.where(c == win, idx, 0.0), 0).to(tl.int32)
    else:
        key = tl.load(keys_ptr + row)  # int64 in [0, 2^32)
        step = tl.load(steps_ptr + row)  # int64
        row_key = _mix32((key ^ ((step * 0x9E3779B9) & 0xFFFFFFFF)).to(tl.uint32))
        hi_bits = _mix32(row_key ^ 0x5851F42D).to(tl.uint64)
        lo_bits = _mix32(row_key ^ 0x14057B7E).to(tl.uint64)
        u = (((hi_bits << 21) | (lo_bits >> 11)).to(tl.float64) + 0.5) * (1.0 / 9007199254740992.0)
        target = (u * total.to(tl.float64)).to(tl.float32)
        cum = tl.cumsum(w, 0)
        last_chunk = tl.max(tl.where(w > 0, c, 0), 0)
        pick = tl.minimum(tl.min(tl.where((cum > target) & (w > 0), c, NCHUNK), 0), last_chunk)
        r = target - tl.sum(tl.where(c < pick, w, 0.0), 0)  # the draw's remainder inside the chosen chunk
        lo = pick * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        offs = tl.arange(0, BLOCK)
        carry = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        found = tl.sum(tl.zeros([BLOCK], tl.int32), 0) + V  # V: not found yet
        last = tl.sum(tl.zeros([BLOCK], tl.int32), 0) + lo
        for v0 in range(lo, hi, BLOCK):
            cols = v0 + offs
            cmask = cols < hi
            x = tl.load(logits_ptr + row * stride_row + cols, mask=cmask, other=float("-inf")).to(tl.float32)
            e = tl.where(cmask, tl.exp(x * inv_t - m_all), 0.0)
            cs = tl.cumsum(e, 0) + carry
            found = tl.minimum(found, tl.min(tl.where((cs > r) & (e > 0), cols, V), 0))
            last = tl.maximum(last, tl.max(tl.where(e > 0, cols, 0), 0))
            carry = carry + tl.sum(e, 0)
        tok = tl.where(found < V, found, last)
    x_tok = tl.load(logits_ptr + row * stride_row + tok).to(tl.float32) * inv_t
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lp_ptr + row, x_tok - lse)


def sample_fused(logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, inv_temp: torch.Tensor,
                 greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `sampling.sample_torch` without top-k/top-p. logits (B, V), row stride arbitrary.

    The vocabulary is split into chunks processed in parallel (a 152k vocabulary is ~75 serial blocks of 2048
    for one program), then merged per row, where a sampled row re-reads its chosen chunk. Blocks of 2048 for large
    vocabularies (1024 below 64k) measured ~9% faster at 152k on an H200 with the Gumbel-max sampler before this one
    (fewer loop iterations and cross-lane reductions)."""
    B, V = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    block = 2048 if V >= 65536 else 1024 if V >= 1024 else triton.next_power_of_2(V)
    # chunks of 2 blocks (up to 64) for large vocabularies: 49.9 against 52.6 us at 152k x 256 rows, 21.9 against 24.4
    # at 64 on an H100 (session 52's sweep of blocks, chunks and warps); 4 blocks a chunk below
    per_chunk, most = (2, 64) if V >= 65536 else (4, 32)
    slots = max(1, min(most, triton.next_power_of_2(triton.cdiv(V, per_chunk * block))))
    chunk = triton.cdiv(triton.cdiv(V, slots), block) * block
    nchunk = triton.cdiv(V, chunk)  # launched: no empty chunk (slots is the power of 2 the merge reads)
    part = torch.empty(B, slots, 4, dtype=torch.float32, device=logits.device)
    inv_t, is_greedy = inv_temp.to(torch.float32), greedy.to(torch.int8)
    pdl = pdl_enabled()
    _sample_chunk_kernel[(B, nchunk)](logits, logits.stride(0), V, chunk, inv_t, is_greedy, part, NCHUNK=slots,
                                      BLOCK=block, PDL=pdl, **_launch(pdl))
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    _sample_pick_kernel[(B,)](logits, logits.stride(0), V, chunk, nchunk, part, keys, steps, inv_t, is_greedy,
                              tokens, logprobs, NCHUNK=slots, BLOCK=block, PDL=pdl, num_warps=8, **_launch(pdl))
    return tokens, logprobs


@triton.jit
def _advance_rows_kernel(tok_ptr, lp_ptr, slot_ptr, pos_ptr, step_ptr, limit_ptr, in_tok_ptr, done_ptr, stop_ptr,
                         resp_tok_ptr, resp_lp_ptr, resp_stride, cap, NSTOP: tl.constexpr, PDL: tl.constexpr):
    """Per row after sampling: record the token and log-prob in the slot's response, feed the token back as
    the next input, advance position and step (clamped to `cap`), flag stop-token / length finishes. A row already
    flagged is left as it is (several steps run in one launch: engine.DECODE_STEPS_PER_LAUNCH)."""
    _pdl_wait(PDL)
    row = tl.program_id(0)
    live = tl.load(done_ptr + row).to(tl.int32) == 0
    tok = tl.load(tok_ptr + row)
    slot = tl.load(slot_ptr + row)
    step = tl.load(step_ptr + row)
    tl.store(resp_tok_ptr + slot * resp_stride + step, tok, mask=live)
    tl.store(resp_lp_ptr + slot * resp_stride + step, tl.load(lp_ptr + row), mask=live)
    tl.store(in_tok_ptr + row, tok, mask=live)
    tl.store(pos_ptr + row, tl.minimum(tl.load(pos_ptr + row) + 1, cap), mask=live)
    step = tl.minimum(step + 1, cap)
    tl.store(step_ptr + row, step, mask=live)
    stops = tl.load(stop_ptr + tl.arange(0, NSTOP))
    hit = tl.sum((stops == tok).to(tl.int32), 0) > 0
    tl.store(done_ptr + row, (hit | (step >= tl.load(limit_ptr + row))).to(tl.int1), mask=live)


def advance_rows(tok, lp, slots, pos, steps, limit, in_tokens, done, stop_ids, resp_tokens, resp_logprobs,
                 cap: int) -> None:
    """One kernel for the decode step's bookkeeping (see `_advance_rows_kernel`); all row tensors (B,)."""
    assert resp_tokens.stride(0) == resp_logprobs.stride(0) and stop_ids.numel() == triton.next_power_of_2(
        stop_ids.numel())
    _advance_rows_kernel[(tok.shape[0],)](tok, lp, slots, pos, steps, limit, in_tokens, done, stop_ids, resp_tokens,
                                          resp_logprobs, resp_tokens.stride(0), cap, NSTOP=stop_ids.numel(),
                                          PDL=pdl_enabled(), **_launch(pdl_enabled()))


# --------------------------------------------------------------------------------------------------------
@triton.jit
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, src_ptr, shared_ptr, po_ptr, pm_ptr, pl_ptr, out_ptr,
                       sm_scale, stride_qb, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
                       stride_ob, stride_oh, ks_ptr, vs_ptr, stride_ss, stride_sl, G: tl.constexpr,
                       NSPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                       IEEE: tl.constexpr, HAS_SRC: tl.constexpr, PDL: tl.constexpr, KV_FP8: tl.constexpr = False,
                       HEADS_FASTEST: tl.constexpr = False):
    """HEADS_FASTEST: the grid is (kv heads, rows, splits), so a row's kv heads, whose keys and values interleave in
    the cache (S, L, Hkv, D), are read by programs launched together; else (rows, kv heads, splits).
    HAS_SRC: row b reads its first shared[b] keys/values from slot src[b] (which holds the same ones: a prompt
    prefilled once for several rows), the rest from its own slot. KV_FP8: the caches hold e4m3 codes with one fp32
    scale per (slot, position, head) in ks / vs (strides stride_ss, stride_sl, 1): the codes are widened for the
    products (to fp16, q too, unless fp32), the key scales multiply the scores' columns and the value scales the
    probabilities'."""
    _pdl_wait(PDL)
    first, second = tl.program_id(0), tl.program_id(1)  # (rows, kv heads); HEADS_FASTEST: (kv heads, rows)
    b = second if HEADS_FASTEST else first
    kvh = first if HEADS_FASTEST else second
    n_kvh = tl.num_programs(0) if HEADS_FASTEST else tl.num_programs(1)
    sp = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    seqlen = tl.load(lens_ptr + b).to(tl.int32)
    if HAS_SRC:
        src = tl.load(src_ptr + b).to(tl.int64)
        shared = tl.load(shared_ptr + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(seqlen, NSPLIT), BLOCK_N) * BLOCK_N
    start = sp * chunk
    end = tl.minimum(start + chunk, seqlen)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gmask = g < G
    q = tl.load(q_ptr + b * stride_qb + (kvh * G + g)[:, None] * stride_qh + d[None, :], mask=gmask[:, None],
                other=0.0)  # (BLOCK_G, D)
    if KV_FP8 and not IEEE:  # e4m3 codes widen to fp16 in one instruction (to bf16 in several): fp16 products
        q = q.to(tl.float16)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    k_base = k_ptr + slot * stride_ks + kvh * stride_kh
    v_base = v_ptr + slot * stride_vs + kvh * stride_vh
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        if HAS_SRC:  # each key's slot: the shared one below `shared`, the row's own above
            s_n = tl.where(n < shared, src, slot)
            k_rows = k_ptr + s_n[:, None] * stride_ks + kvh * stride_kh + n[:, None] * stride_kl
            v_rows = v_ptr + s_n[:, None] * stride_vs + kvh * stride_vh + n[:, None] * stride_vl
        else:
            s_n = slot
            k_rows = k_base + n[:, None] * stride_kl
            v_rows = v_base + n[:, None] * stride_vl
        k = tl.load(k_rows + d[None, :], mask=nmask[:, None], other=0.0)  # (BLOCK_N, D)
        if KV_FP8:
            k = k.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if KV_FP8:
            scale_off = s_n * stride_ss + n * stride_sl + kvh  # (BLOCK_N,)
            s = s * tl.load(ks_ptr + scale_off, mask=nmask, other=0.0)[None, :]
        s = tl.where(nmask[None, :], s * sm_scale, float("-inf"))  # (BLOCK_G, BLOCK_N)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_rows + d[None, :], mask=nmask[:, None], other=0.0)
        pw = p  # the probabilities the values are weighted by (times the value scales in FP8)
        if KV_FP8:
            v = v.to(q.dtype)
            pw = p * tl.load(vs_ptr + scale_off, mask=nmask, other=0.0)[None, :]
        if IEEE:
            pv = tl.dot(pw.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(pw.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    if NSPLIT == 1:  # the whole sequence in one program: write the result, no merge pass
        tl.store(out_ptr + b * stride_ob + (kvh * G + g)[:, None] * stride_oh + d[None, :],
                 (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        base = ((b * n_kvh + kvh) * NSPLIT + sp) * BLOCK_G
        tl.store(pm_ptr + base + g, m)
        tl.store(pl_ptr + base + g, l_sum)
        tl.store(po_ptr + (base + g)[:, None] * D + d[None, :], acc)


@triton.jit
def _attn_combine_kernel(po_ptr, pm_ptr, pl_ptr, out_ptr, stride_ob, stride_oh, G: tl.constexpr,
                         NSPLIT: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
    _pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.arange(0, NSPLIT)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    base = ((b * tl.num_programs(1) + kvh) * NSPLIT + sp) * BLOCK_G  # (NSPLIT,)
    idx = base[:, None] + g[None, :]  # (NSPLIT, BLOCK_G)
    m = tl.load(pm_ptr + idx)
    l_sum = tl.load(pl_ptr + idx)
    m_max = tl.max(m, 0)  # (BLOCK_G,)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max[None, :]))  # (NSPLIT, BLOCK_G)
    denom = tl.sum(l_sum * w, 0)
    acc = tl.load(po_ptr + idx[:, :, None] * D + d[None, None, :])  # (NSPLIT, BLOCK_G, D)
    out = tl.sum(acc * w[:, :, None], 0) / denom[:, None]
    gmask = g < G
    tl.store(out_ptr + b * stride_ob + (kvh * G + g)[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


def _block_n(head_dim: int, rows: int = 0) -> int:
    """Keys a block: 128 for head_dim <= 64 — but 64 above 128 rows a step, where many programs share each SM
    and the shorter tiles pipeline better (measured at the 0.5B shape, BENCHMARKS.md round 5) — and 64 above."""
    return 128 if head_dim <= 64 and rows <= 128 else 64


def num_splits_for(batch: int, kv_heads: int, max_len: int, head_dim: int = 64) -> int:
    """Splits per sequence: enough programs to fill the GPU (~4 per SM), but only for long contexts — each
    split covers at least 4 key blocks, since below that the extra programs and the merge of partial results
    cost more than the parallelism gains (at rollout batch sizes a short context runs as one split)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 8
    want = max(1, (4 * sms) // max(1, batch * kv_heads))
    cap = max(1, max_len // (4 * _block_n(head_dim, batch)))
    return min(triton.next_power_of_2(want), triton.next_power_of_2(cap), 16)


# the split kernel's program order (`_attn_split_kernel`'s HEADS_FASTEST); RLHF_MCORE_ATTN_HEADS_FASTEST=0/1 for the A/B
HEADS_FASTEST = os.environ.get("RLHF_MCORE_ATTN_HEADS_FASTEST", "0") == "1"


def attention_config(rows: int, head_dim: int, kv_fp8: bool = False) -> dict:
    """Keys a block, warps and pipeline stages of the decode attention's split kernel (`_block_n`; Triton's
    default warps and stages). Over an FP8 cache with heads of 128 (7B): 128 keys, 4 warps, 3 stages up to 128 rows,
    64 keys, 2 warps, 3 stages above (tune_decode_gemms.py --kv-fp8 at the 7B shape on an H100: 15.6 -> 13.4 us a
    layer at 64 rows, 43.5 -> 39.6 us at 256; BENCHMARKS.md session 35); other head sizes as bf16 (not measured)."""
    if kv_fp8 and head_dim >= 128:
        return dict(BLOCK_N=128, num_warps=4, num_stages=3) if rows <= 128 else dict(BLOCK_N=64, num_warps=2,
                                                                                     num_stages=3)
    return dict(BLOCK_N=_block_n(head_dim, rows), num_warps=4, num_stages=3, HEADS_FASTEST=HEADS_FASTEST)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     seq_lens: torch.Tensor, sm_scale: float, num_splits: int, out: torch.Tensor | None = None,
                     config: dict | None = None, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new query per sequence over its cached keys/values.

    q (B, Hq, D); k_cache, v_cache (S, L, Hkv, D) (one layer, slot-major); slots, seq_lens (B,) int;
    returns (B, Hq, D) in q's dtype. Keys at positions >= seq_lens[b] are ignored. `config`: the split kernel's
    BLOCK_N, num_warps and num_stages (default `attention_config`; launch/bench/tune_decode_gemms.py times others).
    `shared` (src, lens), (B,) int each: row b reads positions < lens[b] from slot src[b] instead of its own, which
    must hold the same keys and values there (the engine's rows of one prefilled prompt all read one copy of it, so
    the copies of a group's rows, read together, are one set of addresses in L2 instead of n).
    k_scale, v_scale (S, L, Hkv) fp32: the caches hold e4m3 codes, each (slot, position, head) vector under its
    scale (`kv_cache.KVCache` in FP8).
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    assert D == triton.next_power_of_2(D) and D >= 16, f"head_dim={D} must be a power of two >= 16"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and q.stride(2) == 1
    kv_fp8 = k_scale is not None
    assert kv_fp8 == (v_scale is not None) == (k_cache.element_size() == 1), "FP8 caches come with both scales"
    if kv_fp8:
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1 and k_scale.dtype == torch.float32
    block_g = max(16, triton.next_power_of_2(G))
    cfg = dict(config or attention_config(B, D, k_scale is not None))
    block_n = cfg.pop("BLOCK_N")
    nsplit = num_splits
    if out is None:
        out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    parts = max(1, nsplit if nsplit > 1 else 0)
    po = torch.empty(B * Hkv * parts * block_g * D if nsplit > 1 else 1, dtype=torch.float32, device=q.device)
    pm = torch.empty(B * Hkv * parts * block_g if nsplit > 1 else 1, dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    pdl = pdl_enabled()
    src, shared_lens = shared if shared is not None else (slots, seq_lens)
    heads_fastest = cfg.pop("HEADS_FASTEST", False)
    _attn_split_kernel[(Hkv, B, nsplit) if heads_fastest else (B, Hkv, nsplit)](
        q, k_cache, v_cache, slots, seq_lens, src, shared_lens, po, pm, pl, out, sm_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        k_scale if kv_fp8 else q, v_scale if kv_fp8 else q, k_scale.stride(0) if kv_fp8 else 0,
        k_scale.stride(1) if kv_fp8 else 0, G=G, NSPLIT=nsplit, BLOCK_G=block_g, BLOCK_N=block_n, D=D,
        IEEE=q.dtype == torch.float32, HAS_SRC=shared is not None, PDL=pdl, KV_FP8=kv_fp8,
        HEADS_FASTEST=heads_fastest, **cfg, **_launch(pdl))
    if nsplit > 1:
        _attn_combine_kernel[(B, Hkv)](po, pm, pl, out, out.stride(0), out.stride(1), G=G, NSPLIT=nsplit,
                                       BLOCK_G=block_g, D=D, PDL=pdl, **_launch(pdl))
    return out


# --------------------------------------------------------------------------------------------------------
@triton.jit
def _linear_kernel(a_ptr, w_ptr, bias_ptr, ws_ptr, out_ptr, M, N, K, stride_am, stride_wn, stride_om, stride_os,
                   HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                   W_SCALED: tl.constexpr, M_FASTEST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, as_ptr=None,
                   A_SCALED: tl.constexpr = False, amax_ptr=None, ROW_AMAX: tl.constexpr = False):
    """out[m, n] = sum_k a[m, k] w[n, k] (+ bias[n]) for a tile of rows x output columns and one K split.

    SILU_MUL: w holds [gate; up] (2N, K) and out = silu(gate) * up, each rounded as transformers does.
    SPLIT_K > 1: program (n, m, s) sums k in split s and writes fp32 partials out[s, m, n] (the consumer,
    `add_rms_norm`, adds the splits in order: deterministic, no atomics).
    W_SCALED: w holds FP8 codes with one fp32 scale per row (ws, 2N of them with SILU_MUL): each code is widened
    to a's dtype (exact: e4m3 and e5m2 are subsets of bf16) and the row's scale multiplies the fp32 sum, which it
    factors out of (weight-only FP8: the activations are not quantized).
    A_SCALED (with W_SCALED): a holds FP8 codes too, with one fp32 scale per row (as_ptr): the products are FP8 x FP8
    tensor-core products into fp32, and both scales multiply the sum (w8a8 with K splits, which cuBLAS's FP8 GEMM
    does not take at decode-sized M).
    M_FASTEST: the grid is (row tiles, column tiles, splits), so the programs of one weight tile's row tiles are
    launched together and share its reads in L2 (a weight larger than L2 would otherwise be read from memory once
    per row tile); else (column tiles, row tiles, splits).
    ROW_AMAX (SPLIT_K == 1): amax_ptr[row, column tile] receives the max |output| of the tile's part of the row, as
    rounded to the output dtype (`quantize_rows_from_partials` turns them into the row's FP8 scale)."""
    if M_FASTEST:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = w_ptrs + N * stride_wn
    _pdl_wait(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs + k0, mask=mmask[:, None], other=0.0)
            w = tl.load(w_ptrs + k0, mask=nmask[:, None], other=0.0)
        else:
            kmask = (k0 + offs_k) < k_hi
            a = tl.load(a_ptrs + k0, mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=nmask[:, None] & kmask[None, :], other=0.0)
        if W_SCALED and not A_SCALED:
            w = w.to(a_ptr.dtype.element_ty)
        if IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        if SILU_MUL:
            if EVEN_K:
                u = tl.load(u_ptrs + k0, mask=nmask[:, None], other=0.0)
            else:
                u = tl.load(u_ptrs + k0, mask=nmask[:, None] & kmask[None, :], other=0.0)
            if W_SCALED and not A_SCALED:
                u = u.to(a_ptr.dtype.element_ty)
            if IEEE:
                acc_u = tl.dot(a, tl.trans(u), acc_u, input_precision="ieee")
            else:
                acc_u = tl.dot(a, tl.trans(u), acc_u)
    if W_SCALED:
        acc *= tl.load(ws_ptr + offs_n, mask=nmask, other=0.0)[None, :]
        if SILU_MUL:
            acc_u *= tl.load(ws_ptr + N + offs_n, mask=nmask, other=0.0)[None, :]
    if A_SCALED:
        a_scale = tl.load(as_ptr + offs_m, mask=mmask, other=0.0)[:, None]
        acc *= a_scale
        if SILU_MUL:
            acc_u *= a_scale
    omask = mmask[:, None] & nmask[None, :]
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT_K > 1:
        tl.store(o_ptrs + pid_k * stride_os, acc, mask=omask)
    else:
        DT = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:  # the GEMM's outputs rounded, then silu(gate) rounded, times up (as the unfused ops round)
            g = acc.to(DT).to(tl.float32)
            up = acc_u.to(DT).to(tl.float32)
            acc = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32) * up
        out = acc.to(DT)
        tl.store(o_ptrs, out, mask=omask)
        if ROW_AMAX:
            amax = tl.max(tl.where(omask, tl.abs(out.to(tl.float32)), 0.0), axis=1)
            tl.store(amax_ptr + offs_m.to(tl.int64) * tl.cdiv(N, BLOCK_N) + pid_n, amax, mask=mmask)


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 8


def linear_config(m: int, n: int, k: int, silu_mul: bool = False, allow_split: bool = False,
                  dtype: torch.dtype = torch.bfloat16, fp8_weight: bool = False, fp8_act: bool = False) -> dict:
    """Tile sizes, K splits, warps and stages of `linear` for an (m x k) @ (k x n) product (n: output columns).

    Chosen on one H200 at the Qwen2.5-0.5B shapes, 64 and 256 rows (launch/bench/profile_decode.py and BENCHMARKS.md,
    round 5): such products are latency-bound, so narrow tiles and K splits (up to ~2 programs an SM, each
    split >= 4 K blocks) put more loads in flight; gate_up with silu*mul takes 128-wide K blocks. FP8 weights
    (one byte a value) take 128-wide K blocks too, so a row's load stays 128 bytes (not yet tuned on a GPU).
    fp8_act (FP8 x FP8 products): the fastest tiles of tune_decode_gemms at the 7B shape on an H100 (session 34), 64
    and 256 rows: K blocks of 256 and 2 splits for K >= 8,192 at <= 64 rows; 128-row tiles and 8 warps above, and
    for K >= 8,192 (down) 128-wide tiles, 2 splits and 4 stages (session 36: 55.6 -> 46.1 us with the add+norm at
    256 rows against session 34's 4 splits and 3 stages; cuBLAS 53.0; a TMA-load variant of the kernel 45.4).
    The error grows with the K one split sums (Hopper's FP8 MMA accumulates in fewer bits than fp32, as DeepSeek-V3's
    report notes): max error over the fp32 product 0.0026 with 4 splits, 0.0048 with 2, 0.0099 with 1; cuBLAS 0.0024."""
    if fp8_act:
        big_k = k >= 8192
        if m <= 64:
            bm = max(16, triton.next_power_of_2(m))
            cfg = (dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=3) if silu_mul else
                   dict(BLOCK_N=64 if big_k else 32, BLOCK_K=256, SPLIT_K=2 if big_k else 1, num_warps=4,
                        num_stages=4))
        else:
            bm = 128
            down = big_k and not silu_mul
            cfg = dict(BLOCK_N=128 if down else 64, BLOCK_K=128, SPLIT_K=2 if down else 1, num_warps=8,
                       num_stages=4 if down else 3)
        if not allow_split:
            cfg["SPLIT_K"] = 1
        return dict(BLOCK_M=bm, **cfg)
    bm = 64 if m > 32 else max(16, triton.next_power_of_2(m))
    bk = 32 if dtype == torch.float32 else (128 if silu_mul or fp8_weight else 64)
    bn = 32 if k < 2048 and not silu_mul else 64
    split = 1
    if allow_split:
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        while split < 8 and tiles * split * 2 <= 2 * _num_sms() and k // (split * 2) >= 4 * bk:
            split *= 2
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=3 if silu_mul else 4)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
           allow_split: bool = False, config: dict | None = None, w_scale: torch.Tensor | None = None,
           x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           quantize: torch.dtype | None = None) -> torch.Tensor | Fp8Rows:
    """x (M, K) @ w.T for w (N, K) in transformers' orientation, + bias; a decode-sized (small M) GEMM.

    silu_mul: w is [gate; up] (2I, K) and the result is silu(x @ gate.T) * (x @ up.T), (M, I).
    allow_split: the consumer (`add_rms_norm`) takes K-split partials: the result may be (S, M, N) fp32
    (S = the config's SPLIT_K), which `add_rms_norm` sums. Otherwise (M, N) in x's dtype.
    w_scale: w is FP8 codes and w_scale its fp32 scale per row (2I with silu_mul): the product is x @ (w * w_scale).T
    with x unquantized (weight-only FP8, `fp8_decode="w8a16"` of the engine).
    x_scale (with w_scale): x is FP8 codes too, with this fp32 scale per row (`kernels.fp8.quantize_rows`): FP8 x FP8
    products, x @ (w * w_scale).T scaled per row; the result in `out_dtype` (bf16 by default), or K-split fp32
    partials as above.
    quantize (an FP8 dtype; no K splits): the result's per-row codes (`Fp8Rows`, exactly what
    `kernels.fp8.quantize_rows` makes of the stored result), for the FP8 GEMM it feeds: the epilogue leaves each
    tile's row amax, and one parallel pass (`quantize_rows_from_partials`) casts, instead of a kernel that reads each
    row twice."""
    m, k = x.shape
    n = w.shape[0] // 2 if silu_mul else w.shape[0]
    assert x.stride(1) == 1 and w.is_contiguous() and w.shape[1] == k
    assert (w_scale is None) == (w.element_size() != 1), "FP8 weights need their scales, and only they take them"
    assert (x_scale is None) == (x.element_size() != 1), "FP8 activations need their scales, and only they take them"
    assert x_scale is None or w_scale is not None, "FP8 activations multiply FP8 weights only"
    if w_scale is not None:
        w_scale = w_scale.reshape(-1)
        assert w_scale.dtype == torch.float32 and w_scale.numel() == w.shape[0] and w_scale.is_contiguous()
    if x_scale is not None:
        x_scale = x_scale.reshape(-1)
        assert x_scale.dtype == torch.float32 and x_scale.numel() == m and x_scale.is_contiguous()
    out_dtype = out_dtype or (torch.bfloat16 if x_scale is not None else x.dtype)
    cfg = dict(config or linear_config(m, n, k, silu_mul, allow_split and not silu_mul, out_dtype,
                                       fp8_weight=w_scale is not None, fp8_act=x_scale is not None))
    split = cfg.pop("SPLIT_K")
    assert quantize is None or split == 1, "a quantized result is whole rows, not K-split partials"
    if split > 1:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    # FP8 weights (7B-sized ones exceed L2) launch a weight tile's row tiles together; the bf16 path keeps the
    # order it was measured with
    m_fastest = w_scale is not None and triton.cdiv(m, cfg["BLOCK_M"]) > 1
    tiles = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    grid = (*(tiles[::-1] if m_fastest else tiles), split)
    amax = None if quantize is None else torch.empty(m, tiles[0], dtype=torch.float32, device=x.device)
    pdl = pdl_enabled()
    _linear_kernel[grid](x, w, bias if bias is not None else x, w_scale if w_scale is not None else x, out, m, n, k,
                         x.stride(0), w.stride(0), out.stride(-2), out.stride(0) if split > 1 else 0,
                         HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT_K=split,
                         EVEN_K=k % (split * cfg["BLOCK_K"]) == 0, W_SCALED=w_scale is not None,
                         M_FASTEST=m_fastest,
                         IEEE=x.dtype == torch.float32, PDL=pdl, as_ptr=x_scale if x_scale is not None else x,
                         A_SCALED=x_scale is not None, amax_ptr=amax, ROW_AMAX=amax is not None, **cfg,
                         **_launch(pdl))
    return out if quantize is None else quantize_rows_from_partials(out, amax, quantize)


@triton.jit
def _quant_from_partials_kernel(x_ptr, amax_ptr, q_ptr, s_ptr, M, N, T, QMAX: tl.constexpr, BLOCK: tl.constexpr,
                                BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """Program (row, column block): the row's scale from its T partial maxima (contiguous), then its block's codes."""
    _pdl_wait(PDL)
    row, blk = tl.program_id(0), tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    scale = _row_scale(tl.max(tl.load(amax_ptr + row.to(tl.int64) * T + t, mask=t < T, other=0.0), 0), QMAX)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    v = tl.load(x_ptr + row.to(tl.int64) * N + cols, mask=mask, other=0.0)
    tl.store(q_ptr + row.to(tl.int64) * N + cols, _row_codes(v, scale, QMAX).to(q_ptr.dtype.element_ty), mask=mask)
    if blk == 0:
        tl.store(s_ptr + row, scale)


def quantize_rows_from_partials(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> Fp8Rows:
    """x (M, N) contiguous, amax (M, T) contiguous: per-row maxima of |x| over T column ranges (a GEMM epilogue's,
    ROW_AMAX) -> `Fp8Rows`, equal to `kernels.fp8.quantize_rows(x)`. Each program reduces its row's T maxima from
    one contiguous load (session 36's (T, M) layout read them at a stride of M: 13.8 us a call at 256 x 18,944 on an
    H100, slower than quantizing the row outright; BENCHMARKS.md session 37)."""
    m, n = x.shape
    assert amax.shape[0] == m and amax.is_contiguous()
    q = torch.empty(m, n, dtype=dtype, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block = 2048
    pdl = pdl_enabled()
    _quant_from_partials_kernel[(m, triton.cdiv(n, block))](x, amax, q, scale, m, n, amax.shape[1],
                                                           QMAX=FP8_MAX[dtype], BLOCK=block,
                                                           BLOCK_T=triton.next_power_of_2(amax.shape[1]), PDL=pdl,
                                                           num_warps=4, **_launch(pdl))
    return Fp8Rows(q, scale, x.dtype)


# --------------------------------------------------------------------------------------------------------
# Element-wise fusions of the decoder layer. Each reproduces transformers' rounding steps in the model dtype
# (products and sums rounded to bf16 where transformers computes in bf16), so a bf16 run stays as close to
# the Hugging Face model as the unfused torch ops are; in fp32 the extra casts are no-ops.

@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, h_ptr, D, eps, stride_ds, HAS_DELTA: tl.constexpr,
                         NSPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, s_ptr=None,
                         QMAX: tl.constexpr = 0.0):
    """QMAX > 0: h_ptr receives the normed row's FP8 codes and s_ptr its scale, as `_row_codes` computes them."""
    _pdl_wait(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        for s in range(1, NSPLIT):  # K-split partials of a GEMM (fp32), summed in order, rounded like its output
            d += tl.load(delta_ptr + s * stride_ds + row * D + cols, mask=mask, other=0.0)
        d = d.to(x_ptr.dtype.element_ty).to(tl.float32)
        x = (x.to(tl.float32) + d).to(x_ptr.dtype.element_ty)  # residual add, rounded
        tl.store(x_ptr + row * D + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    h = (w * (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)).to(x_ptr.dtype.element_ty)
    if QMAX > 0:
        scale = _row_scale(tl.max(tl.abs(h.to(tl.float32)), 0), QMAX)
        tl.store(h_ptr + row * D + cols, _row_codes(h, scale, QMAX).to(h_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)
    else:
        tl.store(h_ptr + row * D + cols, h, mask=mask)


@triton.jit
def _row_scale(amax, QMAX: tl.constexpr):
    """A row's FP8 decoding scale, as `kernels.fp8.quantize_rows` sets it: amax / QMAX, 1 for an all-zero row."""
    return tl.where(amax > 0, amax / QMAX, 1.0)


@triton.jit
def _row_codes(v, scale, QMAX: tl.constexpr):
    """v / scale clamped to +-QMAX in fp32 (the caller casts), as `kernels.fp8.quantize_rows` computes codes."""
    return tl.minimum(tl.maximum(v.to(tl.float32) / scale, -QMAX), QMAX)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 quantize: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
    """x += delta (in place, if given); returns (x, rms_norm(x) * weight). x, delta (N, D) contiguous; delta
    may also be (S, N, D) fp32 K-split partials of a GEMM (`linear(allow_split=True)`), summed first.
    quantize (an FP8 dtype): the normed rows come back as `Fp8Rows`, what `kernels.fp8.quantize_rows` makes of them
    (the FP8 GEMM after the norm takes them; one kernel fewer, and the bf16 rows are never written) -- up to the
    norm's last fp32 bit on a GPU, where this variant is compiled on its own (an H100: 10 of 14.7M codes one e4m3
    step apart at 4,099 rows, BENCHMARKS.md session 36)."""
    n, d = x.shape
    assert x.is_contiguous() and (delta is None or delta.is_contiguous())
    nsplit = delta.shape[0] if delta is not None and delta.dim() == 3 else 1
    h = torch.empty_like(x) if quantize is None else torch.empty(n, d, dtype=quantize, device=x.device)
    scale = None if quantize is None else torch.empty(n, 1, dtype=torch.float32, device=x.device)
    _add_rms_norm_kernel[(n,)](x, delta if delta is not None else x, weight, h, d, eps, n * d,
                               HAS_DELTA=delta is not None, NSPLIT=nsplit, BLOCK=triton.next_power_of_2(d),
                               PDL=pdl_enabled(), s_ptr=scale, QMAX=0.0 if quantize is None else FP8_MAX[quantize],
                               **_launch(pdl_enabled()))
    return x, (h if quantize is None else Fp8Rows(h, scale, x.dtype))


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl_wait(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_value(g_row, cols, mask, inter, DT: tl.constexpr):
    """silu(gate) * up of one row's columns, rounded to DT as `_silu_mul_kernel` rounds them (fp32 out)."""
    g = tl.load(g_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    return (a * u).to(DT).to(tl.float32)


@triton.jit
def _silu_mul_quant_kernel(gu_ptr, q_ptr, s_ptr, inter, QMAX: tl.constexpr, BLOCK: tl.constexpr):
    """One program a row: silu(gate) * up, its amax (first pass), then its FP8 codes (second pass, recomputed: the
    row's gate_up is read again, mostly from L2, instead of writing and reading the bf16 product)."""
    row = tl.program_id(0).to(tl.int64)
    g_row = gu_ptr + row * 2 * inter
    DT = gu_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, tl.abs(_silu_mul_value(g_row, cols, cols < inter, inter, DT)))
    scale = _row_scale(tl.max(acc, 0), QMAX)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < inter
        v = _silu_mul_value(g_row, cols, mask, inter, DT)
        tl.store(q_ptr + row * inter + cols, _row_codes(v, scale, QMAX).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


# `_silu_mul_quant_kernel`'s column block and warps (one program a row, two passes over it): at 32k x 18,944 (the 7B
# prefill) 1.42 ms against 1.82 with 4,096 / 8 (the first pick), 1.56 computing the product in place of gate and
# reading it back, 1.44 holding the whole row in registers (one pass); bf16 silu*mul alone 1.27 (an H100,
# .notes/s37 exp_prefill, BENCHMARKS.md session 37)
SILU_QUANT_CONFIG = dict(BLOCK=8192, num_warps=16)


def silu_mul(gate_up: torch.Tensor, quantize: torch.dtype | None = None) -> torch.Tensor | Fp8Rows:
    """silu(gate) * up for gate_up (N, 2I) = [gate | up] -> (N, I). quantize (an FP8 dtype): the product's per-row
    codes instead (`Fp8Rows`, what `kernels.fp8.quantize_rows` makes of it), in one kernel that never writes it in
    bf16 (the FP8 prefill's MLP: 1.81 against 2.29 ms for silu*mul and the quantization at 32k x 18,944, an H100,
    session 36)."""
    n, two_i = gate_up.shape
    inter = two_i // 2
    assert gate_up.is_contiguous()
    if quantize is not None:
        q = torch.empty(n, inter, dtype=quantize, device=gate_up.device)
        scale = torch.empty(n, 1, dtype=torch.float32, device=gate_up.device)
        _silu_mul_quant_kernel[(n,)](gate_up, q, scale, inter, QMAX=FP8_MAX[quantize], **SILU_QUANT_CONFIG)
        return Fp8Rows(q, scale, gate_up.dtype)
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, PDL=pdl_enabled(),
                                                     **_launch(pdl_enabled()))
    return out


@triton.jit
def _head_norm(x1, x2, w_ptr, eps, HALF: tl.constexpr, BLOCK_H: tl.constexpr, DT: tl.constexpr):
    """Per-head RMSNorm (Qwen3 q_norm / k_norm) of rows of one head given as its two halves (R, BLOCK_H; columns
    from HALF on are zero padding), HF rounding."""
    ms = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
    inv = (1.0 / tl.sqrt(ms + eps))[:, None]
    i = tl.arange(0, BLOCK_H)
    w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    y1 = (w1 * (x1 * inv).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    y2 = (w2 * (x2 * inv).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    return y1, y2


@triton.jit
def _qkv_rope_cache_kernel(a_ptr, w_ptr, bias_ptr, ws_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, q_out_ptr,
                           k_cache_ptr, v_cache_ptr, M, K, stride_am, stride_wn, stride_cs, stride_cl, qn_ptr, kn_ptr,
                           eps, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                           HAS_BIAS: tl.constexpr, W_SCALED: tl.constexpr,
                           QK_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                           EVEN_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, HEAD_SPLIT: tl.constexpr = 1,
                           FROM_QKV: tl.constexpr = False, ks_ptr=None, vs_ptr=None, stride_ss=0, stride_sl=0,
                           KV_FP8: tl.constexpr = False, PACKED_KV: tl.constexpr = False):
    """One head (program axis 0: [0, HQ) q heads, then HKV k heads, then v heads) of qkv = a @ w.T + bias for a
    tile of rows, then in registers: (optional q/k RMSNorm), rotary embedding at each row's position, and the
    store — q to q_out (M, HQ, D), k and v into the cache at (slot, position). The head's two halves are two
    accumulators, so rotate_half needs no data movement (each padded to BLOCK_H >= 16 columns for tl.dot).
    W_SCALED: w holds FP8 codes with one fp32 scale per row (ws), as in `_linear_kernel`.
    HEAD_SPLIT > 1 (no QK_NORM, which needs the whole head): program axis 0 is head * HEAD_SPLIT + part, and the
    program takes columns [part * BLOCK_H, (part + 1) * BLOCK_H) of each half (BLOCK_H = HALF / HEAD_SPLIT): the
    pairs RoPE mixes stay in one program, and a head's weight rows are read by HEAD_SPLIT programs at once.
    FROM_QKV: no GEMM: a_ptr is the projection's output qkv (M, (HQ + 2 HKV) D), bias included (cuBLAS computed it,
    `rope_cache`), and the program reads its head's columns from it (w, bias, scales unused).
    KV_FP8 (HEAD_SPLIT 1: the scale needs the whole head): the caches take e4m3 codes of k and v (the model-dtype
    values quantized per row and head, `kv_cache.quantize_kv`'s rule) and ks / vs the scales, at (slot, position,
    head) with strides (stride_ss, stride_sl, 1).
    PACKED_KV (a prefill's packed tokens, `rope_qkv`): k and v go to k_cache_ptr / v_cache_ptr as packed rows
    (M, HKV, D) in the model dtype instead of into a cache (slot_ptr unused)."""
    head = tl.program_id(0) // HEAD_SPLIT
    pid_m = tl.program_id(1)
    D: tl.constexpr = 2 * HALF
    DT = q_out_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    i = (tl.program_id(0) % HEAD_SPLIT) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = i < HALF
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w1_ptrs = w_ptr + (head * D + i)[:, None] * stride_wn + offs_k[None, :]
    w2_ptrs = w1_ptrs + HALF * stride_wn
    _pdl_wait(PDL)
    acc1 = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    if FROM_QKV:
        r_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (head * D + i)[None, :]
        acc1 += tl.load(r_ptrs, mask=mmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
        acc2 += tl.load(r_ptrs + HALF, mask=mmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
    for k0 in range(0, K if not FROM_QKV else 0, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs + k0, mask=mmask[:, None], other=0.0)
            w1 = tl.load(w1_ptrs + k0, mask=hmask[:, None], other=0.0)
            w2 = tl.load(w2_ptrs + k0, mask=hmask[:, None], other=0.0)
        else:
            kmask = (k0 + offs_k) < K
            a = tl.load(a_ptrs + k0, mask=mmask[:, None] & kmask[None, :], other=0.0)
            w1 = tl.load(w1_ptrs + k0, mask=hmask[:, None] & kmask[None, :], other=0.0)
            w2 = tl.load(w2_ptrs + k0, mask=hmask[:, None] & kmask[None, :], other=0.0)
        if W_SCALED:
            w1 = w1.to(a_ptr.dtype.element_ty)
            w2 = w2.to(a_ptr.dtype.element_ty)
        if IEEE:
            acc1 = tl.dot(a, tl.trans(w1), acc1, input_precision="ieee")
            acc2 = tl.dot(a, tl.trans(w2), acc2, input_precision="ieee")
        else:
            acc1 = tl.dot(a, tl.trans(w1), acc1)
            acc2 = tl.dot(a, tl.trans(w2), acc2)
    if W_SCALED and not FROM_QKV:
        acc1 *= tl.load(ws_ptr + head * D + i, mask=hmask, other=0.0)[None, :]
        acc2 *= tl.load(ws_ptr + head * D + HALF + i, mask=hmask, other=0.0)[None, :]
    if HAS_BIAS and not FROM_QKV:
        acc1 += tl.load(bias_ptr + head * D + i, mask=hmask, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(bias_ptr + head * D + HALF + i, mask=hmask, other=0.0).to(tl.float32)[None, :]
    x1 = acc1.to(DT).to(tl.float32)  # the projection's output, rounded as F.linear rounds it
    x2 = acc2.to(DT).to(tl.float32)
    pos = tl.load(pos_ptr + offs_m, mask=mmask, other=0)
    if PACKED_KV:
        slot = offs_m.to(tl.int64)
        cache_off = (slot * (HKV * D))[:, None]
    else:
        slot = tl.load(slot_ptr + offs_m, mask=mmask, other=0).to(tl.int64)
        cache_off = (slot * stride_cs + pos * stride_cl)[:, None]
    omask = mmask[:, None] & hmask[None, :]
    if head < HQ + HKV:
        if QK_NORM:
            if head < HQ:
                x1, x2 = _head_norm(x1, x2, qn_ptr, eps, HALF, BLOCK_H, DT)
            else:
                x1, x2 = _head_norm(x1, x2, kn_ptr, eps, HALF, BLOCK_H, DT)
        t = pos[:, None] * D + i[None, :]
        c1 = tl.load(cos_ptr + t, mask=omask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t + HALF, mask=omask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t, mask=omask, other=0.0).to(tl.float32)  # signed table: -sin in the first half
        s2 = tl.load(sin_ptr + t + HALF, mask=omask, other=0.0).to(tl.float32)
        # cos is repeated over both halves; the signed sin table already holds -sin in the first half.
        y1 = ((x1 * c1).to(DT).to(tl.float32) + (x2 * s1).to(DT).to(tl.float32)).to(DT)
        y2 = ((x2 * c2).to(DT).to(tl.float32) + (x1 * s2).to(DT).to(tl.float32)).to(DT)
        # (each branch names its own destination: a runtime branch's variables must keep one type, and an FP8
        # cache's pointers are not q's)
        if head < HQ:
            q_dst = q_out_ptr + (offs_m[:, None].to(tl.int64) * HQ + head) * D + i[None, :]
            tl.store(q_dst, y1, mask=omask)
            tl.store(q_dst + HALF, y2, mask=omask)
        else:
            k_dst = k_cache_ptr + cache_off + (head - HQ) * D + i[None, :]
            if KV_FP8:
                _store_kv_fp8(k_dst, y1.to(tl.float32), y2.to(tl.float32), omask, HALF,
                              ks_ptr + slot * stride_ss + pos * stride_sl + (head - HQ), mmask)
            else:
                tl.store(k_dst, y1, mask=omask)
                tl.store(k_dst + HALF, y2, mask=omask)
    else:
        v_dst = v_cache_ptr + cache_off + (head - HQ - HKV) * D + i[None, :]
        if KV_FP8:
            _store_kv_fp8(v_dst, x1, x2, omask, HALF,
                          vs_ptr + slot * stride_ss + pos * stride_sl + (head - HQ - HKV), mmask)
        else:
            tl.store(v_dst, x1.to(DT), mask=omask)
            tl.store(v_dst + HALF, x2.to(DT), mask=omask)


@triton.jit
def _store_kv_fp8(out, x1, x2, omask, HALF: tl.constexpr, scale_ptrs, mmask):
    """Rows of one head given as its two halves (R, BLOCK_H) fp32 (model-dtype values; padding columns 0): e4m3
    codes at out / out + HALF under one scale a row, amax / 448 (1 for a zero row), stored at scale_ptrs (R,)."""
    amax = tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1))
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    code = out.dtype.element_ty
    tl.store(out, tl.minimum(tl.maximum(x1 / scale[:, None], -448.0), 448.0).to(code), mask=omask)
    tl.store(out + HALF, tl.minimum(tl.maximum(x2 / scale[:, None], -448.0), 448.0).to(code), mask=omask)
    tl.store(scale_ptrs, scale, mask=mmask)


def qkv_rope_cache(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                   slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, heads: int, kv_heads: int, q_norm: torch.Tensor | None = None,
                   k_norm: torch.Tensor | None = None, eps: float = 1e-6, block_m: int | None = None,
                   block_k: int | None = None, num_warps: int = 4, num_stages: int = 4,
                   w_scale: torch.Tensor | None = None, head_split: int | None = None,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode-step fusion of the QKV projection with what follows it: qkv = x @ w.T + bias (w (Hq + 2 Hkv) D x K),
    (optional per-head q/k RMSNorm), rotary embedding, and the KV-cache write.

    x (B, K) rows; positions, slots (B,); cos, sin (max_len, D) tables from `rope.rope_tables`; caches
    (S, L, Hkv, D) of one layer. Writes k, v at cache[slot, position]; returns rotated q (B, Hq, D).
    w_scale: w is FP8 codes with this fp32 scale per row (weight-only FP8, as `linear`'s).
    head_split: programs a head (each takes 1 / head_split of both halves' columns, >= 16 of each); default
    `qkv_head_split` (1 with q/k norms or an FP8 cache). k_scale, v_scale (S, L, Hkv) fp32: FP8 caches (e4m3
    codes, a scale per token and head, written here)."""
    m, k = x.shape
    D = cos.shape[1]
    assert x.stride(1) == 1 and w.is_contiguous() and w.shape == ((heads + 2 * kv_heads) * D, k)
    assert (w_scale is None) == (w.element_size() != 1), "FP8 weights need their scales, and only they take them"
    if w_scale is not None:
        w_scale = w_scale.reshape(-1)
        assert w_scale.dtype == torch.float32 and w_scale.numel() == w.shape[0] and w_scale.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and D == triton.next_power_of_2(D) and D >= 2
    fp32 = x.dtype == torch.float32
    bm = block_m or (64 if m > 32 else max(16, triton.next_power_of_2(m)))
    # K blocks of 64 above 256 rows (bf16 weights): 10.4 -> 8.1 us at 512 rows on an H100, level at 256
    # (launch/bench/tune_decode_gemms.py, BENCHMARKS.md session 30); FP8 codes keep 128-byte row loads
    bk = block_k or (32 if fp32 else 64 if m > 256 and w_scale is None else 128)
    q_out = torch.empty(m, heads, D, dtype=x.dtype, device=x.device)
    qk_norm = q_norm is not None
    kv = _kv_scales(k_cache, k_scale, v_scale)
    split = head_split or qkv_head_split(heads + 2 * kv_heads, triton.cdiv(m, bm), D, qk_norm or kv["KV_FP8"])
    assert split == 1 or not (qk_norm or kv["KV_FP8"]) and D // 2 % split == 0 and D // 2 // split >= 16, (
        f"head_split={split}: each program needs >= 16 columns of each half of a {D}-wide head, and no q/k norm "
        "or FP8 cache (their statistics span the head)")
    pdl = pdl_enabled()
    _qkv_rope_cache_kernel[((heads + 2 * kv_heads) * split, triton.cdiv(m, bm))](
        x, w, bias if bias is not None else x, w_scale if w_scale is not None else x, positions, slots, cos, sin,
        q_out, k_cache, v_cache, m, k, x.stride(0), w.stride(0), k_cache.stride(0), k_cache.stride(1),
        q_norm if qk_norm else cos, k_norm if qk_norm else cos, eps, HQ=heads, HKV=kv_heads, HALF=D // 2,
        BLOCK_H=max(16, D // 2 // split), HAS_BIAS=bias is not None, W_SCALED=w_scale is not None, QK_NORM=qk_norm,
        BLOCK_M=bm, BLOCK_K=bk, EVEN_K=k % bk == 0, IEEE=fp32,
        PDL=pdl, HEAD_SPLIT=split, num_warps=num_warps, num_stages=num_stages, **kv, **_launch(pdl))
    return q_out


def _kv_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> dict:
    """The FP8 cache arguments of `_qkv_rope_cache_kernel` (none for a model-dtype cache)."""
    kv_fp8 = k_scale is not None
    assert kv_fp8 == (v_scale is not None) == (cache.element_size() == 1), "FP8 caches come with both scales"
    if not kv_fp8:
        return {"KV_FP8": False}
    assert k_scale.is_contiguous() and v_scale.is_contiguous() and k_scale.dtype == torch.float32
    return dict(ks_ptr=k_scale, vs_ptr=v_scale, stride_ss=k_scale.stride(0), stride_sl=k_scale.stride(1),
                KV_FP8=True)


# Launch option of the rotary epilogues that read a computed projection (`rope_cache`, `rope_qkv`): with the
# compiler's default floating-point fusion their bf16 rotation differed from the torch path's (`apply_rope`, which
# rounds each product and the sum as transformers does) in 16% of q's values by up to one bf16 step; without it, bit
# for bit the same (an H100, session 37). The kernel is memory-bound: no cost.
NO_FP_FUSION = {"enable_fp_fusion": False}


def rope_cache(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
               q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What `qkv_rope_cache` does after its GEMM, for a projection computed elsewhere (cuBLAS, where a large weight
    streams faster through it: `model.TRITON_GEMM_MAX_WEIGHT`): qkv (B, (Hq + 2 Hkv) D) with its bias -> (optional
    q/k RMSNorm), rotary embedding, k and v written at cache[slot, position]; returns rotated q (B, Hq, D). The same
    rounding as the torch path (F.linear, then `apply_rope` in the model dtype). k_scale, v_scale: FP8 caches, as
    `qkv_rope_cache`'s."""
    m, n = qkv.shape
    D = cos.shape[1]
    assert qkv.stride(1) == 1 and n == (heads + 2 * kv_heads) * D
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and D == triton.next_power_of_2(D) and D >= 2
    bm = 64 if m > 32 else max(16, triton.next_power_of_2(m))
    q_out = torch.empty(m, heads, D, dtype=qkv.dtype, device=qkv.device)
    qk_norm = q_norm is not None
    pdl = pdl_enabled()
    _qkv_rope_cache_kernel[(heads + 2 * kv_heads, triton.cdiv(m, bm))](
        qkv, qkv, qkv, qkv, positions, slots, cos, sin, q_out, k_cache, v_cache, m, 0, qkv.stride(0), 0,
        k_cache.stride(0), k_cache.stride(1), q_norm if qk_norm else cos, k_norm if qk_norm else cos, eps, HQ=heads,
        HKV=kv_heads, HALF=D // 2, BLOCK_H=max(16, D // 2), HAS_BIAS=False, W_SCALED=False, QK_NORM=qk_norm,
        BLOCK_M=bm, BLOCK_K=16, EVEN_K=True, IEEE=qkv.dtype == torch.float32, PDL=pdl, FROM_QKV=True,
        num_warps=4, num_stages=1, **_kv_scales(k_cache, k_scale, v_scale), **NO_FP_FUSION, **_launch(pdl))
    return q_out


def rope_qkv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
             kv_heads: int, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
             eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefill's split of a projection qkv (N, (Hq + 2 Hkv) D) with its bias into rotated q (N, Hq, D), rotated k
    and v (N, Hkv, D), each contiguous (what flash attention and the cache write take), in one kernel: `rope_cache`'s
    epilogue writing packed rows instead of cache slots. The torch path (`apply_rope` on the views, then the
    copies attention makes of them) took 2.35 ms at 32k tokens of the 7B shape, this kernel 0.21 ms (an H100,
    BENCHMARKS.md session 37). Bit for bit that path in bf16 (`NO_FP_FUSION`)."""
    m, n = qkv.shape
    D = cos.shape[1]
    assert qkv.stride(1) == 1 and n == (heads + 2 * kv_heads) * D and D == triton.next_power_of_2(D) and D >= 2
    bm = 64 if m > 32 else max(16, triton.next_power_of_2(m))
    q = torch.empty(m, heads, D, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(m, kv_heads, D, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty(m, kv_heads, D, dtype=qkv.dtype, device=qkv.device)
    qk_norm = q_norm is not None
    pdl = pdl_enabled()
    _qkv_rope_cache_kernel[(heads + 2 * kv_heads, triton.cdiv(m, bm))](
        qkv, qkv, qkv, qkv, positions, positions, cos, sin, q, k, v, m, 0, qkv.stride(0), 0, 0, 0,
        q_norm if qk_norm else cos, k_norm if qk_norm else cos, eps, HQ=heads, HKV=kv_heads, HALF=D // 2,
        BLOCK_H=max(16, D // 2), HAS_BIAS=False, W_SCALED=False, QK_NORM=qk_norm, BLOCK_M=bm, BLOCK_K=16,
        EVEN_K=True, IEEE=qkv.dtype == torch.float32, PDL=pdl, FROM_QKV=True, KV_FP8=False, PACKED_KV=True,
        num_warps=4, num_stages=1, **NO_FP_FUSION, **_launch(pdl))
    return q, k, v


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, tok_ptr, slot_ptr, pos_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, J, stride_t,
                     stride_cs, stride_cl, stride_ss, stride_sl, HKV: tl.constexpr, D: tl.constexpr,
                     BLOCK_J: tl.constexpr, KV_FP8: tl.constexpr):
    """Program (block of write entries, head; heads [0, HKV) of k, then HKV of v): entry j's head vector is token
    tok[j]'s row of k or v (N, HKV, D), written at cache[slot[j], pos[j], head]; an FP8 cache takes its e4m3 codes
    and scale (`_store_kv_fp8`'s rule: amax / 448 per row, 1 for a zero row)."""
    head = tl.program_id(1)
    j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    jmask = j < J
    d = tl.arange(0, D)
    mask = jmask[:, None]
    tok = tl.load(tok_ptr + j, mask=jmask, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + j, mask=jmask, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + j, mask=jmask, other=0).to(tl.int64)
    h = head % HKV
    src = (tok * stride_t + h * D)[:, None] + d[None, :]
    dst = (slot * stride_cs + pos * stride_cl + h * D)[:, None] + d[None, :]
    sdst = slot * stride_ss + pos * stride_sl + h
    if head < HKV:
        _copy_kv_rows(k_ptr + src, kc_ptr + dst, ks_ptr + sdst, mask, jmask, KV_FP8)
    else:
        _copy_kv_rows(v_ptr + src, vc_ptr + dst, vs_ptr + sdst, mask, jmask, KV_FP8)


@triton.jit
def _copy_kv_rows(src, dst, scale_dst, mask, jmask, KV_FP8: tl.constexpr):
    """Rows (R, D) from src to dst; into an FP8 cache as e4m3 codes under one scale a row (amax / 448, 1 for a zero
    row) stored at scale_dst (R,)."""
    x = tl.load(src, mask=mask, other=0.0)
    if KV_FP8:
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), 1)
        scale = tl.where(amax > 0, amax / 448.0, 1.0)
        tl.store(dst, tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0).to(dst.dtype.element_ty), mask=mask)
        tl.store(scale_dst, scale, mask=jmask)
    else:
        tl.store(dst, x, mask=mask)


def kv_write(k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """The prefill's cache write in one kernel: keys and values k, v (N, Hkv, D) contiguous; entry j writes token
    tokens[j]'s k and v at cache[slots[j], positions[j]] (a fresh prompt's tokens go to every slot of its samples).
    Caches (S, L, Hkv, D) of one layer; with k_scale, v_scale (S, L, Hkv) fp32 an FP8 cache (codes and a scale a
    token and head, as `KVCache.put` writes them). Replaces the torch path's gathers of k and v, quantization and
    index_put_ (eight kernels a layer in FP8, ~1 ms a layer of the 7B prefill at batch 256: BENCHMARKS.md session
    37)."""
    n, hkv, D = k.shape
    assert k.is_contiguous() and v.is_contiguous() and v.shape == k.shape and D == triton.next_power_of_2(D)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and tuple(k_cache.shape[2:]) == (hkv, D)
    kv = _kv_scales(k_cache, k_scale, v_scale)
    j = tokens.numel()
    if j == 0:
        return
    block = 32
    _kv_write_kernel[(triton.cdiv(j, block), 2 * hkv)](
        k, v, tokens, slots, positions, k_cache, v_cache, kv.get("ks_ptr", k), kv.get("vs_ptr", v), j, hkv * D,
        k_cache.stride(0), k_cache.stride(1), kv.get("stride_ss", 0), kv.get("stride_sl", 0), HKV=hkv, D=D,
        BLOCK_J=block, KV_FP8=kv["KV_FP8"], num_warps=4)


def qkv_head_split(head_count: int, row_tiles: int, head_dim: int, qk_norm: bool) -> int:
    """Programs a head for `qkv_rope_cache`: 1 (the measured default until the tuner says otherwise)."""
    return 1
