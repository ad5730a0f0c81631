"""rlhf_mcore: a Megatron-Core based RL post-training trainer for LLMs (PPO/GRPO)."""
