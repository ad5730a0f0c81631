"""One live run per run directory: the file ``<dir>/RUN_LOCK``, taken by rank 0 before any model is built.

The file is created with ``O_EXCL`` and holds its holder as JSON (host, boot id, PID, the process's start time
in clock ticks, start date, command); the holder keeps an exclusive ``flock`` on it for the life of the run.
The kernel drops a flock when its holder dies, however it dies, so:

- flock held by someone else: a live run; refused;
- flock free, holder on this host (same host name and boot id): stale if the holder process is gone (no process
  with that PID and start time, so PID reuse cannot fool it, or only its unreaped zombie), and then taken over
  with a message; if that process is still alive the filesystem does not honour flock, and the lock is refused;
- flock free, holder on another host: whether a flock is seen across hosts depends on the filesystem, and the
  holder's process cannot be checked from here: refused, and the message says to delete the file if that run is
  over.

The lock is released (the file removed) at clean exit; a killed run leaves the file behind, stale.
:func:`take_run_lock` is the collective form: rank 0 decides, every rank gets the decision.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from rlhf_mcore.config import ConfigError

__all__ = ["LOCK_NAME", "RunLock", "RunLockError", "take_run_lock"]

LOCK_NAME = "RUN_LOCK"
_ATTEMPTS = 5  # a holder releasing, or another process taking over, between our open and our flock: retry


class RunLockError(ConfigError):
    """The run directory is in use (or its lock cannot be judged); the message names the holder and the fix."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> Optional[int]:
    """The process's start time (clock ticks after boot) from /proc, or None where there is no such process or it
    has died and waits to be reaped (a zombie: a killed rank whose parent died too waits for the container's init,
    which may reap late or never; it holds nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # from field 3; the command name may hold spaces and ')'
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22


def _me() -> dict:
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
            "start_ticks": _start_ticks(os.getpid()), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": " ".join(sys.argv)[:500]}


def _describe(holder: dict) -> str:
    return f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')} (started {holder.get('started', '?')})"


def _read(fd: int) -> Optional[dict]:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        holder = json.loads(os.read(fd, 1 << 16).decode() or "null")
    except (ValueError, UnicodeDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


def _write(fd: int, record: dict) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(record) + "\n").encode())
    os.fsync(fd)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _is_current(fd: int, path: Path) -> bool:
    """Whether the open file is still the one at `path` (not removed or replaced since we opened it)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _claim(fd: int, path: Path, created: bool, what: str, elsewhere: str):
    """Decide on the open lock file `fd`: write our record into it and return the previous holder's record (None:
    none, or unreadable), False to look again (the file changed under us), or raise RunLockError."""
    if not _try_flock(fd):
        if created:  # another process took our fresh, still empty file over first: it holds it now
            return False
        raise RunLockError(f"{what} is in use: {path} is held by {_describe(_read(fd) or {})}, which is running. "
                           f"Stop that run, or {elsewhere}.")
    if not _is_current(fd, path):
        return False
    previous = None if created else _read(fd)
    if previous is not None:
        mine = _me()
        if (previous.get("host"), previous.get("boot_id")) != (mine["host"], mine["boot_id"]):
            raise RunLockError(f"{what} may be in use: {path} is held by {_describe(previous)}, which cannot be "
                               f"checked from host {mine['host']}. If that run is over, delete {path}; if not, stop "
                               f"it, or {elsewhere}.")
        pid, ticks = previous.get("pid"), previous.get("start_ticks")
        if isinstance(pid, int) and ticks is not None and _start_ticks(pid) == ticks:
            raise RunLockError(f"{what} is in use: {path} is held by {_describe(previous)}, which is running (this "
                               f"filesystem does not enforce flock). Stop that run, or {elsewhere}.")
    _write(fd, _me())
    return previous


class RunLock:
    """A held run lock (`fd` is None where this process holds none: the other ranks). Release it when done."""

    def __init__(self, path: Path, fd: Optional[int] = None, took_over: Optional[dict] = None):
        self.path, self.fd, self.took_over = path, fd, took_over

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike, key: str = "trainer.default_local_dir") -> "RunLock":
        """Take `<run_dir>/RUN_LOCK` for this process (see the module docstring); `key` is the option that chose
        the directory, named in the error. Raises RunLockError."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_NAME
        for _ in range(_ATTEMPTS):
            try:
                fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                try:
                    fd, created = os.open(path, os.O_RDWR), False
                except FileNotFoundError:  # released between the two opens
                    continue
            try:
                previous = _claim(fd, path, created, f"{key}={run_dir}", f"choose another {key}")
            except BaseException:
                os.close(fd)
                raise
            if previous is False:  # lost a race with a releasing or another starting run: look again
                os.close(fd)
                continue
            if not created:
                print(f"run lock: took over {path} from "
                      f"{_describe(previous) if previous else 'an unrecorded holder'}, which is no longer running",
                      file=sys.stderr, flush=True)
            return cls(path, fd, took_over=previous)
        raise RunLockError(f"{key}={run_dir}: could not take {path}: it changed under {_ATTEMPTS} attempts "
                           f"(other runs starting on this directory?). Stop them, or choose another {key}.")

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        """Remove the lock file (if it is still ours) and drop the flock. Idempotent; a no-op where none is held."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if _is_current(fd, self.path):
                self.path.unlink()
        finally:
            os.close(fd)


def take_run_lock(run_dir: str | os.PathLike, state, key: str = "trainer.default_local_dir") -> RunLock:
    """Collective over `state`'s ranks: rank 0 takes the lock on `run_dir`, every rank learns the outcome. On a
    refusal every rank tears the process groups down (the caller has built nothing else yet) and raises the same
    RunLockError; rank 0 alone holds the returned lock (`held`)."""
    from rlhf_mcore.parallel import destroy_distributed
    from rlhf_mcore.parallel.collectives import broadcast_object

    lock, error = RunLock(Path(run_dir) / LOCK_NAME), None
    if state.is_coordinator:
        try:
            lock = RunLock.acquire(run_dir, key)
        except RunLockError as e:
            error = str(e)
        except OSError as e:  # e.g. the directory cannot be created: the other ranks must not wait on rank 0
            error = f"{key}={run_dir}: cannot take the run lock: {e}"
    error = broadcast_object(error, group=state.cpu_group)
    if error is not None:
        destroy_distributed()
        raise RunLockError(error)
    return lock
