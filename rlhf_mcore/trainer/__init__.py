"""The trainer: rank-0 coordinator, the PPO/GRPO loop, validation, checkpoints and metrics."""


def train(cfg):
    """Run PPO/GRPO as configured (every rank calls this); returns the last step's reduced metrics."""
    from rlhf_mcore.trainer.rl_trainer import train as _train

    return _train(cfg)


__all__ = ["train"]
