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

`AgentRunner.run` runs a fixed set of rows to the end; :class:`AgentStream` is the same scheduler driven round by
round by its caller, rows added at any time: the fully asynchronous trainer's rollout streams trajectories with it
and pauses their model turns at weight syncs (partial rollout across a trajectory's turns; see the class).
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from rlhf_mcore.agents import loops  # noqa: F401 - the built-in loops (the default, single_turn_agent) registered
from rlhf_mcore.agents.agent_loop import MultiTurnSettings, get_agent
from rlhf_mcore.agents.hermes import CallError
from rlhf_mcore.agents.tools import Tool
from rlhf_mcore.agents.trajectory import Trajectory, TrajectoryBuilder
from rlhf_mcore.rollout.base import FINISH_ABORT, Request, Sample, SamplingParams

__all__ = ["AgentRunner", "AgentStream", "AgentError", "TURN_KEY"]

TURN_KEY = 256  # request id = trajectory key * TURN_KEY + turn: at most TURN_KEY - 1 model turns


class AgentError(RuntimeError):
    """An agent loop failed (a bug in the loop, not a tool error); the message names the row and the agent."""


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
    prefix: Optional[Sample] = None  # a turn paused at a weight sync: its tokens so far, continued from there
    versions: list[int] = field(default_factory=list)  # the policy version of each of its tokens so far
    paused: bool = False  # paused mid-generation at least once
    sample: Optional[Sample] = None  # the finished turn


class StreamContext:
    """The scheduler's :class:`~rlhf_mcore.agents.agent_loop.AgentContext`: the two waits go through the stream."""

    def __init__(self, stream: "AgentStream"):
        self._s = stream
        self.tokenizer = stream.runner.tokenizer
        self.tools: dict[str, Tool] = stream.runner.tools
        self.settings = stream.runner.settings

    async def generate(self, traj: TrajectoryBuilder) -> Optional[str]:
        budget = traj.remaining
        if self.settings.max_tokens_per_turn:
            budget = min(budget, self.settings.max_tokens_per_turn)
        if budget <= 0 or traj.done:
            traj.stop("length")
            return None
        if traj.assistant_turns >= TURN_KEY - 1:
            raise AgentError(f"more than {TURN_KEY - 1} model turns in one trajectory")
        turn = await self._s._request_turn(traj.context_ids, budget, traj.key * TURN_KEY + traj.assistant_turns,
                                           traj.key)
        sample = turn.sample
        if turn.paused:
            traj.stats["paused_turns"] = traj.stats.get("paused_turns", 0.0) + 1
        return traj.add_model_turn(list(sample.token_ids), list(sample.logprobs), sample.finish_reason,
                                   cut_by_turn_budget=budget < traj.remaining, versions=turn.versions)

    async def call_tools(self, traj: TrajectoryBuilder, calls: list) -> list[dict]:
        return await self._s._run_calls(traj, calls)


class AgentRunner:
    """Agent loops over `engine` for many rows at once (module docstring)."""

    def __init__(self, engine, tokenizer, settings: Optional[MultiTurnSettings] = None,
                 tools: Optional[dict[str, Tool]] = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.settings = settings or MultiTurnSettings()
        self.tools = dict(tools or {})
        self.tool_schemas = [t.schema() for t in self.tools.values()] or None
        self.last_stats: dict[str, float] = {}

    def run(self, prompt_ids: Sequence[list[int]], rows: Sequence[dict[str, Any]], params: SamplingParams,
            keys: Optional[Sequence[int]] = None,
            on_trajectory: Optional[Callable[[int, Trajectory], None]] = None) -> list[list[Trajectory]]:
        """`params.n` trajectories per row (row i's prompt: `prompt_ids[i]`); `keys[i]` (default i) keys row i's
        random streams. Returns them per row, in sample order; `last_stats` holds engine_busy_s and wall_s.
        `on_trajectory(keys[i] * n + j, trajectory)`: called on the event loop's thread as each one finishes."""
        if len(prompt_ids) != len(rows):
            raise ValueError(f"{len(prompt_ids)} prompts for {len(rows)} rows")
        keys = list(range(len(rows))) if keys is None else list(keys)
        done: dict[int, Trajectory] = {}

        def finished(key: int, t: Trajectory) -> None:
            done[key] = t
            if on_trajectory is not None:
                on_trajectory(key, t)

        stream = AgentStream(self, params, finished)
        t_start = time.perf_counter()
        if stream.streaming:
            self.engine.open_stream(stream.params)
        try:
            for i in range(len(rows)):
                stream.add(prompt_ids[i], rows[i], keys[i])
            while stream.unfinished:
                stream.pump(wait=True)
        finally:
            if stream.streaming:
                self.engine.close_stream()
            stream.close()
        self.last_stats = {"engine_busy_s": stream.busy_s, "wall_s": time.perf_counter() - t_start}
        if stream.streaming:
            engine_stats = getattr(self.engine, "last_stats", None) or {}
            if "reused_tokens" in engine_stats:
                self.last_stats["prefill_tokens"] = float(engine_stats["prompt_tokens"])
                self.last_stats["kv_reused_tokens"] = float(engine_stats["reused_tokens"])
        n = stream.params.n
        return [[done[k * n + j] for j in range(n)] for k in keys]


class AgentStream:
    """The scheduler: agent loops added at any time (`add`), driven one round at a time by the caller (`pump`), each
    finished trajectory handed to `on_trajectory(key, trajectory)`. A streaming engine's stream is the caller's to
    open (with `self.params`) and close; `close()` ends the loops and the tool threads.

    Weight syncs (the fully asynchronous trainer, `pause` / `version`): `pause()` takes every model turn out of the
    engine with its tokens so far (their log-probs and policy versions kept) and puts it first in line; after the
    caller loads new weights and sets `version`, the next `pump` continues those turns from their tokens (the
    engine's continuation: same random stream, the new tokens sampled and scored by the new weights). Tool calls in
    flight are not touched: they finish, and the trajectory's next turn runs under the weights of its time.
    `pump(submit=False)` holds new turns back (a sync waiting for the engine to drain, without pausing)."""

    def __init__(self, runner: AgentRunner, params: SamplingParams,
                 on_trajectory: Optional[Callable[[int, Trajectory], None]] = None):
        self.runner, self.engine, self.settings, self.tools = runner, runner.engine, runner.settings, runner.tools
        self.params = params.with_stop_ids(self.engine.default_stop_token_ids)
        self.on_trajectory = on_trajectory
        self.streaming = bool(getattr(self.engine, "supports_streaming", False))
        self.version = 0  # the policy version of the engine's weights: recorded for every token sampled
        self.busy_s = 0.0  # seconds in the engine
        self._loop = asyncio.new_event_loop()
        self._queue: list[_Turn] = []  # turns waiting for the engine
        self._inflight: dict[int, _Turn] = {}  # request id -> turn in the engine
        self._tasks: set[asyncio.Task] = set()
        self._gen_waiting = self._tool_waiting = 0
        self._wake = asyncio.Event()
        self._pool = _ToolPool(self.settings.tool_workers)
        self._ctx = StreamContext(self)

    # ------------------------------------------------------------------------------------------------ api
    def add(self, prompt_ids: list[int], row: dict[str, Any], key: int) -> None:
        """`params.n` trajectories of `row`, keyed `key * n + j` (their random streams, `on_trajectory`'s key)."""
        n = self.params.n
        for j in range(n):
            self._tasks.add(self._loop.create_task(self._one(row, list(prompt_ids), key * n + j)))

    @property
    def unfinished(self) -> int:
        """Trajectories added and not finished."""
        return len(self._tasks)

    def pump(self, wait: bool = False, submit: bool = True) -> int:
        """One round: every loop that can go on does until it waits (finished ones go to `on_trajectory`), the
        turns that wait go to the engine (not with `submit=False`) and the engine runs one step (or, not
        streaming, generates them). With `wait`, when only tools are left to wait for, blocks until one returns.
        Returns the engine's requests still pending."""
        self._run(self._settle())
        if not self._tasks:
            return 0
        if self.streaming:
            if self._queue and submit:
                self._submit()
            if self.engine.num_pending:
                t0 = time.perf_counter()
                finished = self.engine.step()
                self.busy_s += time.perf_counter() - t0
                for f in finished:
                    self._resolve(self._inflight.pop(f.request.request_id), f.sample)
                return self.engine.num_pending
        elif self._queue and submit:
            t0 = time.perf_counter()
            self._generate_queued()
            self.busy_s += time.perf_counter() - t0
            return 0
        if wait and self._tool_waiting:
            self._wake.clear()
            self._run(self._wake.wait())  # every unfinished trajectory waits for a tool: the engine idles
        elif wait and self._gen_waiting and submit:
            raise AgentError(f"{self._gen_waiting} turn(s) wait for an engine that has nothing pending")
        return 0

    def pause(self) -> int:
        """Take every turn out of the engine (streaming engines): each keeps its tokens so far, recorded under
        `version`, and waits first in line to be continued. Returns how many had tokens (paused mid-turn)."""
        paused, back = 0, []
        for f in self.engine.abort():
            turn = self._inflight.pop(f.request.request_id)
            if f.sample.finish_reason != FINISH_ABORT:  # it had finished already
                self._resolve(turn, f.sample)
                continue
            self._record(turn, f.sample)
            if f.sample.token_ids:
                turn.prefix, turn.paused = f.sample, True
                paused += 1
            back.append(turn)
        self._queue = back + self._queue
        return paused

    def close(self) -> None:
        """End every loop (unfinished ones are cancelled) and the tool threads."""
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            self._run(asyncio.gather(*self._tasks, return_exceptions=True))
        self._tasks = set()
        self._pool.close(self.settings.tool_workers)
        self._loop.close()

    # ------------------------------------------------------------------------------------------------ loops
    def _run(self, awaitable):
        return self._loop.run_until_complete(awaitable)

    async def _settle(self) -> None:
        """Let every runnable task go on until it waits for a turn or for its tools (or ends); finished ones leave
        the set (a failed loop stops the rollout with its row named)."""
        tasks, spins = self._tasks, 0
        while sum(not t.done() for t in tasks) > self._gen_waiting + self._tool_waiting:
            await asyncio.sleep(0 if spins < 64 else 0.0005)  # a loop awaiting something else: poll gently
            spins += 1
        for t in [t for t in tasks if t.done()]:
            tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()

    async def _one(self, row: dict, prompt: list[int], key: int) -> Trajectory:
        name = row.get("agent_name") or self.settings.default_agent
        try:
            cls = get_agent(name)
        except ValueError as e:
            raise AgentError(f"row {row.get('index', '?')}: {e}") from None
        params = self.params
        traj = TrajectoryBuilder(self.runner.tokenizer, row.get("raw_prompt") or [], prompt,
                                 max_response_tokens=params.max_new_tokens, tools=self.runner.tool_schemas,
                                 stop_token_ids=tuple(params.stop_token_ids))
        traj.key, traj.start_version = key, self.version
        try:
            await cls(self._ctx).run(row, traj)
        except AgentError:
            raise
        except Exception as e:
            raise AgentError(f"agent loop {name!r} failed on row {row.get('index', '?')} (data_source "
                             f"{row.get('data_source')!r}): {type(e).__name__}: {e}") from e
        finally:
            if self.streaming:
                self.engine.release(key)  # the trajectory's KV cache, kept between its turns
        out = traj.finish(check_drift=self.settings.check_drift)
        if self.on_trajectory is not None:
            self.on_trajectory(key, out)
        return out

    # ------------------------------------------------------------------------------------------- the engine
    async def _request_turn(self, prompt: list[int], max_new_tokens: int, request_id: int, session: int) -> _Turn:
        """The turn, once the engine has finished it (`sample`, and `versions`: its tokens' policy versions)."""
        fut = self._loop.create_future()
        self._queue.append(_Turn(list(prompt), int(max_new_tokens), int(request_id), fut, session))
        self._gen_waiting += 1
        return await fut

    def _record(self, turn: _Turn, sample: Sample) -> None:
        """The tokens the turn gained since its last record were sampled under `version`."""
        turn.versions += [self.version] * (len(sample.token_ids) - len(turn.versions))

    def _resolve(self, turn: _Turn, sample: Sample) -> None:
        self._record(turn, sample)
        turn.sample = sample
        self._gen_waiting -= 1
        turn.future.set_result(turn)

    def _submit(self) -> None:
        reqs = []
        for turn in self._queue:
            self._inflight[turn.request_id] = turn
            reqs.append(Request(request_id=turn.request_id, prompt_ids=turn.prompt,
                                max_new_tokens=turn.max_new_tokens, session=turn.session, prefix=turn.prefix))
        self._queue = []
        t0 = time.perf_counter()
        self.engine.submit(reqs)
        self.busy_s += time.perf_counter() - t0

    def _generate_queued(self) -> None:
        groups: dict[int, list[_Turn]] = defaultdict(list)
        for turn in self._queue:
            groups[turn.max_new_tokens].append(turn)
        self._queue = []
        p = self.params
        for budget, turns in sorted(groups.items()):
            params = SamplingParams(n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                    max_new_tokens=budget, stop_token_ids=p.stop_token_ids, seed=p.seed)
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
