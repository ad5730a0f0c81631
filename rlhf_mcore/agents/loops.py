"""Agent loops: how one dataset row becomes one trajectory. Chosen per row by its `agent_name` (veRL's column;
rows without one use `multi_turn.default_agent`).

Built in: `single_turn_agent` (one model turn), `tool_agent` (the model calls tools in Hermes format until it
answers without a call, or the turn / length limit), `env_agent` (turns with an :class:`Environment`). Add one::

    @register_agent("my_agent")
    class MyAgent(AgentLoop):
        async def run(self, row, traj):
            text = await self.generate(traj)         # one model turn, appended to traj (None: budget spent)
            if text is not None and not traj.done:
                traj.add_messages([{"role": "user", "content": "Are you sure?"}])
                await self.generate(traj)

`row` is the dataset item (`raw_prompt`, `data_source`, `ground_truth`, `extra_info`, `agent_name`); `traj` is a
:class:`~rlhf_mcore.agents.trajectory.TrajectoryBuilder`. Loops are coroutines: while one waits for the engine
or its tools, the others run.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from rlhf_mcore.agents.environments import make_environment
from rlhf_mcore.agents.hermes import parse_tool_calls
from rlhf_mcore.agents.trajectory import TrajectoryBuilder
from rlhf_mcore.registry import Registry

if TYPE_CHECKING:
    from rlhf_mcore.agents.runner import AgentContext

__all__ = ["AgentLoop", "register_agent", "get_agent", "list_agents", "SingleTurnAgent", "ToolAgent", "EnvAgent"]

FINISH_TURNS = "turns"


class AgentLoop:
    """Base of agent loops: `run` fills the trajectory; `generate` and `call_tools` are the engine and the tools."""

    def __init__(self, ctx: "AgentContext"):
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


@register_agent("single_turn_agent")
class SingleTurnAgent(AgentLoop):
    async def run(self, row, traj):
        await self.generate(traj)


@register_agent("tool_agent")
class ToolAgent(AgentLoop):
    async def run(self, row, traj):
        if not self.ctx.tools:
            raise ValueError("agent_name=tool_agent needs tools: set actor_rollout_ref.rollout.multi_turn."
                             "tool_config_path (e.g. configs/tools/calculator.yaml)")
        while True:
            text = await self.generate(traj)
            if text is None or traj.done:
                return
            calls = parse_tool_calls(text)
            if not calls:
                return  # an answer without a call ends the trajectory
            if traj.assistant_turns >= self.settings.max_assistant_turns:
                traj.stop(FINISH_TURNS)
                return
            if not traj.add_messages(await self.call_tools(traj, calls), role="tool"):
                return


@register_agent("env_agent")
class EnvAgent(AgentLoop):
    async def run(self, row, traj):
        extra = row.get("extra_info") or {}
        name = extra.get("env_name")
        if not name:
            raise ValueError(f"agent_name=env_agent needs extra_info.env_name (row extra_info: {extra!r:.200})")
        env = make_environment(name, **dict(extra.get("env_kwargs") or {}))
        first = env.reset(row)
        if first:
            traj.set_prompt(list(row["raw_prompt"]) + [{"role": "user", "content": first}])
        total = 0.0
        while True:
            text = await self.generate(traj)
            if text is None:
                break
            message, reward, done = env.step(text)
            traj.turn_rewards.append(float(reward))
            total += float(reward)
            if done or traj.done:
                break
            if traj.user_turns >= self.settings.max_user_turns or \
                    traj.assistant_turns >= self.settings.max_assistant_turns:
                traj.stop(FINISH_TURNS)
                break
            if not traj.add_messages([{"role": "user", "content": message}]):
                break
        traj.reward = total
