"""The `critic` section: the value model of GAE-based PPO (built only when the estimator needs it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlhf_mcore.config.checks import above, checked
from rlhf_mcore.config.shared import (
    GRAD_CLIP,
    LORA_ALPHA,
    LORA_RANK,
    LORA_TARGET_MODULES,
    Dtype,
    MegatronConfig,
    OptimConfig,
    Strategy,
)


@dataclass
class CriticModelConfig:
    path: Optional[str] = None  # None: the actor's model
    dtype: Dtype = "auto"
    enable_gradient_checkpointing: bool = False
    use_remove_padding: bool = True
    # as actor_rollout_ref.model.share_prompt_prefix, for the critic's value and update passes (PPO with rollout.n > 1)
    share_prompt_prefix: bool = False
    # LoRA of the value model's trunk, its head trained in full (0: full fine-tuning); veRL's keys
    lora_rank: int = checked(0, **LORA_RANK)
    lora_alpha: float = checked(16.0, **LORA_ALPHA)
    target_modules: Any = checked("all-linear", **LORA_TARGET_MODULES)
    lora_adapter_path: Optional[str] = None  # a PEFT adapter directory to start from (r, alpha, targets must match)


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # None: on exactly when algorithm.adv_estimator needs values (gae)
    strategy: Strategy = "megatron"
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: Optional[int] = None  # None: the actor's
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    # the value pass (forward-only, no activations kept) may take larger micro-batches than the update
    forward_micro_batch_size_per_gpu: Optional[int] = None  # None: ppo_micro_batch_size_per_gpu
    forward_max_token_len_per_gpu: Optional[int] = None  # None: ppo_max_token_len_per_gpu (use_dynamic_bsz)
    ppo_epochs: Optional[int] = None  # None: the actor's
    # the update's first mini-batch takes its own values as the old ones and the values pass leaves its rows out
    # (exact where the returns do not read the values: GAE with algorithm.lam=1; rlhf_mcore.trainer.learner)
    values_from_update: bool = True
    grad_clip: float = checked(1.0, **GRAD_CLIP)
    cliprange_value: float = checked(0.5, ok=above(0), what="> 0")
    loss_agg_mode: str = "token-mean"
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
