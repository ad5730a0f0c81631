"""The `python` tool: run model-written code in a subprocess per call, contained.

Each call gets a fresh temporary working directory (removed after) and a new Python interpreter started in
isolated mode (`-I`: no user site, no PYTHON* variables) with a clean environment (no variable of the trainer's,
so no inherited secrets). Before the code runs, the interpreter sets `resource` limits on itself: CPU seconds,
address space (memory), file size (which also caps stdout/stderr, written to files), open files, core dumps;
and installs an audit hook that refuses writes outside the working directory, reads under /proc other than
its own, starting processes (fork, exec, subprocess, os.system), sockets and loading native libraries through
ctypes. Run as root, the child also drops to the `nobody` user, so the operating system enforces the same (and a
process-count limit applies); that needs an interpreter `nobody` can execute. Where it cannot (a venv under /root
or in a 0700 directory), the tool refuses to run code rather than run it as root (:class:`SandboxRefused`: an error
message to the model, counted in `agent/tool_exceptions`; one warning line when the tool is built), unless its
config sets `allow_root: true`. The parent kills the whole process group at the wall-clock timeout.
The result is stdout, then stderr, each truncated, and the exit status when it is not 0.

This contains the mistakes and simple escapes of model-written code (loops, huge allocations, fork bombs,
stray writes, environment snooping); it is not a security boundary against a determined adversary: for
untrusted code at scale run the trainer in a container or VM without credentials.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlhf_mcore.agents.tools import Tool, register_tool

__all__ = ["PythonSandbox", "SandboxRefused", "run_python", "privilege_problem"]

# Runs inside the child before the model's code: limits, then the audit hook, then the code (from code.py).
_PREAMBLE = r'''
import os, resource, sys
cpu, mem, fsize, nproc = (int(x) for x in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL a second later
for lim, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, 64),
                 (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(lim, (val, val))
if nproc > 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
_home = os.path.realpath(os.getcwd())
_code = open("code.py").read()
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_BLOCKED = ("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
            "os.kill", "os.killpg", "socket.connect", "socket.bind", "socket.__new__", "ctypes.dlopen",
            "ctypes.dlsym", "ctypes.cdata", "os.chroot", "os.setuid", "sys.addaudithook")
def _inside(path):
    try:
        p = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else "")
    except Exception:
        return False
    return p == _home or p.startswith(_home + os.sep)
def _hook(event, args, _inside=_inside, _blocked=_BLOCKED, _wf=_WRITE_FLAGS):
    if event in _blocked or event.startswith(("os.exec", "os.spawn")):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int):
            return
        writing = (mode is not None and any(c in mode for c in "wax+")) or (mode is None and flags & _wf)
        p = os.path.realpath(os.fsdecode(path))
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing {p!r} outside the working directory is not allowed")
        if p.startswith("/proc/") and not p.startswith(f"/proc/{os.getpid()}/") and not p.startswith("/proc/self/"):
            raise PermissionError(f"sandbox: reading {p!r} is not allowed")
    elif event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink",
                   "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"):
        for a in args[:2]:
            if isinstance(a, (str, bytes, os.PathLike)) and not _inside(a):
                raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")
sys.addaudithook(_hook)
sys.argv = ["code.py"]
exec(compile(_code, "code.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
'''

_CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
              "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
_NOBODY = 65534


_DROP_OK: dict[str, bool] = {}


class SandboxRefused(RuntimeError):
    """Run as root, the sandbox cannot drop to `nobody` and was not allowed to run code as root."""


def _can_drop_to_nobody(python: str) -> bool:
    """Run as root and `python` usable by `nobody` (an interpreter under /root is not): checked once."""
    if os.geteuid() != 0:
        return False
    if python not in _DROP_OK:
        try:
            r = subprocess.run([python, "-I", "-c", "pass"], user=_NOBODY, group=_NOBODY, extra_groups=[],
                               cwd="/", env=_CLEAN_ENV, capture_output=True, timeout=30)
            _DROP_OK[python] = r.returncode == 0
        except (OSError, subprocess.SubprocessError):
            _DROP_OK[python] = False
    return _DROP_OK[python]


def privilege_problem(python: str) -> str | None:
    """Why model code would run as root with `python` (root, and `nobody` cannot execute it), with the fixes;
    None when it would not (not root, or the drop to `nobody` works)."""
    if os.geteuid() != 0 or _can_drop_to_nobody(python):
        return None
    return (f"the python sandbox runs as root and cannot drop to user nobody: nobody cannot execute the interpreter "
            f"{python} (realpath {os.path.realpath(python)}; e.g. under /root or a 0700 directory). Run the trainer "
            f"as a non-root user, set the python tool's config `python:` to an interpreter nobody can execute (e.g. "
            f"/usr/bin/python3), or set `allow_root: true` there to run model-written code as root")


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n...[truncated {len(text) - limit} characters]"


def _read(path: Path, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(4 * limit + 4)
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


def run_python(code: str, *, timeout_s: float = 10.0, cpu_s: int = 10, memory_mb: int = 1024,
               max_output_chars: int = 4000, max_output_bytes: int = 1 << 20, max_code_chars: int = 20000,
               python: str = sys.executable, allow_root: bool = False) -> dict:
    """Run `code` in the sandbox (module docstring). Returns {stdout, stderr, exit_code, timed_out, seconds}.
    Raises SandboxRefused when run as root, the drop to `nobody` is impossible and not `allow_root`."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a string, got {type(code).__name__}")
    if len(code) > max_code_chars:
        raise ValueError(f"the code is {len(code)} characters; at most {max_code_chars}")
    problem = privilege_problem(python)
    if problem is not None and not allow_root:
        raise SandboxRefused(f"refused to run the code: {problem}")
    drop = _can_drop_to_nobody(python)  # root, and the child can become nobody
    workdir = Path(tempfile.mkdtemp(prefix="rlhf_py_"))
    try:
        (workdir / "code.py").write_text(code)
        out_path, err_path = workdir / ".stdout", workdir / ".stderr"
        extra = {}
        if drop:  # the OS then enforces what the audit hook does, and the process-count limit applies
            for p in (workdir, workdir / "code.py"):
                os.chown(p, _NOBODY, _NOBODY)
            extra = dict(user=_NOBODY, group=_NOBODY, extra_groups=[])
        env = dict(_CLEAN_ENV, HOME=str(workdir), TMPDIR=str(workdir))
        argv = [python, "-I", "-c", _PREAMBLE, str(int(cpu_s)), str(memory_mb << 20), str(max_output_bytes),
                "64" if drop else "0"]
        t0 = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, close_fds=True, **extra)
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the code's own children too
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        seconds = time.perf_counter() - t0
        code_ = proc.returncode
        stderr = _read(err_path, max_output_chars)
        if code_ == -signal.SIGXCPU or code_ == -signal.SIGKILL and not timed_out:
            stderr += f"\n[killed: CPU time limit of {cpu_s} s]"
        if code_ == -signal.SIGXFSZ:
            stderr += f"\n[killed: output over {max_output_bytes} bytes]"
        return {"stdout": _truncate(_read(out_path, max_output_chars), max_output_chars),
                "stderr": _truncate(stderr, max_output_chars), "exit_code": code_, "timed_out": timed_out,
                "seconds": seconds}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@register_tool()
class PythonSandbox(Tool):
    """Code interpreter: the model's code runs in :func:`run_python`; the reply is its output."""

    name = "python"
    description = ("Run Python 3 code and return what it prints (stdout, then stderr). Each call starts fresh; "
                   "no network, no files outside the working directory.")
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                  "required": ["code"]}

    def __init__(self, timeout_s: float = 10.0, cpu_s: int = 10, memory_mb: int = 1024,
                 max_output_chars: int = 4000, python: str | None = None, allow_root: bool = False):
        """The tool's config (`config:` of its entry in the tool YAML): the limits of :func:`run_python`;
        `python`: the interpreter running the code (default: the trainer's; only its standard library is needed);
        `allow_root`: run the code as root where, run as root, the drop to `nobody` is impossible (default false:
        the tool then refuses every call)."""
        if not isinstance(allow_root, bool):
            raise ValueError(f"allow_root={allow_root!r}: give true or false (true runs model-written code as root "
                             "when the sandbox cannot drop to nobody)")
        python = sys.executable if python is None else str(python)
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise ValueError(f"python={python!r} is not an executable file; give the path of a Python 3 interpreter")
        self.limits = dict(timeout_s=float(timeout_s), cpu_s=int(cpu_s), memory_mb=int(memory_mb),
                           max_output_chars=int(max_output_chars), python=python, allow_root=allow_root)
        self.timeout_s = float(timeout_s) + 5.0  # the caller's deadline: after the sandbox's own
        problem = privilege_problem(python)
        if problem is not None:
            what = "it runs model-written code as root (allow_root: true)" if allow_root else \
                "it refuses every call"
            print(f"warning: {problem}; {what}", file=sys.stderr, flush=True)

    def __call__(self, code: str = None, **unexpected) -> str:
        if unexpected:
            raise ValueError(f"unexpected argument(s) {sorted(unexpected)}; the python tool takes 'code'")
        if code is None:
            raise ValueError("missing argument 'code'")
        r = run_python(code, **self.limits)
        parts = [r["stdout"]] if r["stdout"] else []
        if r["stderr"]:
            parts.append(r["stderr"])
        if r["timed_out"]:
            parts.append(f"[timed out after {self.limits['timeout_s']:g} s]")
        elif r["exit_code"] != 0:
            parts.append(f"[exit code {r['exit_code']}]")
        return "\n".join(parts) if parts else "[no output]"
