"""The trainer's side of multi-turn rollouts: the runner from the config, trajectories as the trainer's rows, and
the step's agent metrics."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from rlhf_mcore.agents.agent_loop import MultiTurnSettings
from rlhf_mcore.agents.runner import AgentRunner
from rlhf_mcore.agents.tools import load_tool_config

__all__ = ["settings_from_config", "tools_from_config", "build_agent_runner", "trajectory_info", "agent_metrics",
           "run_scoring_as_they_finish"]


def settings_from_config(mt) -> MultiTurnSettings:
    """`actor_rollout_ref.rollout.multi_turn` -> the runner's settings."""
    return MultiTurnSettings(max_assistant_turns=mt.max_assistant_turns, max_user_turns=mt.max_user_turns,
                             max_tokens_per_turn=mt.max_tokens_per_turn, tool_timeout_s=mt.tool_timeout_s,
                             max_parallel_calls=mt.max_parallel_calls, tool_workers=mt.tool_workers,
                             default_agent=mt.default_agent)


def tools_from_config(mt) -> dict:
    return load_tool_config(mt.tool_config_path) if mt.tool_config_path else {}


def tool_schemas(cfg) -> Optional[list[dict]]:
    """The chat template's `tools` for prompts of a multi-turn run (None without tools or multi-turn)."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable or not mt.tool_config_path:
        return None
    return [t.schema() for t in tools_from_config(mt).values()] or None


def build_agent_runner(cfg, engine, tokenizer) -> Optional[AgentRunner]:
    """The run's agent runner, or None when `multi_turn.enable` is false."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return None
    from rlhf_mcore.agents.agent_loop import get_agent

    get_agent(mt.default_agent)  # an unknown name fails at start, with the known ones
    return AgentRunner(engine, tokenizer, settings_from_config(mt), tools_from_config(mt))


def run_scoring_as_they_finish(runner: AgentRunner, prompt_ids: Sequence[list[int]], rows: Sequence[dict],
                               params, keys: Sequence[int], stream, tokenizer) -> list[list[Any]]:
    """`runner.run(...)`, each trajectory handed to `stream` (a :class:`rlhf_mcore.rewards.stream.ScoringStream`,
    or None: no scoring) as it finishes, while the other agent loops go on: keyed `(keys[i], j)` for sample j of
    row i, scored as `tokenizer.decode(response_ids, skip_special_tokens=True)` (tool messages included) against
    the row's `data_source` / `ground_truth` / `extra_info`, as scoring after the rollout does."""
    n, row_of = params.n, {k: i for i, k in enumerate(keys)}

    def submit(key: int, t) -> None:
        row = rows[row_of[key // n]]
        stream.submit([(key // n, key % n)], [row["data_source"]],
                      [tokenizer.decode(t.response_ids, skip_special_tokens=True)], [row["ground_truth"]],
                      [row.get("extra_info")])

    return runner.run(prompt_ids, rows, params, keys=keys, on_trajectory=submit if stream is not None else None)


def trajectory_info(t) -> dict[str, Any]:
    """What the metrics need of one trajectory (travels with its row between ranks)."""
    return {**t.stats, "finish_reason": t.finish_reason, "reward": t.reward, "turn_rewards": list(t.turn_rewards),
            "model_tokens": float(sum(t.response_mask)), "message_tokens": float(len(t.response_mask)
                                                                                  - sum(t.response_mask))}


def agent_metrics(infos: Sequence[dict], runner_stats: Optional[dict] = None) -> dict[str, float]:
    """`agent/*`: turns and tool calls per trajectory (mean / max), model and message tokens per trajectory
    (mean), tool error counts by kind, tool seconds, trajectories stopped by the turn or the length limit, template
    drift, the engine's busy fraction, (streaming engines) the prompt tokens it prefilled and those it reused
    from a trajectory's kept KV cache, and (fully_async) the model turns paused at a weight sync."""
    infos = [i for i in infos if i]
    if not infos:
        return {}
    n = float(len(infos))
    out: dict[str, float] = {}
    for key in ("turns", "tool_calls"):
        vals = [i.get(key, 0.0) for i in infos]
        out[f"agent/{key}/mean"] = sum(vals) / n
        out[f"agent/{key}/max"] = max(vals)
    for key in ("tool_errors", "tool_timeouts", "tool_exceptions", "tool_malformed", "tool_unknown", "tool_rejected",
                "tool_seconds", "template_drift", "template_fallbacks"):
        out[f"agent/{key}"] = sum(i.get(key, 0.0) for i in infos)
    if any("paused_turns" in i for i in infos):  # fully_async: model turns paused at a weight sync, continued
        out["agent/paused_turns"] = sum(i.get("paused_turns", 0.0) for i in infos)
    out["agent/stopped_by_turns"] = float(sum(i["finish_reason"] == "turns" for i in infos))
    out["agent/stopped_by_length"] = float(sum(i["finish_reason"] == "length" for i in infos))
    out["agent/model_tokens/mean"] = sum(i["model_tokens"] for i in infos) / n
    out["agent/message_tokens/mean"] = sum(i["message_tokens"] for i in infos) / n
    if runner_stats and runner_stats.get("wall_s"):
        out["agent/engine_busy_fraction"] = runner_stats["engine_busy_s"] / runner_stats["wall_s"]
    for key in ("prefill_tokens", "kv_reused_tokens"):  # prompt tokens prefilled / found in a kept KV cache
        if runner_stats and key in runner_stats:
            out[f"agent/{key}"] = float(runner_stats[key])
    return out
