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

from rlhf_mcore.agents.agent_loop import AgentLoop, register_agent
from rlhf_mcore.agents.environments import make_environment
from rlhf_mcore.agents.hermes import parse_tool_calls

__all__ = ["SingleTurnAgent", "ToolAgent", "EnvAgent"]

FINISH_TURNS = "turns"


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
