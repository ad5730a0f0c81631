"""What an agent loop is written against, and the registry of loops by name.

- :class:`MultiTurnSettings` — `actor_rollout_ref.rollout.multi_turn.*` as the loops and the runner read it;
- :class:`AgentContext` — what a loop reaches through `self.ctx`: the tokenizer, the tools, the settings and the two
  waits (a model turn, a turn's tool calls); the scheduler (:mod:`.runner`) implements it;
- :class:`AgentLoop` — the base of loops; `register_agent`, `get_agent`, `list_agents` — the registry.

The built-in loops live in :mod:`.loops` and register themselves when the package `rlhf_mcore.agents` is imported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

from rlhf_mcore.agents.tools import Tool
from rlhf_mcore.agents.trajectory import TrajectoryBuilder
from rlhf_mcore.registry import Registry

__all__ = ["MultiTurnSettings", "AgentContext", "AgentLoop", "register_agent", "get_agent", "list_agents"]


@dataclass
class MultiTurnSettings:
    """`actor_rollout_ref.rollout.multi_turn.*` as the loops and the runner read it."""

    max_assistant_turns: int = 5
    max_user_turns: int = 5
    max_tokens_per_turn: Optional[int] = None  # None: whatever is left of the response budget
    tool_timeout_s: float = 30.0
    max_parallel_calls: int = 4  # per model turn; further calls get an error message
    tool_workers: int = 16
    default_agent: str = "single_turn_agent"
    check_drift: bool = True


class AgentContext(Protocol):
    """What agent loops reach through `self.ctx`: the tokenizer, the tools, the settings and the two waits."""

    tokenizer: Any
    tools: dict[str, Tool]
    settings: MultiTurnSettings

    async def generate(self, traj: TrajectoryBuilder) -> Optional[str]:
        """One model turn from the trajectory's context, appended; its text, or None when no budget is left."""

    async def call_tools(self, traj: TrajectoryBuilder, calls: list) -> list[dict]:
        """Run a turn's parsed calls concurrently; one `tool` message per call (errors included)."""


class AgentLoop:
    """Base of agent loops: `run` fills the trajectory; `generate` and `call_tools` are the engine and the tools."""

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.settings = ctx.settings

    async def run(self, row: dict[str, Any], traj: TrajectoryBuilder) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    async def generate(self, traj: TrajectoryBuilder) -> Optional[str]:
        """One model turn from the trajectory's context, appended; its text, or None when no budget is left."""
        return await self.ctx.generate(traj)

    async def call_tools(self, traj: TrajectoryBuilder, calls: list) -> list[dict]:
        """Run a turn's parsed calls concurrently; one `tool` message per call (errors included)."""
        return await self.ctx.call_tools(traj, calls)


_AGENTS: Registry[type] = Registry(
    "agent loop", "Register one with @rlhf_mcore.agents.register_agent(name) in a trainer.plugins file.")


def register_agent(name: str, *, override: bool = False):
    def decorator(cls):
        if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
            raise TypeError(f"@register_agent({name!r}): {cls!r} must subclass rlhf_mcore.agents.AgentLoop")
        _AGENTS.add(name, cls, override=override)
        return cls

    return decorator


def get_agent(name: str) -> type:
    return _AGENTS.get(name, key="agent_name")


def list_agents() -> list[str]:
    return _AGENTS.names()
