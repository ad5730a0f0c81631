"""The whole run configuration: one dataclass per YAML section, in the order the YAML writes them."""
from __future__ import annotations

from dataclasses import dataclass, field

from rlhf_mcore.config.actor_rollout_ref import ActorRolloutRefConfig
from rlhf_mcore.config.algorithm import AlgorithmConfig
from rlhf_mcore.config.critic import CriticConfig
from rlhf_mcore.config.data import DataConfig
from rlhf_mcore.config.reward import RewardConfig
from rlhf_mcore.config.trainer import AsyncTrainingConfig, RolloutPoolConfig, TrainerConfig
from rlhf_mcore.config.vla import VLAConfig


@dataclass
class RLConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    vla: VLAConfig = field(default_factory=VLAConfig)  # vla.enable: the VLA trainer (rlhf_mcore/trainer/vla.py)
