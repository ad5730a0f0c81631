"""Batch envs in worker processes, observations in shared memory: the vectorized env the rollout steps.

    env = SubprocVectorEnv(functools.partial(ReachPush, image_size=32), num_envs=64, num_workers=2)
    obs = env.reset(state_ids)                       # (64,) ints
    env.chunk_step_async(actions)                    # (64, C, A): returns at once, the workers step
    ...                                              # the policy runs meanwhile (rlhf_mcore.vla.rollout)
    res = env.chunk_step_wait()                      # ChunkResult, as chunk_step(actions) returns
    env.close()

Each worker owns a contiguous slice of the envs and builds one batch env for it, `env_fn(num_envs=k)` (a picklable
callable: a class, a `functools.partial`). Workers are fresh interpreters (`python -m
rlhf_mcore.vla.envs.subproc_worker`), not multiprocessing's spawn, which re-imports the parent's main script in
every child (launch/train.py imports torch and megatron: ~5 s a worker); they import numpy, this package and what
`env_fn` needs. Observations go through shared memory: each worker allocates an anonymous `memfd` holding its
slice's images and states and hands the descriptor to the parent over the socket (SCM_RIGHTS), so no name exists
anywhere and nothing can leak, whoever dies; rewards, flags and instructions (small) go over the socket, pickled.

Lifetime: a worker arms the parent-death signal first thing (:func:`rlhf_mcore.lifetime.die_with_parent`), so a
SIGKILLed parent takes its workers along; a worker also exits when its socket closes. The signal fires when the
*thread* that started the worker exits: build the env from the main thread (or one that outlives it). :meth:`close`
asks the workers to exit, waits, and kills the ones that do not. A worker's exception is re-raised in the parent as
a `RuntimeError` with the worker's traceback, and the env closes; so does an answer slower than `step_timeout_s`.
"""
from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import numpy as np

from rlhf_mcore.vla.envs.base import ChunkResult, EnvSpec, check_actions, check_state_ids

__all__ = ["SubprocVectorEnv", "obs_layout"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the directory holding rlhf_mcore/


def obs_layout(spec: EnvSpec, num_envs: int) -> tuple[dict[str, tuple[tuple[int, ...], np.dtype, int]], int]:
    """The shared block of `num_envs` envs: {key: (shape, dtype, byte offset)}, total bytes."""
    arrays = {"image": ((num_envs, *spec.image_shape), np.dtype(np.uint8)),
              "state": ((num_envs, spec.state_dim), np.dtype(np.float32))}
    layout, offset = {}, 0
    for key, (shape, dtype) in arrays.items():
        layout[key] = (shape, dtype, offset)
        offset += -(-int(np.prod(shape)) * dtype.itemsize // 64) * 64  # 64-byte aligned
    return layout, max(offset, 1)


def _views(buf, layout) -> dict[str, np.ndarray]:
    return {k: np.ndarray(shape, dtype, buffer=buf, offset=off) for k, (shape, dtype, off) in layout.items()}


class SubprocVectorEnv:
    """`num_envs` envs in `num_workers` processes behind the chunk interface (module docstring)."""

    def __init__(self, env_fn: Callable[..., Any], num_envs: int, num_workers: int = 2, *,
                 start_timeout_s: float = 120.0, step_timeout_s: float | None = None):
        """`step_timeout_s`: a reset or chunk step whose answer takes longer raises (and closes the env); None
        waits for ever."""
        if not (1 <= num_workers <= num_envs):
            raise ValueError(f"SubprocVectorEnv: num_workers={num_workers} must be in [1, num_envs={num_envs}]")
        self.num_envs, self.num_workers, self.step_timeout_s = num_envs, num_workers, step_timeout_s
        sizes = [num_envs // num_workers + (i < num_envs % num_workers) for i in range(num_workers)]
        self._bounds = np.cumsum([0] + sizes)
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        self._maps: list[mmap.mmap] = []
        self._views: list[dict[str, np.ndarray]] = []
        self._instructions: list[str] = [""] * num_envs
        self._pending = False
        self._closed = False
        self.last_step_s = 0.0  # seconds the slowest worker spent in the last chunk step (rollout's env_s)
        try:
            self._start(env_fn, sizes, start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _start(self, env_fn, sizes, timeout_s) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                                if p])
        for k in sizes:  # start them all, then wait for each: their imports overlap
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", "rlhf_mcore.vla.envs.subproc_worker",
                                     str(theirs.fileno()), str(os.getpid())], pass_fds=[theirs.fileno()], env=env)
            theirs.close()
            self._procs.append(proc)
            conn = Connection(ours.detach())
            conn.send(list(sys.path))  # so that env_fn's module imports there as it does here
            conn.send((env_fn, k))
            self._conns.append(conn)
        specs = []
        for i, conn in enumerate(self._conns):
            if not conn.poll(timeout_s):
                raise RuntimeError(f"env worker {i} (pid {self._procs[i].pid}) did not start within {timeout_s:.0f} s")
            spec, size = self._recv(i, timeout_s=None)
            with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                fd = socket.recv_fds(sock, 1, 1)[1][0]
            self._maps.append(mmap.mmap(fd, size))
            os.close(fd)
            self._views.append(_views(self._maps[-1], obs_layout(spec, sizes[i])[0]))
            specs.append(spec)
        if any(s != specs[0] for s in specs):
            raise RuntimeError(f"env workers disagree on the env spec: {specs}")
        self.spec: EnvSpec = specs[0]

    def _recv(self, i: int, timeout_s: float | None = -1.0):
        timeout_s = self.step_timeout_s if timeout_s == -1.0 else timeout_s
        if timeout_s is not None and not self._conns[i].poll(timeout_s):
            pid = self._procs[i].pid
            self.close(timeout_s=0.0)
            raise RuntimeError(f"env worker {i} (pid {pid}) did not answer within step_timeout_s={timeout_s}")
        try:
            kind, payload = self._conns[i].recv()
        except EOFError:
            code = self._procs[i].poll()
            raise RuntimeError(f"env worker {i} (pid {self._procs[i].pid}) exited (code {code})") from None
        if kind == "error":
            self.close()
            raise RuntimeError(f"env worker {i} failed:\n{payload}")
        return payload

    def _obs(self) -> dict:
        return {"image": np.concatenate([v["image"] for v in self._views]),
                "state": np.concatenate([v["state"] for v in self._views]),
                "instruction": list(self._instructions)}

    def _slices(self):
        return [slice(self._bounds[i], self._bounds[i + 1]) for i in range(self.num_workers)]

    def reset(self, state_ids: Any) -> dict:
        if self._pending:
            raise RuntimeError("reset: a chunk step is in flight; call chunk_step_wait first")
        ids = check_state_ids(state_ids, self.num_envs)
        for conn, sl in zip(self._conns, self._slices()):
            conn.send(("reset", ids[sl]))
        for i, sl in enumerate(self._slices()):
            self._instructions[sl] = self._recv(i)
        return self._obs()

    def chunk_step_async(self, actions: Any) -> None:
        if self._pending:
            raise RuntimeError("chunk_step_async: the previous chunk step is still in flight")
        a = check_actions(actions, self.num_envs, self.spec.action_dim)
        for conn, sl in zip(self._conns, self._slices()):
            conn.send(("step", a[sl]))
        self._pending = True

    def chunk_step_wait(self) -> ChunkResult:
        if not self._pending:
            raise RuntimeError("chunk_step_wait: no chunk step in flight")
        self._pending = False
        parts = [self._recv(i) for i in range(self.num_workers)]  # (reward, terminated, truncated, info, s) each
        info = {k: np.concatenate([p[3][k] for p in parts]) for k in parts[0][3]}
        self.last_step_s = max(p[4] for p in parts)  # the workers step in parallel: the slowest one's seconds
        return ChunkResult(self._obs(), *(np.concatenate([p[j] for p in parts]) for j in range(3)), info)

    def chunk_step(self, actions: Any) -> ChunkResult:
        self.chunk_step_async(actions)
        return self.chunk_step_wait()

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send(("close", None))
            except OSError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        self._views.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view a caller still holds keeps the mapping; it goes with the last reference
                pass

    def __enter__(self) -> "SubprocVectorEnv":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # at interpreter exit; the workers die with this process anyway
                pass
