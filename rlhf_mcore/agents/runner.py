"""Runs many agent loops at once over one rollout engine: the scheduler.

Every trajectory is an asyncio task (its agent loop). A task waits for one of two things: a model turn, or its
tool calls. The scheduler lets every runnable task go on until it waits, then:

- with a streaming engine (`engine.supports_streaming`, the native engine): submits the waiting turns and runs
  one engine step (admission + one decode step for everything running), handing finished turns back to their
  tasks; so a trajectory's next turn joins the batch as soon as its tools return, while the others keep
  decoding (continuous batching across trajectories);
- otherwise: generates all waiting turns with one `engine.generate` call per distinct turn budget.

Tool calls run on a pool of daemon threads while the engine steps; each call has a deadline (a call past it
gets a timeout message and its thread is abandoned and replaced). The engine only idles when every unfinished
trajectory waits for a tool; `engine_busy_s / wall_s` (the busy fraction) is reported.

Random streams: turn t of trajectory k is request `k * 256 + t` (sample 0) under the step's seed, so results do
not depend on timing, batching or which trajectories run together.

KV reuse (streaming engines): every turn of trajectory k is submitted with `session=k`, so the engine can keep the
trajectory's KV cache between turns and prefill only the new tool/environment message and the generation prompt;
the session is released when the trajectory ends. `last_stats` reports `prefill_tokens` and `kv_reused_tokens`.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from rlhf_mcore.agents.hermes import CallError
from rlhf_mcore.agents.loops import get_agent
from rlhf_mcore.agents.tools import Tool
from rlhf_mcore.agents.trajectory import Trajectory, TrajectoryBuilder
from rlhf_mcore.rollout.base import SamplingParams

__all__ = ["MultiTurnSettings", "AgentContext", "AgentRunner", "AgentError", "TURN_KEY"]

TURN_KEY = 256  # request id = trajectory key * TURN_KEY + turn: at most TURN_KEY - 1 model turns


class AgentError(RuntimeError):
    """An agent loop failed (a bug in the loop, not a tool error); the message names the row and the agent."""


@dataclass
class MultiTurnSettings:
    """`actor_rollout_ref.rollout.multi_turn.*` as the runner needs it."""

    max_assistant_turns: int = 5
    max_user_turns: int = 5
    max_tokens_per_turn: Optional[int] = None  # None: whatever is left of the response budget
    tool_timeout_s: float = 30.0
    max_parallel_calls: int = 4  # per model turn; further calls get an error message
    tool_workers: int = 16
    default_agent: str = "single_turn_agent"
    check_drift: bool = True


class _ToolPool:
    """Daemon worker threads; a worker stuck in a call past its deadline is abandoned and replaced."""

    def __init__(self, workers: int):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        threading.Thread(target=self._work, daemon=True, name="agent-tool").start()

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def replace_stuck(self) -> None:
        self._spawn()

    def close(self, workers: int) -> None:
        for _ in range(workers):
            self.jobs.put(None)


@dataclass
class _Turn:
    prompt: list[int]
    max_new_tokens: int
    request_id: int
    future: asyncio.Future
    session: int


class AgentContext:
    """What agent loops reach through `self.ctx`: the tokenizer, the tools, the settings and the two waits."""

    def __init__(self, runner: "AgentRunner"):
        self._r = runner
        self.tokenizer = runner.tokenizer
        self.tools: dict[str, Tool] = runner.tools
        self.settings = runner.settings

    async def generate(self, traj: TrajectoryBuilder) -> Optional[str]:
        budget = traj.remaining
        if self.settings.max_tokens_per_turn:
            budget = min(budget, self.settings.max_tokens_per_turn)
        if budget <= 0 or traj.done:
            traj.stop("length")
            return None
        if traj.assistant_turns >= TURN_KEY - 1:
            raise AgentError(f"more than {TURN_KEY - 1} model turns in one trajectory")
        sample = await self._r._request_turn(traj.context_ids, budget, traj.key * TURN_KEY + traj.assistant_turns,
                                             traj.key)
        return traj.add_model_turn(list(sample.token_ids), list(sample.logprobs), sample.finish_reason,
                                   cut_by_turn_budget=budget < traj.remaining)

    async def call_tools(self, traj: TrajectoryBuilder, calls: list) -> list[dict]:
        return await self._r._run_calls(traj, calls)


class AgentRunner:
    """Agent loops over `engine` for many rows at once (module docstring)."""

    def __init__(self, engine, tokenizer, settings: Optional[MultiTurnSettings] = None,
                 tools: Optional[dict[str, Tool]] = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.settings = settings or MultiTurnSettings()
        self.tools = dict(tools or {})
        self.tool_schemas = [t.schema() for t in self.tools.values()] or None
        self.last_stats: dict[str, float] = {}
        self._on_trajectory: Optional[Callable[[int, Trajectory], None]] = None

    # ------------------------------------------------------------------------------------------------ api
    def run(self, prompt_ids: Sequence[list[int]], rows: Sequence[dict[str, Any]], params: SamplingParams,
            keys: Optional[Sequence[int]] = None,
            on_trajectory: Optional[Callable[[int, Trajectory], None]] = None) -> list[list[Trajectory]]:
        """`params.n` trajectories per row (row i's prompt: `prompt_ids[i]`); `keys[i]` (default i) keys row i's
        random streams. Returns them per row, in sample order; `last_stats` holds engine_busy_s and wall_s.
        `on_trajectory(keys[i] * n + j, trajectory)`: called on the event loop's thread as each one finishes."""
        if len(prompt_ids) != len(rows):
            raise ValueError(f"{len(prompt_ids)} prompts for {len(rows)} rows")
        keys = list(range(len(rows))) if keys is None else list(keys)
        params = params.with_stop_ids(self.engine.default_stop_token_ids)
        self._on_trajectory = on_trajectory
        return asyncio.run(self._main(list(prompt_ids), list(rows), params, keys))

    # ------------------------------------------------------------------------------------------------ main
    async def _main(self, prompt_ids, rows, params: SamplingParams, keys) -> list[list[Trajectory]]:
        loop = asyncio.get_running_loop()
        self._loop, self._params = loop, params
        self._queue: list[_Turn] = []
        self._gen_waiting = self._tool_waiting = 0
        self._wake = asyncio.Event()
        pool = _ToolPool(self.settings.tool_workers)
        self._pool = pool
        ctx = AgentContext(self)
        n = params.n
        tasks = [loop.create_task(self._one(ctx, rows[i], prompt_ids[i], keys[i] * n + j, params))
                 for i in range(len(rows)) for j in range(n)]
        streaming = bool(getattr(self.engine, "supports_streaming", False))
        busy, t_start = 0.0, time.perf_counter()
        inflight: dict[int, _Turn] = {}
        if streaming:
            self.engine.open_stream(params)
        try:
            while True:
                await self._settle(tasks)
                if all(t.done() for t in tasks):
                    break
                if streaming:
                    if self._queue:
                        busy += self._submit(inflight)
                    if self.engine.num_pending:
                        t0 = time.perf_counter()
                        finished = self.engine.step()
                        busy += time.perf_counter() - t0
                        for f in finished:
                            self._resolve(inflight.pop(f.request.request_id), f.sample)
                        continue
                elif self._queue:
                    t0 = time.perf_counter()
                    self._generate_queued()
                    busy += time.perf_counter() - t0
                    continue
                if self._tool_waiting:
                    self._wake.clear()
                    await self._wake.wait()  # every unfinished trajectory waits for a tool: the engine idles
                elif self._gen_waiting:
                    raise AgentError(f"{self._gen_waiting} turn(s) wait for an engine that has nothing pending")
        finally:
            if streaming:
                self.engine.close_stream()
            pool.close(self.settings.tool_workers)
            for t in tasks:
                t.cancel()
        self.last_stats = {"engine_busy_s": busy, "wall_s": time.perf_counter() - t_start}
        if streaming:
            engine_stats = getattr(self.engine, "last_stats", None) or {}
            if "reused_tokens" in engine_stats:
                self.last_stats["prefill_tokens"] = float(engine_stats["prompt_tokens"])
                self.last_stats["kv_reused_tokens"] = float(engine_stats["reused_tokens"])
        out = [t.result() for t in tasks]
        return [out[i * n:(i + 1) * n] for i in range(len(rows))]

    async def _settle(self, tasks) -> None:
        """Let every runnable task go on until it waits for a turn or for its tools (or ends)."""
        spins = 0
        while sum(not t.done() for t in tasks) > self._gen_waiting + self._tool_waiting:
            await asyncio.sleep(0 if spins < 64 else 0.0005)  # a loop awaiting something else: poll gently
            spins += 1
        for t in tasks:  # a failed loop stops the step with its row named
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()

    async def _one(self, ctx: AgentContext, row: dict, prompt: list[int], key: int, params) -> Trajectory:
        name = row.get("agent_name") or self.settings.default_agent
        try:
            cls = get_agent(name)
        except ValueError as e:
            raise AgentError(f"row {row.get('index', '?')}: {e}") from None
        traj = TrajectoryBuilder(self.tokenizer, row.get("raw_prompt") or [], prompt,
                                 max_response_tokens=params.max_new_tokens, tools=self.tool_schemas,
                                 stop_token_ids=tuple(params.stop_token_ids))
        traj.key = key
        try:
            await cls(ctx).run(row, traj)
        except AgentError:
            raise
        except Exception as e:
            raise AgentError(f"agent loop {name!r} failed on row {row.get('index', '?')} (data_source "
                             f"{row.get('data_source')!r}): {type(e).__name__}: {e}") from e
        finally:
            if getattr(self.engine, "supports_streaming", False):
                self.engine.release(key)  # the trajectory's KV cache, kept between its turns
        out = traj.finish(check_drift=self.settings.check_drift)
        if self._on_trajectory is not None:
            self._on_trajectory(key, out)
        return out

    # ------------------------------------------------------------------------------------------- the engine
    async def _request_turn(self, prompt: list[int], max_new_tokens: int, request_id: int, session: int):
        fut = self._loop.create_future()
        self._queue.append(_Turn(list(prompt), int(max_new_tokens), int(request_id), fut, session))
        self._gen_waiting += 1
        return await fut

    def _resolve(self, turn: _Turn, sample) -> None:
        self._gen_waiting -= 1
        turn.future.set_result(sample)

    def _submit(self, inflight: dict) -> float:
        from rlhf_mcore.rollout.base import Request

        t0 = time.perf_counter()
        reqs = []
        for turn in self._queue:
            inflight[turn.request_id] = turn
            reqs.append(Request(request_id=turn.request_id, prompt_ids=turn.prompt,
                                max_new_tokens=turn.max_new_tokens, session=turn.session))
        self._queue = []
        self.engine.submit(reqs)
        return time.perf_counter() - t0

    def _generate_queued(self) -> None:
        groups: dict[int, list[_Turn]] = defaultdict(list)
        for turn in self._queue:
            groups[turn.max_new_tokens].append(turn)
        self._queue = []
        for budget, turns in sorted(groups.items()):
            params = SamplingParams(n=1, temperature=self._params.temperature, top_p=self._params.top_p,
                                    top_k=self._params.top_k, max_new_tokens=budget,
                                    stop_token_ids=self._params.stop_token_ids, seed=self._params.seed)
            outs = self.engine.generate([t.prompt for t in turns], params,
                                        request_ids=[t.request_id for t in turns])
            for turn, out in zip(turns, outs):
                self._resolve(turn, out.samples[0])

    # -------------------------------------------------------------------------------------------- the tools
    async def _run_calls(self, traj: TrajectoryBuilder, calls: list) -> list[dict]:
        """Each call -> one tool message; malformed / unknown / too many / raising / late calls -> an error
        message, counted in the trajectory's stats."""
        st = traj.stats
        turn = len(traj.turns) - 1  # the model turn that made the calls
        results: list[Optional[str]] = [None] * len(calls)
        records: list[dict] = []  # one per call, kept in traj.tool_calls
        pending: list[tuple[int, Tool, dict]] = []
        for k, call in enumerate(calls):
            st["tool_calls"] += 1
            if isinstance(call, CallError):
                records.append({"turn": turn, "error": call.error, "raw": call.raw, "outcome": "malformed"})
                results[k] = f"Error: {call.error}."
            else:
                records.append({"turn": turn, "name": call.name, "arguments": call.arguments, "outcome": "ok"})
                if k >= self.settings.max_parallel_calls:
                    records[k]["outcome"] = "rejected"
                    results[k] = (f"Error: at most {self.settings.max_parallel_calls} tool calls per turn; this one "
                                  f"was not run.")
                elif call.name not in self.tools:
                    records[k]["outcome"] = "unknown"
                    results[k] = f"Error: unknown tool {call.name!r}; the tools are {sorted(self.tools)}."
                else:
                    pending.append((k, self.tools[call.name], call.arguments))
            records[k]["seconds"] = 0.0
            if records[k]["outcome"] != "ok":
                st[f"tool_{records[k]['outcome']}"] = st.get(f"tool_{records[k]['outcome']}", 0.0) + 1
        if pending:
            outcomes = await self._dispatch(pending)
            for (k, _, _), (kind, text, seconds) in zip(pending, outcomes):
                results[k] = text
                st["tool_seconds"] += seconds
                records[k].update(outcome=kind, seconds=seconds)
                if kind != "ok":
                    st[f"tool_{kind}"] = st.get(f"tool_{kind}", 0.0) + 1
        traj.tool_calls += records
        st["tool_errors"] = sum(st.get(f"tool_{k}", 0.0) for k in ("malformed", "rejected", "unknown", "exceptions",
                                                                     "timeouts"))
        return [{"role": "tool", "name": getattr(c, "name", "invalid"), "content": r} for c, r in zip(calls, results)]

    async def _dispatch(self, pending: list[tuple[int, Tool, dict]]) -> list[tuple[str, str, float]]:
        """Run calls on the pool; resolves when every call has returned or passed its deadline. Everything that
        touches the scheduler's counters runs on the event loop's thread."""
        loop, pool = self._loop, self._pool
        fut = loop.create_future()
        outcomes: list[Optional[tuple[str, str, float]]] = [None] * len(pending)
        left = [len(pending)]
        self._tool_waiting += 1

        def settle(i: int, outcome: tuple[str, str, float]) -> None:  # on the loop thread
            if outcomes[i] is not None:
                return  # already timed out (or done)
            outcomes[i] = outcome
            left[0] -= 1
            if left[0] == 0:
                self._tool_waiting -= 1
                fut.set_result(outcomes)
                self._wake.set()

        for i, (_, tool, args) in enumerate(pending):
            timeout = tool.timeout_s or self.settings.tool_timeout_s
            start = time.perf_counter()

            def job(i=i, tool=tool, args=args, start=start):
                try:
                    text = tool(**args)
                    outcome = ("ok", text if isinstance(text, str) else json.dumps(text, default=str), 0.0)
                except Exception as e:
                    outcome = ("exceptions", f"Error: tool {tool.name!r} raised {type(e).__name__}: {e}", 0.0)
                outcome = (outcome[0], outcome[1], time.perf_counter() - start)
                try:
                    loop.call_soon_threadsafe(settle, i, outcome)
                except RuntimeError:  # the rollout ended (this call had timed out): nobody waits for it
                    pass

            def late(i=i, tool=tool, timeout=timeout):
                if outcomes[i] is None:
                    pool.replace_stuck()
                    settle(i, ("timeouts", f"Error: tool {tool.name!r} timed out after {timeout:g} s.", timeout))

            loop.call_later(timeout, late)
            pool.submit(job)
        return await fut
