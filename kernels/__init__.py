"""GPU kernels (Triton) with their torch reference implementations; the package `rlhf_mcore.kernels`.

Each computation has a torch reference that runs anywhere and a Triton kernel with the same signature, used
on CUDA (or on CPU under ``TRITON_INTERPRET=1``, in tests). Nothing here imports the rest of `rlhf_mcore`:
the engine chooses between reference and kernel (`rlhf_mcore.engine.logprobs`).

    logprob_reference  vocab-parallel log-prob + entropy in chunks of rows (torch)
    fused_logprob      the same in one streaming pass per row (Triton)
    fused_layer        SwiGLU and packed RoPE, one kernel each way (Triton), with their eager references
    fp8                e4m3/e5m2 quantization (per channel, 128 x 128 blocks) and the cuBLAS FP8 GEMM, with the
                       dequantized fp32 reference
    fp8_linear         a linear whose forward and backward GEMMs run in FP8 (training, current scaling)
    grouped_mm         the MoE experts' grouped GEMM (`torch._grouped_mm` on CUDA bf16) and its per-expert loop
"""
