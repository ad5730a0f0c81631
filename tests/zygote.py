"""A warm interpreter that forks the processes a test starts, so each skips the ~7 CPU-seconds of imports.

A training process on CI's two cores spends most of a short run importing: torch (~2.8 CPU-s), `torch._dynamo`
(~1.4, pulled in by the first optimizer), transformers (~1.4), megatron-core, sympy, triton (measured, 2-step tiny
run: 8.9 CPU-s of which ~7 imports). The suite starts a few hundred such processes. A zygote imports all of it once
(per pytest worker) and forks a child for each launch; the child takes the launch's environment, working directory,
argv and stdio, then runs the script as `python SCRIPT` would (`runpy`, `__main__`, the script's directory first on
`sys.path`) and exits through the normal interpreter shutdown (atexit handlers, non-daemon threads joined).

What a forked child shares with its zygote and a fresh interpreter would not, and what is done about it:

- the string hash seed: the ranks of one job fork from different zygotes (one per rank index, each started with its
  own random seed), so ranks still disagree on set order as under torchrun;
- the seeds of `random` and numpy's global generator: reseeded from the OS in the child (numpy's would repeat);
- what modules read from the environment at import: the zygotes are keyed by the variables that can matter then
  (`IMPORT_TIME_VARS` prefixes: PYTHON*, TORCH*, CUDA*, OMP*, HF_*, ...); anything else is set per launch;
- threads: the preload leaves the interpreter single-threaded, which it checks (the zygote runs with one OpenMP
  thread and pyarrow's jemalloc without its background thread, `ZYGOTE_ENV`);
- CUDA: never preloaded; the launcher turns zygotes off where CUDA is available (a forked CUDA context is unusable).

A multi-rank launch (`nproc`) forks one child per rank with the variables torchrun gives its ranks (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, MASTER_ADDR, MASTER_PORT of a TCPStore the test process serves,
TORCHELASTIC_USE_AGENT_STORE, as torchrun's agent does) and behaves as
`torchrun --standalone` does towards its caller: the ranks share the job's stdout and stderr, the first rank to fail
takes the others down (SIGTERM, then SIGKILL), and the job exits 1 then (0 when every rank exited 0; a job killed
by a signal reports it as a negative code, as Popen does). What torchrun itself does (its agent process, restarts,
its error summary) is tested with torchrun (tests/test_torchrun_errors.py, tests/test_process_lifetime.py, which
launch with `zygote=False`).

Protocol: the test process starts `python tests/zygote.py SOCKET` with stdin a pipe (its end is the zygote's
lifetime: at EOF every child is killed and the zygote exits) and reads one "ready" line. Each launch is one
connection: a length-prefixed JSON request (argv, env, cwd) with the child's three stdio descriptors attached
(SCM_RIGHTS); the zygote answers one JSON line {"pid": N}, and {"status": S} (os.waitstatus_to_exitcode) when the
child has exited.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys
from pathlib import Path

PRELOAD = ("rlhf_mcore", "torch", "torch._dynamo", "megatron.core", "megatron.core.optimizer",
           "megatron.core.dist_checkpointing", "megatron.core.dist_checkpointing.strategies.torch",
           "megatron.core.models.gpt.gpt_model", "megatron.core.models.gpt.gpt_layer_specs",
           "megatron.core.transformer.transformer_layer", "megatron.core.fusions.fused_bias_swiglu",
           "transformers", "transformers.models.auto.tokenization_auto", "transformers.models.qwen2",
           "torch.utils.tensorboard", "pandas", "datasets", "safetensors.torch",
           "rlhf_mcore.trainer.loops", "rlhf_mcore.engine.train_engine", "rlhf_mcore.rollout.native.engine",
           "rlhf_mcore.models.hf_loader", "rlhf_mcore.models.builder", "rlhf_mcore.models.hf_export",
           "rlhf_mcore.models.tokenizer", "rlhf_mcore.data.rl_dataset", "rlhf_mcore.algos.advantages",
           "rlhf_mcore.rewards.stream", "rlhf_mcore.trainer.summary", "rlhf_mcore.trainer.prime")
# pyarrow's jemalloc starts a background thread when it first allocates (at `import datasets`): not in a zygote
ZYGOTE_ENV = {"JE_ARROW_MALLOC_CONF": "background_thread:false"}
IMPORT_TIME_VARS = ("PYTHON", "TORCH", "PYTORCH", "CUDA", "NCCL", "OMP", "MKL", "KMP", "HF_", "TRANSFORMERS",
                    "TOKENIZERS", "TRITON", "MEGATRON", "NVTE", "LD_", "TMPDIR", "HOME", "XDG_")
HEADER = struct.Struct("!Q")


# ------------------------------------------------------------------------------------------------ the zygote
def _preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import transformers

    transformers.AutoTokenizer  # noqa: B018  (a lazy attribute: resolving it imports the tokenizer classes)
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        raise RuntimeError(f"the zygote has {len(threads)} threads after its preload: forking it would be unsafe")


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(msg) < HEADER.size:
        msg += conn.recv(1 << 16)
    (size,) = HEADER.unpack_from(msg)
    body = msg[HEADER.size:]
    while len(body) < size:
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise EOFError("the request ended early")
        body += chunk
    return json.loads(body), list(fds)


def serve(path: str):
    """Fork a child per request until stdin closes. Returns (request, fds) in a child, None in the zygote at its end."""
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "reap")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    req, fds = _recv_request(conn)
                except (OSError, EOFError, ValueError):
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # the child: drop the zygote's descriptors and go run the script
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    for sock in (listener, conn, *children.values()):
                        sock.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    return req, fds
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                children[pid] = conn
            elif key.data == "reap":
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                while children:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        try:
                            conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                        except OSError:
                            pass
                        conn.close()
            else:  # the test process is gone or done with us
                if not os.read(sys.stdin.fileno(), 4096):
                    for pid in children:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    return None


def run_child(req: dict, fds: list[int]) -> int:
    """In the forked child: become `python SCRIPT ARGS` with the request's environment, directory and stdio."""
    import io
    import random
    import runpy
    import traceback

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False) if unbuffered else
                                  io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                  encoding="utf-8", write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False) if unbuffered else
                                  io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                  encoding="utf-8", errors="backslashreplace", line_buffering=True,
                                  write_through=unbuffered)
    random.seed()  # (CPython's `random` reseeds itself after a fork too; numpy's global generator does not)
    try:
        import numpy

        numpy.random.seed()
    except ImportError:
        pass
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    from rlhf_mcore import lifetime

    lifetime._PARENT_AT_START = os.getppid()  # this child's launcher is the zygote
    script = req["argv"][0]
    sys.argv = list(req["argv"])
    sys.path[0] = str(Path(script).resolve().parent)
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    except BaseException:  # what the interpreter prints for an uncaught exception, and its exit code
        traceback.print_exc()
        code = 1
    return code


# ----------------------------------------------------------------------------------------- the test side
def import_time_key(env: dict[str, str]) -> tuple:
    """The variables of `env` that modules may read at import: launches that differ in them get other zygotes."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_VARS)))


class Zygote:
    """One warm interpreter (started on first use); `launch` forks a child of it."""

    def __init__(self, env: dict[str, str], tmpdir: Path, slot: int):
        import subprocess
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix=f"zygote{slot}_", dir=tmpdir))
        self.socket = str(self.dir / "s")
        self.log = open(self.dir / "log", "w+")
        self.proc = subprocess.Popen([sys.executable, __file__, self.socket], env={**ZYGOTE_ENV, **env},
                                     stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            self.log.seek(0)
            raise RuntimeError(f"the test zygote did not start: {line!r}\n{self.log.read()[-4000:]}")

    def launch(self, argv: list[str], env: dict[str, str], cwd: str, stdio: list[int]) -> "Child":
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket)
        body = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        socket.send_fds(conn, [HEADER.pack(len(body)) + body], stdio)
        return Child(conn)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # EOF: it kills what is left and exits
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
        self.log.close()


class Child:
    """A forked child as its zygote reports it: `pid`, then its exit status."""

    def __init__(self, conn: socket.socket):
        self.conn, self.buf, self.status = conn, b"", None
        self.pid = int(self._message(block=True)["pid"])

    def _message(self, block: bool):
        while b"\n" not in self.buf:
            self.conn.setblocking(block)
            try:
                chunk = self.conn.recv(4096)
            except BlockingIOError:
                return None
            if not chunk:  # the zygote died: the child went with it
                return {"status": -signal.SIGKILL}
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def poll(self, block: bool = False):
        if self.status is None:
            msg = self._message(block)
            if msg is not None:
                self.status = int(msg["status"])
                self.conn.close()
        return self.status

    def fileno(self) -> int:
        return self.conn.fileno()



TORCHRUN_TERM_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when one rank's failure stops the others


class Launch:
    """What `subprocess.Popen` offers the tests (pid, returncode, stdout / stderr pipes, poll, wait, communicate,
    send_signal, terminate, kill), for one child or the ranks of one job."""

    def __init__(self, args: list[str], children: list[Child], stdout=None, stderr=None, store=None):
        import time

        self.args, self.children, self.stdout, self.stderr = args, children, stdout, stderr
        self.store = store  # the ranks' rendezvous (Pool.start): served until the job has ended
        self.pid, self.returncode, self._term_at, self._clock = children[0].pid, None, None, time.monotonic

    def _update(self, block_s: float = 0.0) -> None:
        if block_s > 0 and any(c.status is None for c in self.children):
            sel = selectors.DefaultSelector()
            for c in self.children:
                if c.status is None:
                    sel.register(c, selectors.EVENT_READ)
            sel.select(block_s)
            sel.close()
        statuses = [c.poll() for c in self.children]
        failed = [s for s in statuses if s not in (None, 0)]
        if failed and None in statuses:  # torchrun: one rank failed, the others are stopped
            if self._term_at is None:
                self._term_at = self._clock()
                self.send_signal(signal.SIGTERM)
            elif self._clock() - self._term_at > TORCHRUN_TERM_GRACE:
                self.send_signal(signal.SIGKILL)
            return
        if None in statuses:
            return
        if len(statuses) == 1:
            self.returncode = statuses[0]
        elif not failed:
            self.returncode = 0
        elif len(set(statuses)) == 1 and statuses[0] < 0 and self._term_at is None:
            self.returncode = statuses[0]  # the whole job killed by one signal from outside
        else:
            self.returncode = 1
        self.store = None  # every rank has exited: the rendezvous can close

    def poll(self):
        if self.returncode is None:
            self._update()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        end = None if timeout is None else self._clock() + timeout
        while self.poll() is None:
            left = 0.2 if end is None else min(0.2, end - self._clock())
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._update(left)
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None):
        import subprocess
        import threading

        if input is not None:
            raise NotImplementedError("the zygote launcher gives its children no stdin")
        if not hasattr(self, "_reads"):
            self._reads = {}
            self._threads = []
            for name in ("stdout", "stderr"):
                f = getattr(self, name)
                if f is not None:
                    t = threading.Thread(target=lambda n=name, f=f: self._reads.__setitem__(n, f.read()),
                                         daemon=True)
                    t.start()
                    self._threads.append(t)
        end = None if timeout is None else self._clock() + timeout
        while any(t.is_alive() for t in self._threads):  # the pipes close when every rank has exited
            if end is not None and self._clock() > end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            if self.returncode is None:
                self._update(0.1)  # a failed rank stops the others, as it would without pipes
            for t in self._threads:
                t.join(0.01)
        self.wait(None if end is None else max(0.01, end - self._clock()))
        for name in ("stdout", "stderr"):
            f = getattr(self, name)
            if f is not None:
                f.close()
        return self._reads.get("stdout"), self._reads.get("stderr")

    def send_signal(self, sig: int) -> None:
        for c in self.children:
            if c.poll() is None:
                try:
                    os.kill(c.pid, sig)
                except ProcessLookupError:
                    pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in (self.stdout, self.stderr):
            if f is not None and not f.closed:
                f.close()
        self.wait()


def agent_store():
    """A TCPStore server on a port the kernel picks and this process holds: `init_process_group` in the ranks
    connects to it as a client (TORCHELASTIC_USE_AGENT_STORE=True, torch.distributed.rendezvous)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=30))


class Pool:
    """The zygotes of one test process, by (import-time variables, rank slot); closed at the process's exit."""

    def __init__(self):
        import atexit
        import tempfile

        self.zygotes: dict[tuple, Zygote] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="rlhf_zygotes_"))
        atexit.register(self.close)

    def get(self, env: dict[str, str], slot: int) -> Zygote:
        key = (import_time_key(env), slot)
        z = self.zygotes.get(key)
        if z is None or not z.alive():
            z = self.zygotes[key] = Zygote(env, self.tmp, slot)
        return z

    def start(self, argv: list[str], env: dict[str, str], cwd: str, nproc: int | None, stdout, stderr) -> Launch:
        """Fork `argv` (`[script, *args]`) once, or once per rank (`nproc`) with torchrun's variables.

        The ranks meet on a TCPStore this process serves for the job's lifetime (`agent_store`), as torchrun's agent
        serves its ranks: the port is bound here before any rank starts, so nothing can take it between a pick and a
        rank's bind (a free port picked by closing a probe socket was taken once on CI: EADDRINUSE)."""
        import subprocess

        mine, theirs = {}, []  # our read ends; descriptors to hand over (closed here once sent)

        def fd(spec, name):
            if spec is subprocess.PIPE:
                r, w = os.pipe()
                mine[name] = open(r, "r", encoding="utf-8", errors="replace")
                theirs.append(w)
                return w
            if spec is subprocess.DEVNULL:
                theirs.append(os.open(os.devnull, os.O_RDWR))
                return theirs[-1]
            if spec is None:
                return {"stdout": 1, "stderr": 2}[name]
            return spec if isinstance(spec, int) else spec.fileno()

        stdin = os.open(os.devnull, os.O_RDONLY)
        theirs.append(stdin)
        out = fd(stdout, "stdout")
        err = out if stderr is subprocess.STDOUT else fd(stderr, "stderr")
        ranks = [None] if nproc is None else list(range(nproc))
        store = None if nproc is None else agent_store()
        children = []
        try:
            for rank in ranks:
                child_env = dict(env)
                if rank is not None:
                    child_env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                                      "ROLE_RANK": str(rank), "ROLE_NAME": "default", "WORLD_SIZE": str(nproc),
                                      "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
                                      "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                      "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                                      "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"})
                children.append(self.get(env, rank or 0).launch(argv, child_env, cwd, [stdin, out, err]))
        except BaseException:
            for c in children:
                os.kill(c.pid, signal.SIGKILL)
            raise
        finally:
            for f in theirs:
                os.close(f)
        return Launch(argv, children, mine.get("stdout"), mine.get("stderr"), store)

    def close(self) -> None:
        import shutil

        for z in self.zygotes.values():
            z.close()
        self.zygotes.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)

if __name__ == "__main__":
    got = serve(sys.argv[1])
    if got is None:
        sys.exit(0)
    sys.exit(run_child(*got))
