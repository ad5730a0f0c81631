"""The run configuration: a dataclass schema, loaded from YAML plus ``key=value`` overrides through OmegaConf.

Key names follow veRL's where they fit, so a veRL command line translates one to one::

    data.train_batch_size=256 actor_rollout_ref.actor.ppo_mini_batch_size=64 algorithm.kl_ctrl.kl_coef=0.001

Every mistake a user can make in a config ends in a :class:`ConfigError` whose message names the key, the
value and the fix; ``launch/train.py`` prints it without a traceback and exits non-zero.

Sizes follow veRL's conventions: ``data.train_batch_size`` and ``ppo_mini_batch_size`` count *prompts*
(each brings ``rollout.n`` responses); ``*_micro_batch_size_per_gpu`` counts *sequences* per data-parallel rank.

The package mirrors the YAML: one module per section (:mod:`.data`, :mod:`.actor_rollout_ref`, :mod:`.critic`,
:mod:`.reward`, :mod:`.algorithm`, :mod:`.trainer` with `async_training` and the rollout pool; :mod:`.shared` for
the sections several roles nest), :mod:`.loader` (YAML + overrides), :mod:`.checks` (single-key rules, applied
wherever their dataclass is nested), :mod:`.cross` (every rule relating keys, the world size or a registry),
:mod:`.unused` (the notice for keys the setup never reads), :mod:`.plugins` and :mod:`.hf` (config.json facts).
Loading a config imports no component: nothing here imports torch or an engine at module level.
"""
from rlhf_mcore.config.actor_rollout_ref import (
    ActorConfig,
    ActorRolloutRefConfig,
    ModelConfig,
    MultiTurnConfig,
    RefConfig,
    RolloutConfig,
    SamplingKwargs,
)
from rlhf_mcore.config.algorithm import (
    FILTER_METRICS,
    AlgorithmConfig,
    FilterGroupsConfig,
    KLControlConfig,
    RolloutCorrectionConfig,
)
from rlhf_mcore.config.critic import CriticConfig, CriticModelConfig
from rlhf_mcore.config.cross import (
    critic_enabled,
    expert_parallel_size,
    lora_enabled,
    moe_overrides,
    parallel_layout,
    pipeline_split,
    pool_sizes,
    prime_enabled,
    recompute_mode,
    reference_enabled,
    rollout_records_routes,
    validate_config,
)
from rlhf_mcore.config.data import DataConfig
from rlhf_mcore.config.errors import ConfigError
from rlhf_mcore.config.hf import model_max_positions, model_num_layers
from rlhf_mcore.config.loader import load_config, to_dict, to_yaml
from rlhf_mcore.config.plugins import load_plugins
from rlhf_mcore.config.reward import (
    CustomRewardFunctionConfig,
    JudgeConfig,
    OverlongBufferConfig,
    RewardConfig,
    RewardModelConfig,
    RewardModelModelConfig,
)
from rlhf_mcore.config.schema import RLConfig
from rlhf_mcore.config.shared import MegatronConfig, OptimConfig, OverrideTransformerConfig
from rlhf_mcore.config.trainer import AsyncTrainingConfig, RolloutPoolConfig, TrainerConfig

__all__ = [
    "RLConfig", "ConfigError", "load_config", "validate_config", "critic_enabled", "reference_enabled", "prime_enabled",
    "lora_enabled", "parallel_layout", "pipeline_split", "expert_parallel_size", "moe_overrides",
    "recompute_mode",
    "pool_sizes", "rollout_records_routes", "model_max_positions", "model_num_layers", "to_yaml",
    "to_dict", "load_plugins", "FILTER_METRICS",
    # the sections
    "DataConfig", "ActorRolloutRefConfig", "ModelConfig", "ActorConfig", "RolloutConfig", "SamplingKwargs",
    "MultiTurnConfig", "RefConfig", "CriticConfig", "CriticModelConfig", "RewardConfig", "CustomRewardFunctionConfig",
    "OverlongBufferConfig", "RewardModelConfig", "RewardModelModelConfig", "JudgeConfig", "AlgorithmConfig",
    "KLControlConfig", "RolloutCorrectionConfig", "FilterGroupsConfig", "TrainerConfig", "RolloutPoolConfig",
    "AsyncTrainingConfig", "OptimConfig", "MegatronConfig", "OverrideTransformerConfig",
]
