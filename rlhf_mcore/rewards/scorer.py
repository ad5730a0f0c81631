"""Batch reward scoring with a per-item timeout, in a reusable pool of worker processes or in-process.

A reward function is user code: it may hang (a pathological regex, a sympy simplification that never ends),
raise, or return garbage (NaN, a string, a dict without "score"). An occasional such item must not kill or
stall a run: it scores 0.0 and is counted (`stats`: `num_timeouts`, `num_exceptions`, `num_invalid`, and the
first failure with its traceback), and one warning per batch is logged. A function that fails on most items
is broken, and training on its zeros would waste the run: when the failed fraction of a batch exceeds
`max_failure_ratio`, `score` raises :class:`RewardFunctionError` carrying the first failure's exception type,
message and traceback (`max_failure_ratio=1.0` turns the check off).

    scorer = RewardScorer(fn=None, num_workers=4, timeout_s=10.0)   # fn=None: the registry, by data_source
    scores, stats = scorer.score(data_sources, responses, ground_truths, extra_infos)
    ...
    scorer.close()

`num_workers >= 1`: workers are started once and reused every step. They are fresh interpreters (`python -c
...` talking over a socket pair), not `multiprocessing` children: nothing is forked from a process holding
CUDA contexts and threads, and, unlike the spawn start method, the trainer's `__main__` (torch, Megatron) is
not re-imported in every worker. Each item is sent to an idle worker; an item that is not done `timeout_s`
seconds after it was sent (or after its worker finished starting and loading the function) gets its worker
killed and replaced (a reward function's first-call imports, such as math-verify's sympy, count against the
first item of a new worker). A worker dies with the process that started it, also when that one is killed
(Linux's parent-death signal, :mod:`rlhf_mcore.lifetime`).

`num_workers=0` scores in the calling thread, as it always has (no pickling; the caller's signal handlers,
torch grad mode and CUDA device apply), and the timeout holds there too: a call past `timeout_s` is
interrupted (it scores 0 and counts as a timeout; the next item runs normally), and one that cannot be
interrupted ends the process with exit code 1 and the stuck stack on stderr rather than hang it — see
:mod:`rlhf_mcore.rewards.inline`. Worker processes never need that last resort, so set `num_workers >= 1`
for reward functions that may block in native code (network calls, C extensions).

`fn` is called as `fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`; with workers it
must be picklable: a module-level function, or what `load_custom_reward_fn` returns. `fn=None` uses the
reward registry as it is when the scorer is created; a batch with a data_source that has no registered reward
raises ValueError before scoring (a misconfigured run should stop, not train on zero rewards).
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from rlhf_mcore.rewards.errors import RewardFunctionError
from rlhf_mcore.rewards.inline import InlineScorer
from rlhf_mcore.rewards.outcome import FAILURE_KINDS, call_reward_fn, failure
from rlhf_mcore.rewards.registry import RegistryDispatch
from rlhf_mcore.trace import interval, span

__all__ = ["RewardScorer", "score_batch", "failure_error", "reward_metrics"]

logger = logging.getLogger(__name__)

_MAX_EXAMPLES = 5  # problem descriptions kept in stats["examples"] per batch


def worker_main() -> None:
    """Worker process entry (`python -c`): argv[1] is the socket fd. The first message carries the parent's
    `sys.path` and the pickled reward function; then it answers `(item, kwargs)` with `(item, status,
    payload)` until it receives `None` or the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes the pool
    conn = Connection(int(sys.argv[1]))
    parent_path, fn_bytes = pickle.loads(conn.recv_bytes())
    sys.path.extend(p for p in parent_path if p not in sys.path)
    try:
        fn = pickle.loads(fn_bytes)
        load_error = None
    except BaseException as exc:  # noqa: B036 - report it per item rather than die silently
        fn, load_error = None, failure(f"the worker could not load the reward fn: {exc}", type(exc).__name__)
    conn.send(_READY)  # items are timed from here: start-up and loading the function do not count
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        item, args = message
        status, payload = ("exception", load_error) if fn is None else call_reward_fn(fn, args)
        try:
            conn.send((item, status, payload))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # unpicklable extra info
            conn.send((item, "invalid", failure(f"returned an unpicklable result: {exc}")))


_READY = "ready"  # a worker's first message
_STARTUP_S = 60.0  # a worker that has not loaded the reward function by then is stuck importing it
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding `rlhf_mcore/`
# argv: the socket fd, the trainer's PID. The worker dies with the trainer (a worker stuck in user code would not
# see its socket close), armed before anything else is imported.
_WORKER_CMD = ("import sys; from rlhf_mcore.lifetime import die_with_parent; die_with_parent(int(sys.argv[2])); "
               "from rlhf_mcore.rewards.scorer import worker_main; worker_main()")


class _Worker:
    """One worker process and the parent's end of its socket; `slot`: its place in the pool (a replacement takes
    the slot of the worker it replaces), and its track in the run's trace."""

    def __init__(self, init_message: bytes, slot: int):
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CMD, str(child_sock.fileno()), str(os.getpid())],
            pass_fds=(child_sock.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.conn.send_bytes(init_message)
        self.started = time.monotonic()
        self.ready = False  # its _READY message has been received
        self.item: int | None = None
        self.deadline = math.inf
        self.track = f"reward worker {slot}"
        self.slot = slot
        self.sent = 0.0  # when its item reached it, by the trace's clock (rlhf_mcore.trace)

    def traced(self, item: int, status: str) -> None:
        """Its item, from its arrival until now, on the worker's track of the run's trace (none open: nothing)."""
        interval("reward item", self.sent, time.perf_counter(), self.track, item=item, status=status, pid=self.proc.pid)

    def item_deadline(self, timeout_s: float) -> float:
        """When the current item (sent now, or the ready message received now) is overdue."""
        if self.ready:
            return time.monotonic() + timeout_s
        return self.started + _STARTUP_S + timeout_s

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.conn.close()


_LIVE_SCORERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_scorers() -> None:  # a worker stuck in user code must not outlive the trainer
    for scorer in list(_LIVE_SCORERS):
        scorer.close()


class RewardScorer:
    """A reusable reward scorer; see the module docstring. Close it (or use `with`) when done."""

    def __init__(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        num_workers: int = 0,
        timeout_s: float = 10.0,
        max_failure_ratio: float = 0.5,
    ):
        if num_workers < 0:
            raise ValueError(f"reward.num_workers must be >= 0 (0 scores in-process), got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be > 0 seconds, got {timeout_s}")
        if not 0.0 <= max_failure_ratio <= 1.0:
            raise ValueError(f"reward.max_failure_ratio must be in [0, 1] (1.0 turns the check off), got "
                             f"{max_failure_ratio}")
        self.fn = RegistryDispatch() if fn is None else fn
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.max_failure_ratio = float(max_failure_ratio)
        self._workers: list[_Worker] = []
        self._inline: InlineScorer | None = None
        if num_workers == 0:
            self._inline = InlineScorer(self.fn, self.timeout_s)
        else:
            try:
                self._init_message = pickle.dumps((list(sys.path), pickle.dumps(self.fn)))
            except Exception as exc:
                raise TypeError(
                    f"reward fn {self.fn!r} cannot be sent to worker processes ({exc}); use module-level functions "
                    "(also for @register_reward), load_custom_reward_fn(path, name), or num_workers=0"
                ) from None
            self._workers = [_Worker(self._init_message, k) for k in range(num_workers)]
            _LIVE_SCORERS.add(self)

    # ----------------------------------------------------------------------------------------- public API

    def score(
        self,
        data_sources: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Any] | None = None,
        *,
        check: bool = True,
    ) -> tuple[list[float], dict[str, Any]]:
        """Score a batch. Returns `scores` (one float per item, 0.0 for failed items) and `stats`:
        `num_items`; `num_timeouts`, `num_exceptions`, `num_invalid` and `num_failed` (their sum);
        `first_failure` (None, or a dict: `item`, `data_source`, `kind`, `type`, `message`, `where`,
        `traceback`); `examples` (a few "item i: kind: problem" strings); `extra` (per item, the non-"score"
        keys of dict results, or None); `reward_fn` (a description of the function) and `seconds`.

        Raises :class:`RewardFunctionError` when `num_failed / num_items > max_failure_ratio`; `check=False`
        leaves that to the caller (`failure_error` on stats summed over several scorers).
        """
        n = len(responses)
        if extra_infos is None:
            extra_infos = [None] * n
        if not (len(data_sources) == len(ground_truths) == len(extra_infos) == n):
            raise ValueError(
                f"score() needs one entry per item: {len(data_sources)} data_sources, {n} responses, "
                f"{len(ground_truths)} ground_truths, {len(extra_infos)} extra_infos"
            )
        if isinstance(self.fn, RegistryDispatch) and self.fn.unknown(data_sources):
            raise ValueError(
                f"no reward function for data_source(s) {self.fn.unknown(data_sources)}; known: "
                f"{sorted(self.fn.table)}. Register one with @rlhf_mcore.rewards.register_reward(...) or set "
                "reward.custom_reward_function.path/.name"
            )
        if self.num_workers < 0:
            raise RuntimeError("this RewardScorer was closed; create a new one")
        start = time.monotonic()
        items = [
            {"data_source": ds, "solution_str": r, "ground_truth": gt, "extra_info": ei}
            for ds, r, gt, ei in zip(data_sources, responses, ground_truths, extra_infos, strict=True)
        ]
        results: list[tuple[str, Any]] = [("exception", failure("not scored"))] * n
        with span("score", items=n, workers=self.num_workers):  # the trace's reward track (rlhf_mcore/trace.py)
            if self._inline is not None:
                self._inline.run(items, results)
            else:
                self._run_pool(items, results)
        scores, stats = self._collect(results, data_sources, time.monotonic() - start)
        if check:
            error = failure_error(stats, self.max_failure_ratio)
            if error is not None:
                raise error
        return scores, stats

    def worker_pids(self) -> list[int]:
        """The process ids of the current workers (empty with `num_workers=0`)."""
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Stop the workers. The scorer cannot be used afterwards."""
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop()
        if self._inline is not None:
            self._inline.close()
            self._inline = None
        self.num_workers = -1

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_workers", None) or getattr(self, "_inline", None):
            try:
                self.close()
            except Exception:  # interpreter shutdown; the atexit hook has stopped the workers already
                pass

    # ----------------------------------------------------------------------------------------- internals

    def _run_pool(self, items: list[dict[str, Any]], results: list[tuple[str, Any]]) -> None:
        pending = deque(range(len(items)))
        idle = list(self._workers)
        busy: dict[Connection, _Worker] = {}
        while pending or busy:
            while pending and idle:
                worker, item = idle.pop(), pending.popleft()
                try:
                    worker.conn.send((item, items[item]))
                except (pickle.PicklingError, TypeError, AttributeError) as exc:
                    results[item] = ("invalid", failure(f"inputs cannot be sent to a worker: {exc}"))
                    idle.append(worker)
                    continue
                except (BrokenPipeError, OSError):  # the worker died while idle: replace it, retry the item
                    pending.appendleft(item)
                    idle.append(self._replace(worker))
                    continue
                worker.item, worker.deadline = item, worker.item_deadline(self.timeout_s)
                worker.sent = time.perf_counter()
                busy[worker.conn] = worker
            if not busy:
                continue
            wait_s = max(0.0, min(w.deadline for w in busy.values()) - time.monotonic())
            for conn in wait(list(busy), timeout=wait_s):
                worker = busy.pop(conn)
                try:
                    message = conn.recv()
                    if message == _READY:  # a new worker finished starting: its item's time starts now
                        worker.ready = True
                        worker.deadline = worker.item_deadline(self.timeout_s)
                        worker.sent = time.perf_counter()  # the item sent before: the worker's from here (traced)
                        busy[conn] = worker
                        continue
                    item, status, payload = message
                except (EOFError, OSError):  # the worker died mid-item (segfault, os._exit, OOM kill)
                    try:
                        code = worker.proc.wait(timeout=1)
                    except subprocess.TimeoutExpired:
                        code = None
                    results[worker.item] = ("exception", failure(f"the worker process died (exit code {code})",
                                                                  "WorkerDied"))
                    worker.traced(worker.item, "died")
                    idle.append(self._replace(worker))
                    continue
                results[item] = (status, payload)
                worker.traced(item, status)
                idle.append(worker)
            now = time.monotonic()
            for conn, worker in list(busy.items()):
                if now >= worker.deadline:
                    del busy[conn]
                    if not worker.ready:  # other workers may hold items of this batch: the pool is unusable
                        worker.kill()
                        self.close()
                        raise RewardFunctionError(
                            f"a reward worker process did not load the reward function {_describe_fn(self.fn)} "
                            f"within {_STARTUP_S:g} s of starting: importing it hangs. Fix the reward file's "
                            "imports (or score in-process with reward.num_workers=0 to debug it).",
                            num_items=len(items), counts={}, max_failure_ratio=self.max_failure_ratio,
                            first_failure=None)
                    results[worker.item] = ("timeout", failure(
                        f"no result within reward.timeout_s={self.timeout_s:g}; the worker was killed and replaced"))
                    worker.traced(worker.item, "timeout")
                    idle.append(self._replace(worker))

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self._init_message, worker.slot)
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def _collect(self, results: list[tuple[str, Any]], data_sources: Sequence[str],
                 seconds: float) -> tuple[list[float], dict[str, Any]]:
        scores: list[float] = []
        extra: list[dict | None] = []
        counts = dict.fromkeys(FAILURE_KINDS, 0)
        examples: list[str] = []
        first: dict[str, Any] | None = None
        for i, (status, payload) in enumerate(results):
            if status == "ok":
                scores.append(payload[0])
                extra.append(payload[1])
                continue
            scores.append(0.0)
            extra.append(None)
            counts[status] += 1
            if first is None:
                first = {"item": i, "data_source": data_sources[i], "kind": status, **payload}
            if len(examples) < _MAX_EXAMPLES:
                examples.append(f"item {i}: {status}: {_describe(payload)}")
        num_failed = sum(counts.values())
        if num_failed:
            logger.warning(
                "reward: %d of %d items scored 0 (%d timeouts, %d exceptions, %d invalid); e.g. %s",
                num_failed, len(results), counts["timeout"], counts["exception"], counts["invalid"], examples[0],
            )
        stats = {
            "num_items": len(results),
            "num_timeouts": counts["timeout"],
            "num_exceptions": counts["exception"],
            "num_invalid": counts["invalid"],
            "num_failed": num_failed,
            "first_failure": first,
            "examples": examples,
            "extra": extra if any(e for e in extra) else None,
            "reward_fn": _describe_fn(self.fn),
            "seconds": seconds,
        }
        return scores, stats


def _describe(failure_payload: dict[str, Any]) -> str:
    """`Type: message (at where)`, or the bare message for failures that are not exceptions."""
    text = failure_payload["message"]
    if failure_payload.get("type"):
        text = f"{failure_payload['type']}: {text}"
    if failure_payload.get("where"):
        text += f" (at {failure_payload['where']})"
    return text


def _describe_fn(fn: Callable[..., Any]) -> str:
    if isinstance(fn, RegistryDispatch):
        return "the registered reward for each data_source"
    path, name = getattr(fn, "path", None), getattr(fn, "name", None)
    if isinstance(path, str) and isinstance(name, str):  # CustomRewardFunction
        return f"{name} from {path}"
    return getattr(fn, "__qualname__", None) or repr(fn)


def failure_error(stats: dict[str, Any], max_failure_ratio: float) -> RewardFunctionError | None:
    """The error to raise when `stats` (one batch's, or several scorers' with counts summed and one
    `first_failure` kept) show more failed items than `max_failure_ratio` allows; else None."""
    n, failed = stats["num_items"], stats["num_failed"]
    if n == 0 or failed / n <= max_failure_ratio:
        return None
    first = stats.get("first_failure")
    counts = {"exceptions": stats["num_exceptions"], "invalid": stats["num_invalid"],
              "timeouts": stats["num_timeouts"]}
    where = ""
    if first is not None:
        where = f" First failure (item {first['item']}, data_source={first['data_source']!r}): {_describe(first)}."
    message = (
        f"reward function {stats.get('reward_fn', '?')} failed on {failed} of {n} items of this batch "
        f"({counts['exceptions']} raised, {counts['invalid']} returned no valid number, {counts['timeouts']} timed "
        f"out), more than reward.max_failure_ratio={max_failure_ratio:g} allows.{where} Fix the reward function, "
        "or raise reward.max_failure_ratio (1.0 turns this check off)."
    )
    return RewardFunctionError(message, num_items=n, counts=counts, max_failure_ratio=max_failure_ratio,
                               first_failure=first)


def reward_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """The per-step failure counts to log: `reward/num_timeouts`, `reward/num_exceptions`, `reward/num_invalid`
    (missing counts, e.g. on ranks that did not score, are 0)."""
    out = {f"reward/{key}": float(stats.get(key, 0)) for key in ("num_timeouts", "num_exceptions", "num_invalid")}
    if "tail_s" in stats:  # RewardLoop: scoring left after the last sample finished (summed over rollout replicas)
        out["timing_s/reward_tail"] = float(stats["tail_s"])
    return out


def score_batch(
    data_sources: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Any] | None = None,
    *,
    num_workers: int = 0,
    timeout_s: float = 10.0,
    max_failure_ratio: float = 0.5,
    fn: Callable[..., Any] | None = None,
) -> tuple[list[float], dict[str, Any]]:
    """One-off scoring with a temporary :class:`RewardScorer` (the trainer keeps one instead)."""
    with RewardScorer(fn, num_workers=num_workers, timeout_s=timeout_s, max_failure_ratio=max_failure_ratio) as scorer:
        return scorer.score(data_sources, responses, ground_truths, extra_infos)
