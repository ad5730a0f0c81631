"""How a test starts the project's scripts: `python SCRIPT` or `torchrun --standalone --nproc_per_node=N SCRIPT`.

One place builds the command, the children's environment (tests/subprocess_env.py's `child_env`: this checkout first
on PYTHONPATH, one intra-op thread, no distributed variables inherited from a caller that runs under torchrun
itself), runs it with a timeout and its output captured, and fails with the command's exit code and the tail of its
output. Every multi-rank launch meets on a port bound before its ranks start (`--standalone`'s agent store, or the
store a forked launch's test process serves, tests/zygote.py), so launches side by side (two workers of `make test`,
or a test's own concurrent runs) never collide on a master port.

    run("launch/train.py", *args, nproc=2)             # -> CompletedProcess, asserted to exit 0
    run("launch/train.py", *args, check=False)          # the caller checks the failure
    procs = {name: start(...) for ...}; wait_all(procs) # side by side, every one must succeed

`script` is a path relative to the repository root (`launch/train.py`, `tests/scripts/x.py`) or an absolute one.

On a machine without CUDA the launches fork from warm interpreters (tests/zygote.py: the imports of torch, megatron
and transformers paid once per test process instead of once per launched process); `zygote=False` starts a fresh
interpreter, and torchrun itself for `nproc`: what tests of torchrun's own behaviour and of a process's parent use.
RLHF_TEST_ZYGOTE=0 turns the zygotes off for the whole run.
"""
from __future__ import annotations

import os
import random
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
    """A TCP port free on this host now, for a rendezvous that `--standalone` does not pick (several "nodes").

    Drawn at random below the kernel's ephemeral range (ip_local_port_range): the ports every outgoing connection and
    every `bind(port 0)` take come from that range (gloo's pairs open many), so a port outside it stays free between
    this pick and the launched process's bind unless another explicit pick draws the same one."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range below is taken: the kernel's pick
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


_POOL = None


def zygotes_on() -> bool:
    """Whether launches fork from tests/zygote.py's warm interpreters: not where CUDA is (a CUDA context does not
    survive a fork, and a GPU machine has the cores), not with RLHF_TEST_ZYGOTE=0."""
    global _POOL
    if os.environ.get("RLHF_TEST_ZYGOTE", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if _POOL is None:
        import torch

        if torch.cuda.is_available():
            return False
        from zygote import Pool

        _POOL = Pool()
    return True


def _forked(script: str | Path, args, nproc: int | None, env_extra, cwd: Path, stdout, stderr):
    path = str(Path(script) if Path(script).is_absolute() else ROOT / script)
    return _POOL.start([path, *map(str, args)], env(**(env_extra or {})), str(cwd), nproc, stdout, stderr)


def run(script: str | Path, *args: str, nproc: int | None = None, timeout: float = 600, check: bool = True,
        env_extra: dict[str, str] | None = None, cwd: Path = ROOT, zygote: bool = True) -> subprocess.CompletedProcess:
    """Run `command(script, *args, nproc=nproc)` to its end (text output captured); with `check`, assert exit 0."""
    cmd = command(script, *args, nproc=nproc)
    if zygote and zygotes_on():
        launch = _forked(script, args, nproc, env_extra, cwd, subprocess.PIPE, subprocess.PIPE)
        try:
            out, err = launch.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            launch.kill()
            launch.wait()
            raise
        proc = subprocess.CompletedProcess(cmd, launch.returncode, out, err)
    else:
        proc = subprocess.run(cmd, cwd=cwd, env=env(**(env_extra or {})), capture_output=True, text=True,
                              timeout=timeout)
    if check:
        assert proc.returncode == 0, failure(_name(script, nproc), proc.returncode, proc.stdout, proc.stderr)
    return proc


def start(script: str | Path, *args: str, nproc: int | None = None, env_extra: dict[str, str] | None = None,
          cmd: list[str] | None = None, zygote: bool = True, **popen) -> subprocess.Popen:
    """Start `command(script, *args, nproc=nproc)` (or `cmd`, a command built elsewhere, e.g. by NodeLaunch) in the
    background; text output to pipes unless `popen` says otherwise (stdout=/stderr= a file or DEVNULL)."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    if cmd is None and zygote and set(popen) <= {"stdout", "stderr"} and zygotes_on():
        return _forked(script, args, nproc, env_extra, ROOT, popen["stdout"], popen["stderr"])
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
