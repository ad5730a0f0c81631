"""The native engine's KV cache: one slot per running sequence, keys and values per layer, in the model's dtype or
in FP8 (e4m3 codes with one fp32 scale per token and head: `kv_cache_dtype="fp8_e4m3"`), which halves the bytes
a decode step's attention reads (BENCHMARKS.md, issue 36)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """Slot-based cache: k, v of shape (layers, slots, max_len, kv_heads, head_dim). In FP8 (`allocate(fp8=True)`,
    the engine's kv_cache_dtype="fp8_e4m3") k and v hold e4m3 codes and k_scale, v_scale (layers, slots, max_len,
    kv_heads) fp32 one scale per token and head: amax / 448 over the head's values (`quantize_kv`), so no
    calibration is needed and an outlier token costs only its own precision."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int, device, dtype,
                 fp8: bool = False):
        shape = (num_layers, slots, max_len, kv_heads, head_dim)
        if not fp8:
            return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
        from rlhf_mcore.kernels.fp8 import E4M3

        codes = [torch.zeros(shape, device=device, dtype=E4M3) for _ in range(2)]
        scales = [torch.ones(shape[:-1], device=device, dtype=torch.float32) for _ in range(2)]
        return cls(*codes, *scales)

    @property
    def fp8(self) -> bool:
        return self.k_scale is not None

    def layer(self, i: int) -> dict:
        """Layer i's tensors as the attention functions take them: k_cache, v_cache (and k_scale, v_scale in FP8)."""
        out = {"k_cache": self.k[i], "v_cache": self.v[i]}
        if self.fp8:
            out.update(k_scale=self.k_scale[i], v_scale=self.v_scale[i])
        return out

    def put(self, i: int, index: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write keys and values k, v (N, kv_heads, head_dim) of layer i at cache[index] ((slots, positions))."""
        if not self.fp8:
            self.k[i].index_put_(index, k)
            self.v[i].index_put_(index, v)
            return
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, scale = quantize_kv(x)
            codes[i].view(torch.uint8).index_put_(index, q.view(torch.uint8))  # byte views: any device's indexing
            scales[i].index_put_(index, scale)

    def nbytes(self) -> int:
        scales = 2 * self.k_scale.numel() * 4 if self.fp8 else 0
        return 2 * self.k.numel() * self.k.element_size() + scales


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys or values x (..., head_dim) -> e4m3 codes (..., head_dim) and fp32 scales (...,), one per head vector
    (`kernels.fp8.quantize_rows`' rule: amax / 448, 1 for a zero vector; the fused decode kernel's epilogue computes
    the same)."""
    from rlhf_mcore.kernels.fp8 import quantize_rows

    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return q.view(x.shape), scale.view(x.shape[:-1])


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., head_dim) * scale (...,) in `dtype` (the torch attention paths' view of an FP8 cache); a bf16
    cache (scale None) as it is."""
    if scale is None:
        return codes
    return (codes.float() * scale[..., None]).to(dtype)
