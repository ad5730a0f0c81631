"""The trainer: rank-0 coordinator, the PPO/GRPO loop, validation, checkpoints and metrics."""


def __getattr__(name):  # RLTrainer and its hooks without importing torch/Megatron at package import
    if name in ("RLTrainer", "StepHooks", "PhaseTimer"):
        from rlhf_mcore.trainer import rl_trainer

        return getattr(rl_trainer, name)
    raise AttributeError(name)


def train(cfg):
    """Run PPO/GRPO as configured (every rank calls this); returns the last step's reduced metrics."""
    from rlhf_mcore.trainer.rl_trainer import train as _train

    return _train(cfg)


__all__ = ["train", "RLTrainer", "StepHooks", "PhaseTimer"]
