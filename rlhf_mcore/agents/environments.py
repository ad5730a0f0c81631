"""Environments: multi-turn tasks without tools, gym-like.

    @register_environment("guess_number")
    class GuessNumber(Environment):
        def reset(self, row) -> str | None:        # an extra first user message, or None (the row's prompt)
            self.target = int(row["ground_truth"])
        def step(self, model_text) -> tuple[str, float, bool]:   # (next user message, reward, done)
            ...

A row runs in an environment when its `agent_name` is `env_agent`; `extra_info.env_name` picks the environment
and `extra_info.env_kwargs` (a mapping) are its constructor's keyword arguments. Each step's reward is kept per
turn (`Trajectory.turn_rewards`); the trajectory's reward is their sum, placed on its last model token.
"""
from __future__ import annotations

from typing import Any, Optional

from rlhf_mcore.registry import Registry

__all__ = ["Environment", "register_environment", "make_environment", "list_environments"]


class Environment:
    """One episode per instance; see the module docstring."""

    def reset(self, row: dict[str, Any]) -> Optional[str]:  # pragma: no cover - the interface
        raise NotImplementedError

    def step(self, model_text: str) -> tuple[str, float, bool]:  # pragma: no cover - the interface
        raise NotImplementedError


_ENVS: Registry[type] = Registry(
    "environment", "Register one with @rlhf_mcore.agents.register_environment(name) in a trainer.plugins file.")


def register_environment(name: str, *, override: bool = False):
    def decorator(cls):
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise TypeError(f"@register_environment({name!r}): {cls!r} must subclass rlhf_mcore.agents.Environment")
        _ENVS.add(name, cls, override=override)
        return cls

    return decorator


def make_environment(name: str, **kwargs: Any) -> Environment:
    return _ENVS.get(name, key="extra_info.env_name")(**kwargs)


def list_environments() -> list[str]:
    return _ENVS.names()
