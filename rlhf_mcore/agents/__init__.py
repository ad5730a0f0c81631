"""Multi-turn rollouts: agent loops with tools and environments, token-exact trajectories, a scheduler that keeps
the engine busy while tools run.

- :mod:`.trajectory` — `TrajectoryBuilder` / `Trajectory` (ids, response_mask, log-probs, turns);
- :mod:`.agent_loop` — what loops are written against (`AgentLoop`, `AgentContext`, `MultiTurnSettings`) and
  their registry (`register_agent`);
- :mod:`.loops` — the built-in loops `single_turn_agent`, `tool_agent`, `env_agent`;
- :mod:`.tools` — `Tool`, `register_tool`, the YAML tool config; built-ins :mod:`.calculator`, :mod:`.sandbox`;
- :mod:`.hermes` — `<tool_call>` parsing;
- :mod:`.environments` — `Environment`, `register_environment`;
- :mod:`.runner` — `AgentRunner` (the scheduler);
- :mod:`.rollout` — the trainer's side: config -> runner, trajectories -> rows, metrics;
- :mod:`.tasks` — the synthetic tool task and GSM8K with the calculator.

The built-in loops and tools register themselves here, on import of the package (the registries know none of them).
"""
from rlhf_mcore.agents import calculator, loops, sandbox  # noqa: F401 - the built-in tools and loops registered
from rlhf_mcore.agents.agent_loop import AgentLoop, MultiTurnSettings, get_agent, list_agents, register_agent
from rlhf_mcore.agents.environments import Environment, list_environments, make_environment, register_environment
from rlhf_mcore.agents.hermes import CallError, ToolCall, parse_tool_calls
from rlhf_mcore.agents.runner import AgentError, AgentRunner
from rlhf_mcore.agents.tools import (
           Tool,
           ToolConfigError,
           build_tools,
           get_tool,
           list_tools,
           load_tool_config,
           register_tool,
)
from rlhf_mcore.agents.trajectory import TemplateError, Trajectory, TrajectoryBuilder

__all__ = ["AgentError", "AgentLoop", "AgentRunner", "CallError", "Environment", "MultiTurnSettings", "TemplateError",
           "Tool", "ToolCall", "ToolConfigError", "Trajectory", "TrajectoryBuilder", "build_tools", "get_agent",
           "get_tool", "list_agents", "list_environments", "list_tools", "load_tool_config", "make_environment",
           "parse_tool_calls", "register_agent", "register_environment", "register_tool"]
