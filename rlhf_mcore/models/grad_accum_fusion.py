"""Megatron's gradient-accumulation fusion without APEX (`override_transformer_config.gradient_accumulation_fusion`).

Megatron's linear layers compute each weight's gradient as one GEMM per micro-batch. Without the fusion the GEMM
writes a bf16 gradient, and the DDP hook then adds it into the parameter's fp32 `main_grad` (one more kernel per
parameter per micro-batch, reading both). With it, the GEMM accumulates into `main_grad` itself
(`main_grad += dy^T x`, fp32 accumulation, no bf16 rounding of the micro-batch's gradient): the call goes to APEX's
`fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`, which megatron-core imports if it is installed and refuses
the setting otherwise. :func:`install` gives megatron-core these two functions instead, on cuBLAS through torch:
`torch.addmm(main_grad, dy^T, x, out_dtype=float32, out=main_grad)` (bf16 operands, fp32 output accumulated in
place, CUDA; a torch whose `addmm` refuses that gets the bf16 product added instead, with a warning: `cuda_form`), and
on a CPU (tests) the same sum in `main_grad`'s dtype.

Where it does not apply (refused by the config checks): the decoder as CUDA graphs (the captured layers see
parameter aliases without `main_grad`) and LoRA (frozen base weights have no `main_grad`). The FP8 training linears
accumulate their own weight gradients (`kernels.fp8_wgrad`, through `models.fp8_training`).
"""
from __future__ import annotations

import types
import warnings

import torch

__all__ = ["cuda_form", "install", "wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16"]


# How this torch accumulates a bf16 GEMM into an fp32 tensor on CUDA, found by `cuda_form()` on the first call:
# "addmm_out_dtype" (cuBLAS, beta = 1, in place) or, where torch's `addmm.dtype_out` refuses an fp32 `self` with bf16
# operands (its checks changed between releases), "product_add" (the bf16 product, then the add: no gain over the
# unfused path, but the same sum)
_CUDA_FORM: str | None = None


def cuda_form(device: torch.device) -> str:
    """The form `wgrad_gemm_accum_fp32` uses on CUDA (probed once with a 16 x 16 call)."""
    global _CUDA_FORM
    if _CUDA_FORM is None:
        acc = torch.zeros(16, 16, device=device)
        a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
        try:
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _CUDA_FORM = "addmm_out_dtype" if bool((acc == 32).all()) else "product_add"
        except (RuntimeError, TypeError):
            _CUDA_FORM = "product_add"
        if _CUDA_FORM != "addmm_out_dtype":
            warnings.warn(f"gradient_accumulation_fusion: torch {torch.__version__} cannot accumulate a bf16 GEMM "
                          "into an fp32 tensor in place (addmm with out_dtype); each weight gradient is a bf16 product "
                          "added to main_grad, as without the fusion", stacklevel=2)
    return _CUDA_FORM


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (out, in) fp32 += grad_output (tokens, out)^T @ total_input (tokens, in), APEX's argument order."""
    dy_t = grad_output.t()
    if main_grad.is_cuda and dy_t.dtype != main_grad.dtype:
        if cuda_form(main_grad.device) == "addmm_out_dtype":
            # cuBLAS with beta = 1: reads main_grad, writes the sum back; no bf16 product tensor
            torch.addmm(main_grad, dy_t, total_input, out_dtype=main_grad.dtype, out=main_grad)
        else:
            main_grad.add_(dy_t @ total_input)
    else:
        main_grad.addmm_(dy_t.to(main_grad.dtype), total_input.to(main_grad.dtype))


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """The same for a bf16 / fp16 `main_grad` (Megatron's grad buffer in the parameters' dtype)."""
    main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


SHIM = types.SimpleNamespace(wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32,
                             wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16)


def install() -> bool:
    """Let megatron-core's linear layers take `gradient_accumulation_fusion=True` without APEX: its layers module
    then calls the functions above. APEX's own extension, when installed, is left in place. Idempotent; returns
    whether the functions here are the ones in use."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = SHIM
        layers._grad_accum_fusion_available = True
    return getattr(layers, "fused_weight_gradient_mlp_cuda", None) is SHIM
