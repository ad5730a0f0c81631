"""Process lifetimes: a rank dies with the torchrun agent that started it, a helper with the process that started it.

Without this, `kill -9` of torchrun leaves its ranks training on, re-parented to init, and every kill of a rank
leaves its helpers behind: the reward scorer's workers when one is stuck in user code, and Megatron
dist_checkpointing's `multiprocessing.Manager()` server (a spawned interpreter that re-imports the entry script,
some 280 MB) with multiprocessing's resource tracker, which lives as long as the Manager does.

The mechanism is Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`), not a watchdog thread polling
`os.getppid()`: the kernel delivers it at once, to a process blocked in C++ (a gloo collective, a long matmul)
as well, with no thread and no GIL. Its trap: it fires when the *thread* that created the child exits. torchrun's
agent, the reward scorer and Megatron's Manager start their children from the main thread, which lives as long
as the process. It is armed only from the `prctl` call on, so :func:`die_with_parent` then checks that the
parent is still the expected one: a parent that died earlier has already handed the child to another process.

The signal is SIGKILL: a process whose parent is gone has nobody to report to, and a SIGTERM handler would run
only when the main thread next executes Python, which a rank waiting on a dead peer may never do. Nothing needs
the cleanup it skips: each helper carries its own parent-death signal, the run lock is an `flock` that the kernel
drops (:mod:`rlhf_mcore.trainer.run_lock`), and a half-written checkpoint is a `.tmp` directory that the next
save removes.

:func:`tie_helpers_to_this_process` covers what third-party code starts: every process forked from this one
through `os.fork` (multiprocessing's fork context: dist_checkpointing's bucket writers, which otherwise sleep
forever once a rank dies mid-save) arms the signal right after the fork, and dist_checkpointing's Manager is
started with it armed. Not covered: children that third-party code starts with fork+exec (`subprocess`,
multiprocessing's spawn) other than that Manager; multiprocessing's resource tracker is one, and it exits by
itself once the last process holding its pipe is gone. SGLang's server processes (GPU) arm their own. A forked
child dies with the *thread* that forked it, so a fork from a short-lived thread would be cut short; nothing in
this project forks from one. Off Linux, nothing is armed.

This module imports nothing heavy: reward workers import it first thing.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent", "under_torchrun", "bind_rank_to_launcher", "tie_helpers_to_this_process",
           "arm_forked_children"]

_PR_SET_PDEATHSIG = 1
_prctl = None  # libc's prctl, looked up before any fork (a dlopen in a forked child of a threaded process can hang)
_forking_pid = 0  # set just before each os.fork, read in the child
# The parent when this module was first imported: the launch scripts import it (through rlhf_mcore.cli) within
# milliseconds of the interpreter starting, before torch.
_PARENT_AT_START = os.getppid()


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL) -> bool:
    """Arm the parent-death signal `sig` for this process; if its parent is no longer `expected_parent` (it died
    before the signal was armed), send `sig` to itself now. Returns False off Linux (nothing armed)."""
    if not sys.platform.startswith("linux"):
        return False
    if _libc_prctl()(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True


def _libc_prctl():
    global _prctl
    if _prctl is None:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    return _prctl


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (torch.distributed.run): its parent is the agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def bind_rank_to_launcher() -> bool:
    """Under torchrun, make this rank die (SIGKILL) when its torchrun agent does; returns whether it was armed.
    Elsewhere (`python launch/x.py`, whose parent is a shell or a test harness) it does nothing.

    Call it first thing in an entry point. The parent it expects is the one at this module's first import; a
    torchrun that died before that, with its rank adopted by a sub-reaper other than init, goes unnoticed."""
    if not under_torchrun():
        return False
    return die_with_parent(_PARENT_AT_START)


def tie_helpers_to_this_process() -> None:
    """Make the helper processes third-party code starts from this process die with it (see the module
    docstring): :func:`arm_forked_children`, and Megatron dist_checkpointing's Manager server started with the
    parent-death signal armed. Idempotent; call it in every process that trains or saves checkpoints."""
    if arm_forked_children():
        _start_dist_checkpointing_manager_armed()


def arm_forked_children() -> bool:
    """From now on every child this process forks through `os.fork` (multiprocessing's fork context included)
    arms the parent-death signal first thing. Returns True the first time (False later, and off Linux)."""
    global _forking_pid
    if _forking_pid or not sys.platform.startswith("linux"):
        return False
    _forking_pid = os.getpid()
    _libc_prctl()  # resolved now, before any fork
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    return True


def _before_fork() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _after_fork_in_child() -> None:
    die_with_parent(_forking_pid)


def _start_dist_checkpointing_manager_armed() -> None:
    """Megatron keeps one spawned `multiprocessing.Manager()` per process for the write results of every save
    (`filesystem_async._get_write_results_queue`); its server loop never looks at its parent, so it outlives a
    killed rank. Replace that getter with one that starts the same Manager (spawn context, at the first save)
    with the parent-death signal armed first. A Megatron without that getter is left as it is."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    if not (hasattr(fsa, "_get_write_results_queue") and hasattr(fsa, "_results_queue")):
        return

    def get_write_results_queue():
        if fsa._results_queue is None:
            manager = SyncManager(ctx=mp.get_context("spawn"))
            manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
            fsa._results_queue = manager.Queue()  # the proxy keeps the manager (and its server) referenced
        return fsa._results_queue

    fsa._get_write_results_queue = get_write_results_queue
