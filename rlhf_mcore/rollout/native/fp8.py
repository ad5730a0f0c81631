"""FP8 rollout weights for the native engine (`actor_rollout_ref.rollout.quantization=fp8`).

The engine keeps its bf16 weights (what `update_weights` copies into, slice by slice) and an e4m3 copy of the
decoder's gate_up and down (LINEARS; every linear under fp8_decode="w8a16") with fp32 scales, per output channel
or per 128 x 128 block (`rlhf_mcore.kernels.fp8`). The copy is refreshed on the GPU once after each weight sync --
at its end (`finish_weight_update`, timed as `sync/fp8_quantize_seconds`), or else before the next generation (a
sync arrives in many `update_weights` buckets; quantizing once per sync, not per bucket) -- in place so captured
CUDA graphs stay valid. Embeddings, norms and the LM head stay bf16 (QKV and o_proj too under "w8a8"; the KV cache
unless the engine's kv_cache_dtype says otherwise); activations are quantized per token (channel) or per 1 x 128
slice (block) for cuBLAS's FP8 GEMM and, per token, for the Triton decode GEMMs on FP8 x FP8 products ("w8a8", the
decode step's default with channel scales), or not at all in the weight-only decode GEMMs ("w8a16").
"""

from __future__ import annotations

import logging
import time

import torch

from rlhf_mcore.kernels.fp8 import LAYOUTS, Fp8Weight, check_block_shape, check_fp8_device

from .weights import ModelWeights

log = logging.getLogger(__name__)

# Under cuBLAS's FP8 GEMM ("w8a8") the QKV projection stays bf16: about 7% of the decoder's linear weights at the
# Qwen2.5 shapes, and in bf16 the decode step keeps its fused QKV GEMM + RoPE + cache-write kernel (an FP8 QKV would
# add the torch RoPE path's kernels to every layer; BENCHMARKS.md, "FP8"). So does o_proj (5% of them): its FP8 GEMM
# with the activation's quantization never beat bf16 cuBLAS in a decode step (7B, H100: 16.8 against 10.1 us at 64
# rows, 17.6 against 17.0 at 256; BENCHMARKS.md session 34). The weight-only decode GEMMs ("w8a16") read FP8 codes
# in the fused kernels, so there every decoder linear is FP8 (LINEARS_W8A16).
LINEARS = ("gate_up", "down")
LINEARS_W8A16 = ("qkv", "o_proj") + LINEARS
KEY = "actor_rollout_ref.rollout.quantization"
# Per-output-channel scales (row-wise cuBLAS FP8 GEMM): chosen over 128 x 128 blocks by measurement (BENCHMARKS.md).
DEFAULT_LAYOUT = "channel"


class Fp8Layers:
    """The e4m3 copies of `weights`' decoder linears, per layer name -> Fp8Weight (`layers`)."""

    def __init__(self, weights: ModelWeights, layout: str = DEFAULT_LAYOUT, names: tuple[str, ...] = LINEARS):
        if layout not in LAYOUTS:
            raise ValueError(f"fp8_layout={layout!r}: choose one of {LAYOUTS}.")
        check_fp8_device(weights.device, KEY)
        self.layout = layout
        self.layers: list[dict[str, Fp8Weight]] = []
        for i, lw in enumerate(weights.layers):
            named = {n: getattr(lw, n, None) for n in names}
            if layout == "block":
                for n, w in named.items():
                    if w is not None:
                        check_block_shape(w.shape, f"layer {i} {n}", KEY)
            self.layers.append({n: Fp8Weight.empty_like(w, layout) for n, w in named.items() if w is not None})

    def quantize_(self, weights: ModelWeights) -> float:
        """Quantize the current bf16 weights into the copies; returns the seconds it took (GPU included)."""
        t0 = time.perf_counter()
        with torch.no_grad():
            for lw, q in zip(weights.layers, self.layers):
                for n, fw in q.items():
                    fw.update_(getattr(lw, n))
        if weights.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        seconds = time.perf_counter() - t0
        log.info("fp8 rollout: quantized %d layers (%s scales) in %.3f s", len(self.layers), self.layout, seconds)
        return seconds

    def nbytes(self) -> int:
        return sum(w.q.numel() + w.scale.numel() * 4 for q in self.layers for w in q.values())
