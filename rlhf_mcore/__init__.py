"""rlhf_mcore: a Megatron-Core based RL post-training trainer for LLMs (PPO/GRPO)."""
from rlhf_mcore import lazy_compile as _lazy_compile

_lazy_compile.install()  # before anything imports megatron-core: its fused functions compile on first call
