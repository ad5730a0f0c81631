"""A process's start-up without the cyclic garbage collector's full passes.

Importing torch, megatron-core, transformers and datasets and building the models creates several hundred thousand
long-lived objects; with the collector on, CPython walks them again and again while they are being made (measured
on the 2-core development machine: those imports 3.95 -> 3.1 CPU-s; three 2-step, 2-process CPU training runs of
tests/test_trainer.py 56 -> 46 CPU-s, ~18%). So an entry point (`cli.report_user_errors`)
calls `pause_gc()` first, and `resume_gc()` runs when start-up is over: it freezes everything start-up made (moved
to the permanent generation, never scanned again: later full collections are cheaper too) and turns the collector
back on. The trainer calls it when its models are built (`RunContext.building`); a timer calls it after
`STARTUP_GC_LIMIT_S` whatever the process is doing, so no entry point runs long with the collector off. Reference
counting frees almost everything either way; only cyclic garbage made during start-up waits (at most one
start-up's worth). At exit the frozen objects are unfrozen, so the interpreter's last collection frees them as it
would have: extensions that check for leaked objects at exit (nanobind's, in triton) stay quiet.

    pause_gc()     # idempotent; a no-op where the collector was already off (a caller's choice)
    resume_gc()    # idempotent; thread-safe

The collector's own time is measured too (`gc.callbacks`): `gc_time_since_last()` gives the seconds spent in
collections and the number of full (generation-2) ones since its last call; the trainer logs them each step as
`perf/gc_s/max` and `perf/gc_full_collections/max` (the slowest rank's). A full pass over an unfrozen heap of a
process that imported torch, megatron-core and transformers (~500k objects) takes ~0.2 s on the development
machine: a step that pays one is that much slower than its neighbours, which these metrics show.
"""
from __future__ import annotations

import atexit
import gc
import threading
import time

STARTUP_GC_LIMIT_S = 120.0

_lock = threading.Lock()
_paused = False
_timer: threading.Timer | None = None


def pause_gc(limit_s: float = STARTUP_GC_LIMIT_S) -> bool:
    """Turn the cyclic collector off until `resume_gc()` or for `limit_s` seconds at most. Returns whether this
    call paused it (False: already paused, or off already by someone else's choice, which is left alone)."""
    global _paused, _timer
    with _lock:
        if _paused or not gc.isenabled():
            return False
        gc.disable()
        _paused = True
        _timer = threading.Timer(limit_s, resume_gc)
        _timer.daemon = True
        _timer.start()
        return True


def resume_gc() -> None:
    """Freeze what start-up made and turn the collector back on (only where `pause_gc` turned it off)."""
    global _paused, _timer
    with _lock:
        if not _paused:
            return
        _paused = False
        if _timer is not None and _timer is not threading.current_thread():
            _timer.cancel()
        _timer = None
        gc.freeze()
        atexit.register(gc.unfreeze)  # the collection at exit frees them as it would have (extensions check that)
        gc.enable()


def gc_paused() -> bool:
    return _paused


_clock = {"start": 0.0, "seconds": 0.0, "full": 0, "seen_s": 0.0, "seen_full": 0}


def _time_collections(phase: str, info: dict) -> None:
    if phase == "start":
        _clock["start"] = time.perf_counter()
        return
    _clock["seconds"] += time.perf_counter() - _clock["start"]
    _clock["full"] += info.get("generation") == 2


gc.callbacks.append(_time_collections)


def gc_time_since_last() -> tuple[float, int]:
    """(seconds in the cyclic collector, full collections) since the previous call (or the import)."""
    s, n = _clock["seconds"], _clock["full"]
    out = (s - _clock["seen_s"], n - _clock["seen_full"])
    _clock["seen_s"], _clock["seen_full"] = s, n
    return out
