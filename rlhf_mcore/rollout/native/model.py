"""The decoder forward pass of the native engine (Qwen2 / Llama / Qwen3), in plain torch on HF-layout weights.

Two entry points share the per-layer code:
  - `prefill`: packed new tokens of several prompts (N tokens in all); writes their keys/values into the
    cache slots of every sample of the prompt and returns logits for each prompt's last token only; a
    sequence whose slot already holds a prefix (a session's earlier turns) continues its positions and
    attends to it;
  - `decode`: one token per running sequence (B rows); writes its key/value at (slot, position), attends
    over the sequence's cache, returns logits (B, V). This is what CUDA graphs capture.

Layer structure: the residual add is fused with the next RMSNorm (`add_norm`), so a layer is
  qkv GEMM -> rope + cache write -> attention -> o GEMM -> add+norm -> gate_up GEMM -> silu*mul -> down GEMM
  -> add+norm (with the next layer's input norm, or the final norm).
With `fused=True` (GPU) the element-wise steps are Triton kernels (triton_kernels.py; in prefill the rotary split of
the projection into packed q, k, v too, `rope_qkv`), which is what bounds a CUDA-graph decode step; with
`fused=False` they are torch ops (CPU, and the reference). Both round like transformers does. A fused decode step
also runs its layer GEMMs as Triton kernels (cuBLAS stays for prefill and the LM head): the QKV GEMM does rope and
the cache write in its epilogue, o_proj and down_proj split K over more programs and leave fp32 partials that the
next add+norm sums (no separate reduce), and at small batches the gate_up GEMM applies silu*mul itself — 7 kernels a
layer (8 above 64 rows), against 10 with cuBLAS. Above 256 rows (`TRITON_OUT_PROJ_MAX_ROWS`) o_proj and down_proj go
back to cuBLAS, which is faster there, and so do weights above `TRITON_GEMM_MAX_WEIGHT` elements (the 7B shape's;
its QKV projection then runs on cuBLAS before `rope_cache`).

Tensor parallelism: each rank holds its heads / MLP columns (see weights.py) and the outputs of o_proj and
down_proj are summed over `tp_group` with one all-reduce each.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf_mcore.models.hf_config import ModelShape
from rlhf_mcore.models.rope import rope_inv_freq

from .attention import PackedLayout, decode_attention_torch, prefill_attention
from .kv_cache import KVCache
from .moe import moe_mlp
from .rope import apply_rope, rope_tables
from .weights import LayerWeights, ModelWeights

# Decode batches up to this many rows run gate_up with silu*mul in the GEMM's epilogue (Triton); larger ones use
# cuBLAS and a separate silu*mul kernel, which measured faster at 256 rows (launch/bench/profile_decode.py).
FUSED_SILU_MAX_ROWS = 64
# Above this many rows o_proj and down_proj run on cuBLAS (their bf16 output summed by the add+norm) instead of the
# Triton K-split GEMMs, whose tiles were chosen at 64-256 rows: at 512 rows (TRL's GRPO decode) cuBLAS took o_proj +
# its add+norm 7.4 -> 6.4 us and down 17.0 -> 12.6 us, and the decode step 2.35 -> 2.22 ms on an H100; at 256 rows
# the two are level (launch/bench/tune_decode_gemms.py, BENCHMARKS.md session 30). FP8 weights stay on Triton.
TRITON_OUT_PROJ_MAX_ROWS = 256
# The Triton decode GEMMs (and the QKV kernel's fused projection) take weights of at most this many elements (one TP
# rank's); larger ones stream faster through cuBLAS -- the QKV projection then feeds `rope_cache`. On an H100 at the
# 7B shape (o_proj 12.8M, QKV 16.5M, down 67.9M elements), 64 / 256 rows: o_proj + add+norm 12.4 / 26.0 -> 10.1 /
# 17.3 us, down + add+norm 57.5 / 115.5 -> 56.4 / 69.5 us, the QKV projection 9.5 / 14.6 us against the fused
# kernel's 18.3 / 38.8 (BENCHMARKS.md session 34); at one TP=2 rank's shares of it (o_proj 6.4M, QKV 8.3M) o_proj
# 8.3 / 16.8 -> 7.6 / 10.9 us on cuBLAS, and the QKV projection alone 7.8 / 11.4 us against the fused kernel's
# 17.7 / 17.5 (session 35), hence 6M, not 8M. At 0.5B (<= 4.4M) and 1.5B's attention (<= 3.2M) the Triton GEMMs win
# (launch/bench/tune_decode_gemms.py). FP8 weights (w8a16) stay on Triton.
TRITON_GEMM_MAX_WEIGHT = 6 << 20
# FP8 rollout ("w8a8", per-channel scales): whether a fused decode step runs its FP8 linears as Triton GEMMs on FP8 x
# FP8 products (each activation quantized per row -- by the add+norm before gate_up and from gate_up's epilogue
# maxima since session 36, `_fp8_rows` --, K splits summed by the next add+norm, silu*mul in gate_up's epilogue)
# instead of cuBLAS's FP8 GEMM. The same quantization and fp32 sums. Timed alone at the 7B shape
# on an H100 (tune_decode_gemms.py), quantization included: down + add+norm 62.4 -> 40.8 us at 64 rows and 62.7 ->
# 59.2 at 256, gate_up + silu 67.2 -> 55.7 and 86.8 -> 84.1; end to end, 7B rollout tokens/s against cuBLAS's FP8
# GEMMs 9,023 -> 10,293 at batch 64 and level at 256 (BENCHMARKS.md session 35). False: cuBLAS (bench_fp8.py's
# `fp8_channel_cublas` variant).
FP8_TRITON_DECODE = True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and scaled in x's dtype (as transformers does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class NativeModel:
    """Forward passes over `ModelWeights` (one TP rank's shard)."""

    def __init__(self, spec: ModelShape, weights: ModelWeights, max_len: int, tp_group=None, fused: bool = False):
        self.spec, self.w = spec, weights
        self.tp_group = tp_group
        self.tp_size = weights.tp_size
        self.heads, self.kv_heads, self.hd = weights.heads, weights.kv_heads, spec.head_dim
        self.q_size, self.kv_size = self.heads * self.hd, self.kv_heads * self.hd
        self.sm_scale = spec.head_dim ** -0.5
        self.fused = fused
        # FP8 linear weights (fp8.Fp8Layers.layers: per layer, name -> Fp8Weight) set by an engine with
        # quantization="fp8"; their GEMMs run through cuBLAS FP8 with activations quantized per token ("w8a8"; in a
        # fused decode step with per-channel scales, the Triton decode GEMMs on FP8 x FP8 products instead:
        # FP8_TRITON_DECODE), or in a fused decode step through the Triton decode GEMMs reading the FP8 weights
        # ("w8a16": activations not quantized; per-channel scales only; prefill stays w8a8)
        self.fp8: list[dict] | None = None
        self.fp8_decode = "w8a8"
        self.cos, self.sin = rope_tables(rope_inv_freq(spec), max_len, weights.device, weights.dtype)  # (L, hd)
        self.routing: list | None = None  # a list: each MoE layer's expert ids (N, k) of a forward are appended

    # ------------------------------------------------------------------------------------ element-wise ops
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def _add_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                  quantize: torch.dtype | None = None):
        """(residual + delta, rms_norm(residual + delta) * weight); delta None: just the norm. quantize (fused only):
        the normed rows as per-row FP8 codes (`Fp8Rows`), for an FP8 GEMM that takes them (`_fp8_rows`)."""
        if self.fused:
            from .triton_kernels import add_rms_norm

            return add_rms_norm(residual, delta, weight, self.spec.rms_norm_eps, quantize)
        if delta is not None:
            residual = residual + delta
        return residual, rms_norm(residual, weight, self.spec.rms_norm_eps)

    def _linear(self, i: int, name: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
        """x @ w.T (+ bias) for layer i's linear `name`: its FP8 copy when the engine quantized it, else w."""
        q = self.fp8[i].get(name) if self.fp8 is not None else None
        if q is None:
            return F.linear(x, w, bias)
        from rlhf_mcore.kernels.fp8 import fp8_linear

        return fp8_linear(x, q, bias)

    def _fp8_rows(self, i: int, name: str, triton_gemms: bool) -> torch.dtype | None:
        """The FP8 dtype in which the kernel producing layer i's `name` input should write it, quantized per row
        (`Fp8Rows`: the add+norm before gate_up, the prefill's silu*mul before down), or None. A fused model whose
        `name` has a per-channel FP8 copy multiplied on FP8 x FP8 products (cuBLAS's w8a8, or the Triton decode
        GEMMs under "w8a8"): the quantization `fp8_linear` / `_decode_input` would run, one kernel earlier."""
        q = self.fp8[i].get(name) if self.fused and self.fp8 is not None else None
        if q is None or q.layout != "channel" or triton_gemms and self.fp8_decode != "w8a8":
            return None
        return q.q.dtype

    def _decode_weight(self, i: int, name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight a Triton decode GEMM reads for layer i's `name`: w, or its FP8 codes and per-channel scales
        ("w8a16", and "w8a8" under `FP8_TRITON_DECODE`)."""
        q = self.fp8[i].get(name) if self.fp8 is not None else None
        return (w, None) if q is None else (q.q, q.scale)

    def _decode_input(self, x: torch.Tensor, w_scale: torch.Tensor | None) -> dict:
        """The activation arguments of a Triton decode GEMM: x as it is, or under "w8a8" (an FP8 weight,
        `FP8_TRITON_DECODE`) its FP8 codes with one scale per row, as cuBLAS's FP8 GEMM would take it (x's own, when
        its producer quantized it: `Fp8Rows`)."""
        from rlhf_mcore.kernels.fp8 import Fp8Rows

        if isinstance(x, Fp8Rows):
            return {"x": x.q, "x_scale": x.scale, "out_dtype": x.dtype}
        if w_scale is None or self.fp8_decode != "w8a8":
            return {"x": x}
        from rlhf_mcore.kernels.fp8 import quantize_rows

        xq, xs = quantize_rows(x)
        return {"x": xq, "x_scale": xs, "out_dtype": x.dtype}

    def _mlp_act(self, h: torch.Tensor, gate_up: torch.Tensor, triton_gemms: bool, i: int = 0) -> torch.Tensor:
        """silu(h @ gate.T) * (h @ up.T) (N, I / tp) for gate_up = [gate; up]. FP8 weights in a Triton decode
        step always take the fused kernel (cuBLAS has no weight-only FP8 GEMM)."""
        if triton_gemms:
            w, scale = self._decode_weight(i, "gate_up", gate_up)
            if scale is not None or h.shape[0] <= FUSED_SILU_MAX_ROWS:
                from .triton_kernels import linear

                return linear(w=w, silu_mul=True, w_scale=scale, quantize=self._fp8_rows(i, "down", triton_gemms),
                              **self._decode_input(h, scale))
        gu = self._linear(i, "gate_up", h, gate_up)
        if self.fused:
            from .triton_kernels import silu_mul

            return silu_mul(gu, self._fp8_rows(i, "down", triton_gemms))
        inter = gu.shape[-1] // 2
        return F.silu(gu[:, :inter]) * gu[:, inter:]

    def _out_proj(self, x: torch.Tensor, w: torch.Tensor, triton_gemms: bool, i: int = 0, name: str = "o_proj"
                  ) -> torch.Tensor:
        """x @ w.T for o_proj / down_proj, summed over TP ranks; the Triton GEMM may return K-split fp32
        partials (S, N, D) for the following add+norm to sum (only without TP: the all-reduce wants the sum).
        Above `TRITON_OUT_PROJ_MAX_ROWS` rows or `TRITON_GEMM_MAX_WEIGHT` elements a bf16 weight goes to cuBLAS."""
        wd, scale = self._decode_weight(i, name, w) if triton_gemms else (w, None)
        if not triton_gemms or (scale is None and (x.shape[0] > TRITON_OUT_PROJ_MAX_ROWS
                                                   or w.numel() > TRITON_GEMM_MAX_WEIGHT)):
            return self._all_reduce(self._linear(i, name, x, w))
        from .triton_kernels import linear

        return self._all_reduce(linear(w=wd, allow_split=self.tp_size == 1, w_scale=scale,
                                       **self._decode_input(x, scale)))

    def _split_rope(self, qkv: torch.Tensor, positions: torch.Tensor, lw: LayerWeights):
        """Torch path: split qkv (N, ...) into rotated q (N, Hq, hd), rotated k and v (N, Hkv, hd)."""
        n, hd, eps = qkv.shape[0], self.hd, self.spec.rms_norm_eps
        cos, sin = self.cos[positions], self.sin[positions]  # (N, hd)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.kv_heads, hd)
        if self.spec.qk_norm:
            q = rms_norm(qkv[:, :self.q_size].view(n, self.heads, hd), lw.q_norm, eps)
            k = rms_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(n, self.kv_heads, hd), lw.k_norm, eps)
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
        # rotate q and k heads together: one set of kernels instead of two
        qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(n, self.heads + self.kv_heads, hd), cos, sin)
        return qk[:, :self.heads], qk[:, self.heads:], v

    # ------------------------------------------------------------------------------------------- layers
    def _layers(self, x: torch.Tensor, attend, triton_gemms: bool = False) -> torch.Tensor:
        """Run all decoder layers on embeddings x (N, D); `attend(layer_index, h)` projects the normed hidden
        states h (N, D) to q, k, v and does rope, the cache write and attention, returning (N, Hq * hd).
        triton_gemms: o, gate_up and down as Triton GEMMs (decode). Returns the final-normed hidden states (N, D)."""
        layers = self.w.layers
        triton_gemms = triton_gemms and (self.fp8 is None or self.fp8_decode == "w8a16" or FP8_TRITON_DECODE
                                         and all(q.layout == "channel" for q in self.fp8[0].values()))
        residual, h = self._add_norm(x, None, layers[0].input_norm)
        for i, lw in enumerate(layers):
            attn = attend(i, h)  # (N, Hq hd)
            o = self._out_proj(attn, lw.o_proj, triton_gemms, i, "o_proj")
            residual, h = self._add_norm(residual, o, lw.post_norm,
                                         self._fp8_rows(i, "gate_up", triton_gemms) if lw.router is None else None)
            if lw.router is not None:  # a MoE layer: routed (and shared) experts, one all-reduce
                down, ids = moe_mlp(h, lw, self.spec)
                down = self._all_reduce(down)
                if self.routing is not None:
                    self.routing.append(ids)
            else:
                act = self._mlp_act(h, lw.gate_up, triton_gemms, i)  # (N, I / tp)
                down = self._out_proj(act, lw.down, triton_gemms, i, "down")
            next_norm = layers[i + 1].input_norm if i + 1 < len(layers) else self.w.final_norm
            residual, h = self._add_norm(residual, down, next_norm)
        return h

    # ---------------------------------------------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor, layout: PackedLayout, cache: KVCache, write_token: torch.Tensor,
                write_slot: torch.Tensor, write_pos: torch.Tensor, attention: str = "torch") -> torch.Tensor:
        """Prefill packed new tokens of several sequences. tokens (N,), at positions `layout.positions`; the
        cache rows (write_slot[j], write_pos[j]) receive the key and value of token write_token[j] (a fresh
        prompt's tokens go to every slot of its samples). Sequences after a cached prefix (layout offsets) attend
        to their slot's cached keys too, through `attention` ("torch" | "triton"). Returns logits (P, V) at each
        sequence's last token."""
        positions = layout.positions

        def attend(i, h):
            lw = self.w.layers[i]
            qkv = self._linear(i, "qkv", h, lw.qkv, lw.qkv_bias)  # (N, (Hq + 2 Hkv) hd)
            if self.fused:  # one kernel; q, k, v come out contiguous, as attention and the cache write take them
                from .triton_kernels import kv_write, rope_qkv

                q, k, v = rope_qkv(qkv, positions, self.cos, self.sin, self.heads, self.kv_heads, lw.q_norm,
                                   lw.k_norm, self.spec.rms_norm_eps)
                kv_write(k, v, write_token, write_slot, write_pos, **cache.layer(i))
            else:
                q, k, v = self._split_rope(qkv, positions, lw)
                cache.put(i, (write_slot, write_pos), k.index_select(0, write_token), v.index_select(0, write_token))
            return prefill_attention(q, k, v, layout, self.sm_scale, attention=attention, **cache.layer(i)).reshape(
                qkv.shape[0], self.q_size)

        h = self._layers(F.embedding(tokens, self.w.embed), attend)  # (N, D)
        return F.linear(h.index_select(0, layout.last_token), self.w.lm_head)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache,
               attention: str, attn_len: int = 0, num_splits: int = 1,
               shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One decode step. tokens, positions, slots (B,); returns logits (B, V).

        attention: "triton" (flash-decoding kernel, reads each sequence's own length) or "torch" (reads cache
        positions [0, attn_len) for every row; attn_len >= max(positions) + 1). `shared` (src, lens) (B,): row b's
        first lens[b] keys/values are read from slot src[b], which holds the same ones (`decode_attention`; the torch
        path reads the row's own copy).
        """
        seq_lens = positions + 1
        b = tokens.shape[0]

        def attend(i, h):
            lw = self.w.layers[i]
            scales = {"k_scale": cache.k_scale[i], "v_scale": cache.v_scale[i]} if cache.fp8 else {}
            qkv_fp8 = self.fp8 is not None and "qkv" in self.fp8[i]
            if self.fused and not qkv_fp8 and lw.qkv.numel() > TRITON_GEMM_MAX_WEIGHT:
                from .triton_kernels import rope_cache  # a large weight: cuBLAS's projection, then the epilogue

                q = rope_cache(F.linear(h, lw.qkv, lw.qkv_bias), positions, slots, self.cos, self.sin, cache.k[i],
                               cache.v[i], self.heads, self.kv_heads, lw.q_norm, lw.k_norm, self.spec.rms_norm_eps,
                               **scales)
            elif self.fused and (not qkv_fp8 or self.fp8_decode == "w8a16"):
                from .triton_kernels import qkv_rope_cache

                w, scale = self._decode_weight(i, "qkv", lw.qkv)
                q = qkv_rope_cache(h, w, lw.qkv_bias, positions, slots, self.cos, self.sin, cache.k[i],
                                   cache.v[i], self.heads, self.kv_heads, lw.q_norm, lw.k_norm, self.spec.rms_norm_eps,
                                   w_scale=scale, **scales)
            else:
                q, k, v = self._split_rope(self._linear(i, "qkv", h, lw.qkv, lw.qkv_bias), positions, lw)
                cache.put(i, (slots, positions), k, v)
            if attention == "triton":
                from .triton_kernels import decode_attention

                out = decode_attention(q, slots=slots, seq_lens=seq_lens, sm_scale=self.sm_scale,
                                       num_splits=num_splits, shared=shared, **cache.layer(i))
            else:
                out = decode_attention_torch(q, slots=slots, seq_lens=seq_lens, sm_scale=self.sm_scale,
                                             max_len=attn_len, **cache.layer(i))
            return out.reshape(b, self.q_size)

        h = self._layers(F.embedding(tokens, self.w.embed), attend, triton_gemms=self.fused)
        return F.linear(h, self.w.lm_head)
