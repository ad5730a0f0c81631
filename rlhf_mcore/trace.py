"""The run's timeline (`trainer.trace`): every timed phase of every rank as a Chrome-trace / Perfetto JSON file.

    with span("generate", step=3, prompts=8):   # timed always (PhaseTimer builds on it); recorded when tracing
        ...

:func:`span` is the one way a phase is timed: :class:`rlhf_mcore.trainer.hooks.PhaseTimer` (the `timing_s/*`
metrics) times its phases with it, and the phases outside a step's metrics (validation, checkpoint, data-bus
pulls, waits, the rollout pool's commands, reward scoring) use it directly. With no trace open it only reads the
clock twice. With one open (:func:`open_trace`, one per process) each span is a complete event ("ph": "X") on
the track of its process (pid = global rank, named "rank R · <role>") and thread (tid; the reward stream's thread
is its own track), with its arguments (step, sizes) in `args`. Two more forms, for what a `with` block does not
fit: :func:`each` times every item of a stream (its pull and its use: a weight-sync bucket), and :func:`interval`
records what this process saw another process do (a reward worker's item, from its arrival at the worker to its
result) on a named track of its own, on this process's clock.

While a span runs, the code inside may report how far it got (:func:`progress`: the rollout engine's tokens so
far); the console's phase indicator (:func:`on_phase`) shows it. Neither costs more than a global read when no
indicator is set.

One clock across ranks: each process reads the wall clock (CLOCK_REALTIME) once when its trace opens and
advances it with its monotonic counter (`perf_counter`, the one PhaseTimer reads), so every event's `ts` is
microseconds of wall time. Ranks on one host read the same wall clock, so their tracks line up to within the
microseconds between two clock reads; ranks on different hosts line up as well as NTP keeps the hosts' clocks
(typically well under a millisecond), which the trace states in `otherData.clock`.

Each process appends its events to `<trace>.parts/rank<R>.jsonl` at every step's end (:func:`flush`; a killed
run keeps what it flushed) and marks its part done when it closes; global rank 0 merges the parts into the one
JSON file when the run ends (:func:`merge`, also `python -m rlhf_mcore.trace PARTS_DIR` after a crash).
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")


class Span:
    """A phase being timed (a context manager): `seconds` once it ended; `args` may be added to while it runs
    and, once recorded, until the trace's next flush."""

    __slots__ = ("name", "args", "t0", "seconds", "dropped")

    def __init__(self, name: str, args: dict[str, Any]):
        self.name, self.args, self.t0, self.seconds, self.dropped = name, args, 0.0, 0.0, False

    def drop(self) -> None:
        """Time it but leave it off the trace (an idle turn of a polling loop)."""
        self.dropped = True

    def __enter__(self) -> "Span":
        if _ON_PHASE is not None:
            _ON_PHASE(self)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0
        if _TRACER is not None and not self.dropped:
            _TRACER.record(self)


class Tracer:
    """One process's events: its rank, its role (the track's name) and the part file it appends to."""

    def __init__(self, parts_dir: Path, rank: int, role: str):
        self.parts_dir, self.rank, self.role = parts_dir, rank, role
        self.wall0_us = time.time_ns() / 1e3  # the wall clock at open ...
        self.perf0 = time.perf_counter()     # ... and the monotonic counter at the same moment
        self.events: list[dict[str, Any]] = []
        self.threads: dict[int, int] = {}  # thread ident -> tid (0: the process's main thread)
        self.lock = threading.Lock()
        parts_dir.mkdir(parents=True, exist_ok=True)
        self.part = parts_dir / f"rank{rank}.jsonl"
        (parts_dir / f"rank{rank}.done").unlink(missing_ok=True)
        self.file = open(self.part, "w")
        self.events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                            "args": {"name": f"rank {rank} · {role}"}})
        self.events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                            "args": {"sort_index": rank}})
        self.tid()

    def tid(self, track: Optional[str] = None) -> int:
        """The track of the calling thread, or the one named `track` (a lane that is no thread of this process)."""
        key = threading.get_ident() if track is None else track
        tid = self.threads.get(key)
        if tid is None:
            with self.lock:
                tid = self.threads[key] = len(self.threads)
                name = track or ("main" if tid == 0 else threading.current_thread().name)
                self.events.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                                    "args": {"name": name}})
        return tid

    def record(self, s: Span, track: Optional[str] = None) -> None:
        ev = {"name": s.name, "ph": "X", "pid": self.rank, "tid": self.tid(track),
              "ts": round(self.wall0_us + (s.t0 - self.perf0) * 1e6, 1), "dur": round(s.seconds * 1e6, 1),
              "args": s.args}  # the span's own dict: what is added to it before the next flush is written too
        with self.lock:
            self.events.append(ev)

    def flush(self) -> None:
        with self.lock:
            events, self.events = self.events, []
        if events:
            self.file.write("".join(json.dumps(e, default=float) + "\n" for e in events))
            self.file.flush()

    def close(self) -> None:
        self.flush()
        self.file.close()
        (self.parts_dir / f"rank{self.rank}.done").touch()


_TRACER: Optional[Tracer] = None
_ON_PHASE: Optional[Callable[[Span], None]] = None  # the console's phase indicator (a terminal's bar) ...
_ON_PROGRESS: Optional[Callable[[dict[str, Any]], None]] = None  # ... and how far the running phase got


def on_phase(fn: Optional[Callable[[Span], None]],
             progress: Optional[Callable[[dict[str, Any]], None]] = None) -> None:
    """Call `fn(span)` as each span starts and `progress(counts)` at each :func:`progress` report (None: stop);
    with or without a trace open."""
    global _ON_PHASE, _ON_PROGRESS
    _ON_PHASE, _ON_PROGRESS = fn, progress


def progress(**counts: Any) -> None:
    """How far the running phase got (`tokens=` generated so far, ...), for the phase indicator; nothing is
    recorded in the trace."""
    if _ON_PROGRESS is not None:
        _ON_PROGRESS(counts)


def span(name: str, **args: Any) -> Span:
    """`with span(name, **args) as s:` times the block (`s.seconds`) and records it on this process's track when
    a trace is open."""
    return Span(name, args)


def each(name: str, items: Iterable[T], **args: Any) -> Iterator[tuple[Span, T]]:
    """`for s, item in each(name, items):` -- one span per item (`index` 0, 1, ... in its arguments, with `args`),
    from the pull of the item (a lazy stream's work: a weight-sync bucket's export and packing) to the end of the
    loop's body; what the body adds to `s.args` is recorded with it. No reference to an item outlives its turn
    (a sync holds one bucket at a time)."""
    it = iter(items)
    index = 0
    while True:
        s = Span(name, {"index": index, **args})
        s.__enter__()
        try:
            item = next(it)
        except StopIteration:
            s.drop()
            s.__exit__(None, None, None)
            return
        try:
            yield s, item
        finally:  # the body's end, or the loop left early (break, an exception): the span ends there
            del item
            s.__exit__(None, None, None)
        index += 1


def interval(name: str, t0: float, t1: float, track: str, **args: Any) -> None:
    """Record what this process saw happen elsewhere from `t0` to `t1` (`time.perf_counter()` readings of this
    process: one clock with its spans) on the track named `track` of its process (a reward worker's item)."""
    if _TRACER is not None:
        s = Span(name, args)
        s.t0, s.seconds = t0, t1 - t0
        _TRACER.record(s, track)


def trace_path(setting: bool | str, run_dir: Path) -> Optional[Path]:
    """`trainer.trace` (checked by the config: a bool or a file's path): false -> None, true ->
    <run_dir>/trace.json, a path -> that file."""
    if setting is False or setting in ("false", "False"):
        return None
    if setting is True or setting in ("true", "True"):
        return run_dir / "trace.json"
    return Path(setting)


def parts_dir(path: Path) -> Path:
    return path.with_name(path.name + ".parts")


def open_trace(path: Optional[Path], rank: int, role: str, world_size: int = 1) -> Optional[Tracer]:
    """This process's tracer (None: tracing off). Each rank starts its own part afresh; rank 0 also removes the
    parts of ranks an earlier run in the same place had beyond this run's `world_size`."""
    global _TRACER
    if path is None:
        return None
    _TRACER = Tracer(parts_dir(path), rank, role)
    if rank == 0:
        for f in _TRACER.parts_dir.glob("rank*.*"):
            if f.stem[4:].isdigit() and int(f.stem[4:]) >= world_size:
                f.unlink(missing_ok=True)
    return _TRACER


def flush() -> None:
    if _TRACER is not None:
        _TRACER.flush()


def close_trace(world_size: int = 1, wait_s: float = 60.0) -> Optional[Path]:
    """Close this process's part; on global rank 0 wait (at most `wait_s`) for every rank's part to be done and
    merge them. Returns the merged file (rank 0), else None."""
    global _TRACER
    tracer, _TRACER = _TRACER, None
    if tracer is None:
        return None
    tracer.close()
    if tracer.rank != 0:
        return None
    deadline = time.monotonic() + wait_s
    done = lambda: all((tracer.parts_dir / f"rank{r}.done").exists() for r in range(world_size))  # noqa: E731
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    return merge(tracer.parts_dir)


def merge(parts: Path, out: Optional[Path] = None) -> Path:
    """The parts' events (those of unfinished parts too) as one Chrome-trace JSON file; returns its path."""
    out = out or parts.with_name(parts.name[: -len(".parts")] if parts.name.endswith(".parts") else "trace.json")
    events, ranks, unfinished = [], [], []
    for f in sorted(parts.glob("rank*.jsonl"), key=lambda p: int(p.stem[4:])):
        ranks.append(int(f.stem[4:]))
        if not f.with_suffix(".done").exists():
            unfinished.append(ranks[-1])
        for line in f.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill
                pass
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"ranks": ranks, "unfinished_ranks": unfinished,
                         "clock": "wall clock (CLOCK_REALTIME) read once per process at trace start, advanced by "
                                  "its monotonic counter: exact across ranks of one host, NTP-aligned across "
                                  "hosts"}}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, out)
    return out


if __name__ == "__main__":  # merge the parts a crashed run left: python -m rlhf_mcore.trace <trace>.parts
    import sys

    print(merge(Path(sys.argv[1])))
