"""The native rollout engine: plain-torch Qwen2/Llama/Qwen3 on HF-layout weights, slot KV cache, continuous
batching, Triton decode kernels and CUDA graphs on GPU. Entry point: `engine.NativeRolloutEngine`."""
