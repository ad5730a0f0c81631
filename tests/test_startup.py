"""rlhf_mcore/startup.py: start-up without the cyclic garbage collector, then everything start-up made frozen.

(That the trainer turns it back on once its models are built is checked inside a real run:
tests/test_trainer.py's NaN-loss plugin records `gc.isenabled()` at every loss call.)"""
import gc
import time

import pytest

from rlhf_mcore import startup


@pytest.fixture(autouse=True)
def collector_restored():
    was = gc.isenabled()
    yield
    startup.resume_gc()
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


def test_pause_then_resume_freezes_and_reenables():
    """Mutation: resume_gc without gc.freeze() -> fails (nothing in the permanent generation)."""
    gc.enable()
    gc.unfreeze()
    assert startup.pause_gc(limit_s=60) is True
    assert not gc.isenabled() and startup.gc_paused()
    assert startup.pause_gc(limit_s=60) is False  # idempotent
    made = [[i] for i in range(1000)]  # long-lived objects of "start-up"
    startup.resume_gc()
    assert gc.isenabled() and not startup.gc_paused()
    assert gc.get_freeze_count() >= len(made)
    startup.resume_gc()  # idempotent
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off():
    gc.disable()
    assert startup.pause_gc(limit_s=60) is False
    startup.resume_gc()
    assert not gc.isenabled()


def test_the_timer_turns_it_back_on():
    """An entry point that never says start-up is over still gets its collector back after `limit_s`.
    Mutation: the timer not started in pause_gc -> fails."""
    gc.enable()
    assert startup.pause_gc(limit_s=0.05)
    deadline = time.monotonic() + 10
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gc.isenabled() and not startup.gc_paused()


def test_a_process_that_froze_start_up_exits_without_leak_reports(tmp_path):
    """Objects frozen by resume_gc() must still be collected at exit: extensions such as triton's nanobind bindings
    report every object of theirs still alive when the interpreter ends ("nanobind: leaked 4 instances!"), which
    happened in every process that imported triton. Checked with a cycle whose finalizer writes a file: it runs
    only if the last collection frees the frozen cycle. Mutation: no `atexit.register(gc.unfreeze)` -> fails."""
    import subprocess
    import sys

    from subprocess_env import child_env

    marker = tmp_path / "finalized"
    code = f"""
from rlhf_mcore import startup
startup.pause_gc(limit_s=60)
class Node:
    def __del__(self):
        open({str(marker)!r}, "w").close()
a = Node(); a.me = a; del a   # cyclic garbage made during start-up, frozen below
startup.resume_gc()
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=child_env())
    assert marker.exists()


def test_collections_are_timed_and_counted():
    """`gc_time_since_last` reports the collector's seconds and full passes since its previous call, then starts
    again from zero. Mutations: the generation test flipped to `== 0` -> fails (full passes not counted); the
    "seen" marks never advanced -> fails (the second call repeats the first's figures)."""
    gc.enable()
    startup.gc_time_since_last()
    junk = [[i] for i in range(20000)]
    for _ in range(3):
        gc.collect()  # full passes
    gc.collect(0)  # a young one: timed, not counted as full
    seconds, full = startup.gc_time_since_last()
    assert full == 3 and seconds > 0, (seconds, full)
    assert startup.gc_time_since_last() == (0.0, 0)
    del junk
