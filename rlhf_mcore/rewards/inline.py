"""In-process reward scoring (`reward.num_workers=0`) with a timeout that is enforced, not just hoped for.

The reward function runs in the thread that calls the scorer — as before, so it keeps that thread's state:
the main thread's signal handling (math-verify's own SIGALRM timeouts work), torch's grad mode and current CUDA
device, objects that cannot be pickled. A watchdog thread stops a call that runs past `timeout_s`, in three
stages:

1. At the deadline it interrupts the call: `ScoringInterrupted` is raised inside it. When the caller is the
   main thread this is a signal (`INTERRUPT_SIGNAL`, a real-time signal whose handler is installed only
   while a batch is being scored), which also ends blocking waits (`time.sleep`, socket reads, lock waits);
   from another thread it is an asynchronous exception, which takes effect at the next Python bytecode.
   The item scores 0 and counts as a timeout; the next item runs normally.
2. A call that is still running `grace_s` later (`max(2 s, timeout_s)`) swallowed the interrupt or sits
   in native code that cannot be interrupted; the watchdog then writes what is stuck, and why, to stderr and
   ends the process with exit code 1: a run that cannot continue stops loudly instead of hanging.
3. Native code that holds the GIL forever (a catastrophic regular expression, arithmetic on a huge integer)
   stops every Python thread, the watchdog included. For that, `faulthandler`'s timer thread, which needs
   no GIL, is armed while items are scored: it dumps every thread's stack and exits with code 1 at most
   `timeout_s + 2 * grace_s + 1` seconds after such a call began. The timer is process-wide: the scorer
   replaces any `faulthandler.dump_traceback_later` armed elsewhere while it scores and cancels it after.

Worker processes (`reward.num_workers >= 1`) need none of this: a stuck worker is killed and replaced.
"""
from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from rlhf_mcore.rewards import outcome
from rlhf_mcore.rewards.outcome import ScoringInterrupted, call_reward_fn, failure

__all__ = ["InlineScorer", "INTERRUPT_SIGNAL"]

INTERRUPT_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2  # rarely used elsewhere
_MIN_GRACE_S = 2.0
_BACKSTOP_MARGIN_S = 1.0


def _set_async_exc(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Raise `exc_type` in thread `thread_id` at its next bytecode; None clears one not yet raised."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type is not None else ctypes.py_object())


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor
        return 2


class _Call:
    """One armed call: whose thread, until when, and whether it has been interrupted."""

    __slots__ = ("thread_id", "deadline", "via_signal", "in_fn", "interrupted")

    def __init__(self, thread_id: int, deadline: float, via_signal: bool):
        self.thread_id, self.deadline, self.via_signal = thread_id, deadline, via_signal
        self.in_fn = True  # cleared by `left_fn` the moment the reward call returns: no interrupt after that
        self.interrupted = False  # the deadline has been handled


class _Watchdog:
    """Interrupts the armed call at its deadline; ends the process if it still runs `grace_s` later."""

    def __init__(self, timeout_s: float, grace_s: float):
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self._cond = threading.Condition(threading.Lock())
        self._call: _Call | None = None
        self._wake_at = float("inf")  # when the watchdog thread wakes next (inf: when notified)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="reward-timeout-watchdog", daemon=True)
        self._thread.start()

    def arm(self, deadline: float, via_signal: bool) -> None:
        with self._cond:
            self._call = _Call(threading.get_ident(), deadline, via_signal)
            if deadline < self._wake_at:
                self._cond.notify()

    def left_fn(self) -> None:
        """The armed call has returned; interrupts that have not been sent are no longer sent."""
        call = self._call
        if call is not None:
            call.in_fn = False

    def disarm(self) -> None:
        """Idempotent. After it returns no interrupt for the last armed call is pending or will come."""
        with self._cond:
            call, self._call = self._call, None
            if call is not None and call.interrupted and not call.via_signal:
                _set_async_exc(call.thread_id, None)

    def should_raise(self) -> bool:
        """Whether the armed call is still inside the reward function and was interrupted (read by the signal
        handler, which runs in the calling thread, without the lock)."""
        call = self._call
        return call is not None and call.interrupted and call.in_fn

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                call, now = self._call, time.monotonic()
                if call is None:
                    self._sleep(None)
                elif not call.interrupted:
                    if now < call.deadline:
                        self._sleep(call.deadline - now)
                        continue
                    call.interrupted = True
                    if not call.in_fn:  # returned just now; the caller is about to disarm
                        continue
                    if call.via_signal:
                        signal.pthread_kill(call.thread_id, INTERRUPT_SIGNAL)
                    else:
                        _set_async_exc(call.thread_id, ScoringInterrupted)
                elif now < call.deadline + self.grace_s:
                    self._sleep(call.deadline + self.grace_s - now)
                else:
                    self._give_up(call)

    def _sleep(self, seconds: float | None) -> None:
        self._wake_at = float("inf") if seconds is None else time.monotonic() + seconds
        self._cond.wait(seconds)
        self._wake_at = 0.0

    def _give_up(self, call: _Call) -> None:
        frame = sys._current_frames().get(call.thread_id)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "  (stack unavailable)\n"
        os.write(_stderr_fd(), (
            f"\nreward: a reward function call running in the trainer process (reward.num_workers=0) passed "
            f"reward.timeout_s={self.timeout_s:g}, was interrupted, and is still running {self.grace_s:g} s later: "
            "it swallowed the interrupt or is blocked in native code. Ending the process (exit code 1) instead "
            "of hanging. Set reward.num_workers>=1 to score in worker processes, which are killed and replaced "
            f"when they hang. The stuck call:\n{stack}").encode(errors="replace"))
        os._exit(1)


def _interrupted_failure(exc: ScoringInterrupted, message: str) -> dict[str, Any]:
    """A timeout failure whose `where` and traceback show the line the reward call was on when interrupted."""
    ours = {os.path.abspath(__file__), os.path.abspath(outcome.__file__)}
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) not in ours]
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else None
    text = "Traceback of the interrupted call (most recent call last):\n" + "".join(traceback.format_list(frames))
    return failure(message, where=where, traceback_text=text if frames else None)


class InlineScorer:
    """Scores items in the calling thread under the watchdog described in the module docstring."""

    def __init__(self, fn: Callable[..., Any], timeout_s: float):
        self.fn = fn
        self.timeout_s = timeout_s
        self.grace_s = max(_MIN_GRACE_S, timeout_s)
        self._watchdog: _Watchdog | None = None
        self._backstop_until = 0.0

    def run(self, items: list[dict[str, Any]], results: list[tuple[str, Any]]) -> None:
        """Fill `results[i]` with the outcome of item `i`."""
        if self._watchdog is None:
            self._watchdog = _Watchdog(self.timeout_s, self.grace_s)
        via_signal = threading.current_thread() is threading.main_thread()
        previous = signal.signal(INTERRUPT_SIGNAL, self._on_signal) if via_signal else None
        try:
            for i, args in enumerate(items):
                results[i] = self._one(args, via_signal)
        finally:
            faulthandler.cancel_dump_traceback_later()
            self._backstop_until = 0.0
            if via_signal:
                signal.signal(INTERRUPT_SIGNAL, previous)

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None

    def _one(self, args: dict[str, Any], via_signal: bool) -> tuple[str, Any]:
        start = time.monotonic()
        deadline = start + self.timeout_s
        if self._backstop_until - start < self.timeout_s + self.grace_s + _BACKSTOP_MARGIN_S:
            # Re-armed only every ~grace_s seconds of scoring: arming starts a thread.
            span = self.timeout_s + 2 * self.grace_s + _BACKSTOP_MARGIN_S
            faulthandler.dump_traceback_later(span, exit=True, file=_stderr_fd())
            self._backstop_until = start + span
        message = f"no result within reward.timeout_s={self.timeout_s:g}"
        try:
            try:
                self._watchdog.arm(deadline, via_signal)
                outcome = call_reward_fn(self.fn, args)
                self._watchdog.left_fn()
            finally:
                self._watchdog.disarm()
        except ScoringInterrupted as exc:  # raised in the call (or in this frame right after it returned)
            self._watchdog.disarm()
            return "timeout", _interrupted_failure(exc, message + "; interrupted")
        if time.monotonic() > deadline:  # a late result counts as a timeout, as with workers
            return "timeout", failure(message)
        return outcome

    def _on_signal(self, signum, frame) -> None:
        if self._watchdog is not None and self._watchdog.should_raise():
            raise ScoringInterrupted
