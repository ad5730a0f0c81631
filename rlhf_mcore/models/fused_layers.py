"""The train engine's fused layer kernels (`kernels/fused_layer.py`) plugged into Megatron's local layer.

- SwiGLU: Megatron's MLP calls a module activation on the whole gated projection when
  `use_te_activation_func` is set and the layer spec names `submodules.activation_func` (the hook Transformer
  Engine's activations use); the local spec gets :class:`FusedSwiGLU` there.
- RoPE: `rope.apply_rope_packed` rotates packed queries and keys with the fused kernel when the model's
  `TransformerConfig` carries `fused_rope_kernel = True` (set by `build_model`).

`build_model(fused_kernels=None)` turns both on for CUDA models on the "sdpa" backend when `triton` imports;
CPU models keep the eager path (the bit-exact references of tests/test_models.py).
"""
from __future__ import annotations

import importlib.util

import torch

__all__ = ["FusedSwiGLU", "fused_kernels_default"]


def fused_kernels_default(device: torch.device, backend: str) -> bool:
    """On for CUDA devices with the local ("sdpa") layer spec when `triton` is installed."""
    return device.type == "cuda" and backend == "sdpa" and importlib.util.find_spec("triton") is not None


class FusedSwiGLU(torch.nn.Module):
    """silu(x[..., :F]) * x[..., F:] in one Triton kernel each way (Megatron builds it with `config=`)."""

    def __init__(self, config=None):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from rlhf_mcore.kernels.fused_layer import swiglu

        return swiglu(x)
