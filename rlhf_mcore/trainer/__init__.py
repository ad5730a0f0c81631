"""The trainer: the run context, the learner, the rollout sides and one loop per mode (trainer/loops.py)."""


def __getattr__(name):  # RLTrainer and its hooks without importing torch/Megatron at package import
    if name in ("RLTrainer", "StepHooks", "PhaseTimer", "StepParts"):
        from rlhf_mcore.trainer import rl_trainer

        return getattr(rl_trainer, name)
    raise AttributeError(name)


def train(cfg, hooks=None):
    """Run PPO/GRPO as configured (every rank calls this); returns the last step's reduced metrics."""
    from rlhf_mcore.trainer.loops import train as _train

    return _train(cfg, hooks)


__all__ = ["train", "RLTrainer", "StepHooks", "PhaseTimer", "StepParts"]
