"""How a test starts the project's scripts: `python SCRIPT` or `torchrun --standalone --nproc_per_node=N SCRIPT`.

One place builds the command, the children's environment (tests/subprocess_env.py's `child_env`: this checkout first
on PYTHONPATH, one intra-op thread, no distributed variables inherited from a caller that runs under torchrun
itself), runs it with a timeout and its output captured, and fails with the command's exit code and the tail of its
output. `--standalone` gives every launch its own rendezvous on a free port, so launches side by side (two workers of
`make test`, or a test's own concurrent runs) never collide on a master port.

    run("launch/train.py", *args, nproc=2)             # -> CompletedProcess, asserted to exit 0
    run("launch/train.py", *args, check=False)          # the caller checks the failure
    procs = {name: start(...) for ...}; wait_all(procs) # side by side, every one must succeed

`script` is a path relative to the repository root (`launch/train.py`, `tests/scripts/x.py`) or an absolute one.
"""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from subprocess_env import ROOT, child_env

# what a torchrun agent sets for its ranks: a test running under one must not hand them to its own launches
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID")
# CPU fp32 whatever the machine has: what the multi-process tests' tolerances are calibrated on (a GPU builds bf16)
CPU = {"CUDA_VISIBLE_DEVICES": ""}
QUIET = {"PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
TAIL = 6000  # characters of each stream in a failure message


def command(script: str | Path, *args: str, nproc: int | None = None) -> list[str]:
    """`python SCRIPT ARGS` (nproc None), else `python -m torch.distributed.run --standalone --nproc_per_node=N ...`."""
    path = str(Path(script) if Path(script).is_absolute() else ROOT / script)
    if nproc is None:
        return [sys.executable, path, *map(str, args)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", path,
            *map(str, args)]


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous that `--standalone` does not pick (several "nodes")."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    """`child_env(OMP_NUM_THREADS="1", **extra)` without the distributed variables of DIST_VARS."""
    out = child_env(OMP_NUM_THREADS="1", **extra)
    for var in DIST_VARS:
        if var not in extra:
            out.pop(var, None)
    return out


def failure(what: str, returncode: int | None, stdout: str | None, stderr: str | None) -> str:
    """The message of a failed launch: what ran, its exit code and the tail of its output."""
    parts = [f"{what} exited {returncode}"]
    for name, text in (("stdout", stdout), ("stderr", stderr)):
        if text:
            parts.append(f"--- {name} (last {TAIL} characters):\n{text[-TAIL:]}")
    return "\n".join(parts)


def run(script: str | Path, *args: str, nproc: int | None = None, timeout: float = 600, check: bool = True,
        env_extra: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run `command(script, *args, nproc=nproc)` to its end (text output captured); with `check`, assert exit 0."""
    cmd = command(script, *args, nproc=nproc)
    proc = subprocess.run(cmd, cwd=cwd, env=env(**(env_extra or {})), capture_output=True, text=True,
                          timeout=timeout)
    if check:
        assert proc.returncode == 0, failure(_name(script, nproc), proc.returncode, proc.stdout, proc.stderr)
    return proc


def start(script: str | Path, *args: str, nproc: int | None = None, env_extra: dict[str, str] | None = None,
          cmd: list[str] | None = None, **popen) -> subprocess.Popen:
    """Start `command(script, *args, nproc=nproc)` (or `cmd`, a command built elsewhere, e.g. by NodeLaunch) in the
    background; text output to pipes unless `popen` says otherwise (stdout=/stderr= a file or DEVNULL)."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen(cmd or command(script, *args, nproc=nproc), cwd=ROOT, env=env(**(env_extra or {})),
                            text=True, **popen)


def wait_all(procs: dict[str, subprocess.Popen], timeout: float = 900) -> dict[str, str]:
    """Wait for every process of `procs` ({name: start(...)}); assert that each exited 0. Returns each one's stdout
    (empty where it did not go to a pipe)."""
    outs, failed = {}, []
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=timeout)
        outs[name] = out or ""
        if proc.returncode != 0:
            failed.append(failure(name, proc.returncode, out, err))
    assert not failed, "\n\n".join(failed)
    return outs


def _name(script: str | Path, nproc: int | None) -> str:
    return f"{Path(script).name}" + (f" under torchrun --nproc_per_node={nproc}" if nproc is not None else "")
