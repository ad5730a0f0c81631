"""The train engine's fused layer kernels (`kernels/fused_layer.py`) plugged into Megatron's local layer.

- RMSNorm: the layer spec's `input_layernorm` and `pre_mlp_layernorm` are :class:`FusedRMSNorm`, a
  `torch.nn.RMSNorm` (the same `weight` parameter and checkpoint keys) whose CUDA forward and backward are one
  Triton kernel each: torch's backward runs a second pass over the input and the output gradient for the weight's
  gradient, ~60 us a call on 16k tokens of width 896 (session 30's GRPO profile: 441 calls a step).
- SwiGLU: Megatron's MLP calls a module activation on the whole gated projection when
  `use_te_activation_func` is set and the layer spec names `submodules.activation_func` (the hook Transformer
  Engine's activations use); the local spec gets :class:`FusedSwiGLU` there.
- RoPE: `rope.apply_rope_packed` rotates packed queries and keys with the fused kernel when the model's
  `TransformerConfig` carries `fused_rope_kernel = True` (set by `build_model`).

`build_model(fused_kernels=None)` turns all three on for CUDA models on the "sdpa" backend when `triton` imports;
CPU models keep the eager path (the bit-exact references of tests/test_models.py).
"""
from __future__ import annotations

import importlib.util

import torch

__all__ = ["FusedRMSNorm", "FusedSwiGLU", "fused_kernels_default"]


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


class FusedRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` over the last dimension whose CUDA (or interpreted) forward and backward are the fused
    kernels; built by Megatron like `WrappedTorchNorm` (`config=`, `hidden_size=`, `eps=`)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-5, **_unused):
        if config is not None and (config.sequence_parallel or config.layernorm_zero_centered_gamma
                                   or config.normalization != "RMSNorm"):
            raise ValueError("FusedRMSNorm is an RMSNorm without sequence parallelism or zero-centred gamma (the local "
                             "spec's torch norm refuses those too)")
        super().__init__(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from rlhf_mcore.kernels.fused_layer import rms_norm

        return rms_norm(x, self.weight, self.eps)
