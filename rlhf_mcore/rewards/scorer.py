"""Batch reward scoring in a reusable pool of worker processes with a per-item timeout.

A reward function is user code: it may hang (a pathological regex, a sympy simplification that never ends),
raise, or return garbage (NaN, a string, a dict without "score"). None of that may kill or stall a training
run, so every such item scores 0.0 and is counted; `stats` reports the counts and a few examples, and one
warning per batch is logged.

    scorer = RewardScorer(fn=None, num_workers=4, timeout_s=10.0)   # fn=None: the registry, by data_source
    scores, stats = scorer.score(data_sources, responses, ground_truths, extra_infos)
    ...
    scorer.close()

Workers are started once and reused every step. They are fresh interpreters (`python -c ...` talking over a
socket pair), not `multiprocessing` children: nothing is forked from a process holding CUDA contexts and
threads, and, unlike the spawn start method, the trainer's `__main__` (torch, Megatron) is not re-imported in
every worker, so one starts in ~0.2 s. A worker dies with the process that started it, also when that one is
killed (Linux's parent-death signal, :mod:`rlhf_mcore.lifetime`). Each item is sent to an idle worker; an item
that is not done `timeout_s` seconds after it was sent gets its worker killed and replaced (the replacement's
start-up, and a reward function's first-call imports such as math-verify's sympy, ~1-2 s, count against its
first item).
`num_workers=0` scores in the calling process: exceptions and garbage are still caught, but a hanging
function cannot be interrupted there.

`fn` is called as `fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`; with workers it
must be picklable: a module-level function, or what `load_custom_reward_fn` returns. `fn=None` uses the
reward registry as it is when the scorer is created; a batch with a data_source that has no registered reward
raises ValueError before scoring (a misconfigured run should stop, not train on zero rewards).
"""
from __future__ import annotations

import atexit
import logging
import math
import numbers
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

from rlhf_mcore.rewards.registry import RegistryDispatch

__all__ = ["RewardScorer", "score_batch", "normalize_reward"]

logger = logging.getLogger(__name__)

_MAX_EXAMPLES = 5  # problem descriptions kept in stats["examples"] per batch


def normalize_reward(result: Any) -> tuple[float | None, dict | None, str | None]:
    """`(score, extra, problem)` from a reward function's return value.

    A finite real number (bools, numpy scalars and 0-dim tensors included) or a dict whose "score" is one is
    valid; anything else gives `score=None` and a `problem` description.
    """
    extra = None
    if isinstance(result, dict):
        if "score" not in result:
            return None, None, f"returned a dict without a 'score' key (keys: {sorted(result)[:8]})"
        extra = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    if isinstance(result, (str, bytes)) or not (isinstance(result, numbers.Real) or hasattr(result, "__float__")):
        return None, None, f"returned {type(result).__name__} {result!r:.80}, not a number"
    try:
        value = float(result)
    except (TypeError, ValueError) as exc:
        return None, None, f"returned {type(result).__name__} that float() rejects: {exc}"
    if not math.isfinite(value):
        return None, None, f"returned a non-finite score {value}"
    return value, extra, None


def _call(fn: Callable[..., Any], args: dict[str, Any]) -> tuple[str, Any]:
    """Run one item; `("ok", (score, extra))`, or `("error"|"invalid", message)`."""
    try:
        result = fn(**args)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: B036 - math-verify's TimeoutException (and sys.exit) are BaseExceptions
        return "error", f"raised {type(exc).__name__}: {exc}"[:300]
    value, extra, problem = normalize_reward(result)
    if problem is not None:
        return "invalid", problem
    return "ok", (value, extra)


def _worker_main() -> None:
    """Worker process entry (`python -c`, see _WORKER_CMD): argv[1] is the socket fd. The first message carries
    the parent's `sys.path` and the pickled reward function; then it answers `(item, kwargs)` with `(item, status,
    payload)` until it receives `None` or the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes the pool
    conn = Connection(int(sys.argv[1]))
    parent_path, fn_bytes = pickle.loads(conn.recv_bytes())
    sys.path.extend(p for p in parent_path if p not in sys.path)
    try:
        fn = pickle.loads(fn_bytes)
        load_error = None
    except BaseException as exc:  # noqa: B036 - report it per item rather than die silently
        fn, load_error = None, f"the worker could not load the reward fn: {exc!r}"[:300]
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        item, args = message
        status, payload = ("error", load_error) if fn is None else _call(fn, args)
        try:
            conn.send((item, status, payload))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # unpicklable extra info
            conn.send((item, "invalid", f"returned an unpicklable result: {exc}"[:300]))


_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding `rlhf_mcore/`
# argv: the socket fd, the trainer's PID. The worker dies with the trainer (a worker stuck in user code would not
# see its socket close), armed before anything else is imported.
_WORKER_CMD = ("import sys; from rlhf_mcore.lifetime import die_with_parent; die_with_parent(int(sys.argv[2])); "
               "from rlhf_mcore.rewards.scorer import _worker_main; _worker_main()")


class _Worker:
    """One worker process and the parent's end of its socket."""

    def __init__(self, init_message: bytes):
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
        self.item: int | None = None
        self.deadline = math.inf

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
    """A reusable reward-scoring pool; see the module docstring. Close it (or use `with`) when done."""

    def __init__(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        num_workers: int = 0,
        timeout_s: float = 10.0,
    ):
        if num_workers < 0:
            raise ValueError(f"reward.num_workers must be >= 0 (0 scores in-process), got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be > 0 seconds, got {timeout_s}")
        self.fn = RegistryDispatch() if fn is None else fn
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self._workers: list[_Worker] = []
        if num_workers > 0:
            try:
                self._init_message = pickle.dumps((list(sys.path), pickle.dumps(self.fn)))
            except Exception as exc:
                raise TypeError(
                    f"reward fn {self.fn!r} cannot be sent to worker processes ({exc}); use module-level functions "
                    "(also for @register_reward), load_custom_reward_fn(path, name), or num_workers=0"
                ) from None
            self._workers = [_Worker(self._init_message) for _ in range(num_workers)]
            _LIVE_SCORERS.add(self)

    # ----------------------------------------------------------------------------------------- public API

    def score(
        self,
        data_sources: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Any] | None = None,
    ) -> tuple[list[float], dict[str, Any]]:
        """Score a batch. Returns `scores` (one float per item, 0.0 for failed items) and `stats`:
        `num_items`, `num_timeout`, `num_error`, `num_invalid`, `num_warnings` (their sum), `examples`
        (a few "item i: problem" strings), `extra` (per item, the non-"score" keys of dict results, or
        None) and `seconds`."""
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
        start = time.monotonic()
        items = [
            {"data_source": ds, "solution_str": r, "ground_truth": gt, "extra_info": ei}
            for ds, r, gt, ei in zip(data_sources, responses, ground_truths, extra_infos, strict=True)
        ]
        results: list[tuple[str, Any]] = [("error", "not scored")] * n
        if self.num_workers == 0:
            results = [_call(self.fn, args) for args in items]
        else:
            self._run_pool(items, results)
        return self._collect(results, time.monotonic() - start)

    def close(self) -> None:
        """Stop the workers. The scorer cannot be used afterwards."""
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop()
        self.num_workers = -1

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_workers", None):
            try:
                self.close()
            except Exception:  # interpreter shutdown; the atexit hook has stopped the workers already
                pass

    # ----------------------------------------------------------------------------------------- internals

    def _run_pool(self, items: list[dict[str, Any]], results: list[tuple[str, Any]]) -> None:
        if self.num_workers < 0:
            raise RuntimeError("this RewardScorer was closed; create a new one")
        pending = deque(range(len(items)))
        idle = list(self._workers)
        busy: dict[Connection, _Worker] = {}
        while pending or busy:
            while pending and idle:
                worker, item = idle.pop(), pending.popleft()
                try:
                    worker.conn.send((item, items[item]))
                except (pickle.PicklingError, TypeError, AttributeError) as exc:
                    results[item] = ("invalid", f"inputs cannot be sent to a worker: {exc}"[:300])
                    idle.append(worker)
                    continue
                except (BrokenPipeError, OSError):  # the worker died while idle: replace it, retry the item
                    pending.appendleft(item)
                    idle.append(self._replace(worker))
                    continue
                worker.item, worker.deadline = item, time.monotonic() + self.timeout_s
                busy[worker.conn] = worker
            if not busy:
                continue
            wait_s = max(0.0, min(w.deadline for w in busy.values()) - time.monotonic())
            for conn in wait(list(busy), timeout=wait_s):
                worker = busy.pop(conn)
                try:
                    item, status, payload = conn.recv()
                except (EOFError, OSError):  # the worker died mid-item (segfault, os._exit, OOM kill)
                    try:
                        code = worker.proc.wait(timeout=1)
                    except subprocess.TimeoutExpired:
                        code = None
                    results[worker.item] = ("error", f"the worker process died (exit code {code})")
                    idle.append(self._replace(worker))
                    continue
                results[item] = (status, payload)
                idle.append(worker)
            now = time.monotonic()
            for conn, worker in list(busy.items()):
                if now >= worker.deadline:
                    del busy[conn]
                    results[worker.item] = ("timeout", f"no result within timeout_s={self.timeout_s:g}")
                    idle.append(self._replace(worker))

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self._init_message)
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def _collect(self, results: list[tuple[str, Any]], seconds: float) -> tuple[list[float], dict[str, Any]]:
        scores: list[float] = []
        extra: list[dict | None] = []
        counts = {"timeout": 0, "error": 0, "invalid": 0}
        examples: list[str] = []
        for i, (status, payload) in enumerate(results):
            if status == "ok":
                scores.append(payload[0])
                extra.append(payload[1])
                continue
            scores.append(0.0)
            extra.append(None)
            counts[status] += 1
            if len(examples) < _MAX_EXAMPLES:
                examples.append(f"item {i}: {status}: {payload}")
        num_warnings = sum(counts.values())
        if num_warnings:
            logger.warning(
                "reward: %d of %d items scored 0 (%d timeout, %d error, %d invalid); e.g. %s",
                num_warnings, len(results), counts["timeout"], counts["error"], counts["invalid"], examples[0],
            )
        stats = {
            "num_items": len(results),
            "num_timeout": counts["timeout"],
            "num_error": counts["error"],
            "num_invalid": counts["invalid"],
            "num_warnings": num_warnings,
            "examples": examples,
            "extra": extra if any(e for e in extra) else None,
            "seconds": seconds,
        }
        return scores, stats


def score_batch(
    data_sources: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Any] | None = None,
    *,
    num_workers: int = 0,
    timeout_s: float = 10.0,
    fn: Callable[..., Any] | None = None,
) -> tuple[list[float], dict[str, Any]]:
    """One-off scoring with a temporary :class:`RewardScorer` (the trainer keeps one instead)."""
    with RewardScorer(fn, num_workers=num_workers, timeout_s=timeout_s) as scorer:
        return scorer.score(data_sources, responses, ground_truths, extra_infos)
