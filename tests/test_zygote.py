"""tests/zygote.py: a launch forked from a warm interpreter behaves, towards the script and towards the test, as
`python SCRIPT` (one process) or `torchrun --standalone` (`nproc` ranks) does."""
import errno
import json
import os
import signal
import socket
import subprocess
import time

import launcher
import pytest

# cost: unmarked, the file ran last, alone for its ~30 s (session 46's timeline of `make test`)
pytestmark = [pytest.mark.skipif(not launcher.zygotes_on(),
                                 reason="zygotes are off here (CUDA, or RLHF_TEST_ZYGOTE=0)"),
              pytest.mark.cost(30)]

PROBE = r"""
import json, os, random, sys
import numpy
out = {"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "env": os.environ.get("PROBE_VAR"),
       "rank": os.environ.get("RANK"), "world": os.environ.get("WORLD_SIZE"), "port": os.environ.get("MASTER_PORT"),
       "random": random.random(), "numpy": float(numpy.random.rand()), "hash": hash("probe"),
       "main": __name__, "file": __file__, "ppid": os.getppid()}
print(json.dumps(out), flush=True)
print("to stderr", file=sys.stderr)
code = os.environ.get("PROBE_EXIT")
if code == "raise":
    raise ValueError("probe failed")
if code == "kill":
    os.kill(os.getpid(), 9)
if code == "rank1" and os.environ.get("RANK") == "1":
    sys.exit(3)
if code == "rank1":
    import time
    time.sleep(120)  # the other rank's failure must stop this one
sys.exit(int(code or 0))
"""


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "scripts" / "probe.py"
    path.parent.mkdir()
    path.write_text(PROBE)
    return path


def _lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.startswith("{")]


def test_a_forked_launch_is_the_script_run_by_python(probe, tmp_path):
    """argv, cwd, the script's directory first on sys.path, `__main__`, the launch's environment, both pipes and the
    exit code; two launches draw different `random` and numpy numbers (reseeded after the fork). Mutation: drop
    `numpy.random.seed()` in `run_child` -> the two launches draw the same numpy number -> fails."""
    a = launcher.run(probe, "x", "--y", cwd=tmp_path, env_extra={"PROBE_VAR": "v1"})
    b = launcher.run(probe, env_extra={"PROBE_VAR": "v2", "PROBE_EXIT": "0"})
    (pa,), (pb,) = _lines(a.stdout), _lines(b.stdout)
    assert pa["argv"] == [str(probe), "x", "--y"] and pa["cwd"] == str(tmp_path)
    assert pa["path0"] == str(probe.parent) and pa["main"] == "__main__" and pa["file"] == str(probe)
    assert (pa["env"], pb["env"]) == ("v1", "v2") and pa["rank"] is None
    assert "to stderr" in a.stderr and "to stderr" not in a.stdout
    assert pa["random"] != pb["random"] and pa["numpy"] != pb["numpy"]


@pytest.mark.parametrize("how, code", [("7", 7), ("raise", 1), ("kill", -signal.SIGKILL)])
def test_exit_codes_as_popen_reports_them(probe, how, code):
    """sys.exit(7) -> 7; an uncaught exception -> 1 with its traceback on stderr; killed by SIGKILL -> -9."""
    proc = launcher.run(probe, check=False, env_extra={"PROBE_EXIT": how})
    assert proc.returncode == code
    if how == "raise":
        assert "ValueError: probe failed" in proc.stderr


def test_ranks_get_torchruns_variables_and_their_own_hash_seeds(probe):
    """`nproc=3`: RANK 0..2, WORLD_SIZE 3, one MASTER_PORT; each rank forks from its own zygote, so string hashes
    differ between ranks as they do under torchrun (randomized per interpreter)."""
    ranks = _lines(launcher.run(probe, nproc=3).stdout)
    assert sorted(r["rank"] for r in ranks) == ["0", "1", "2"] and {r["world"] for r in ranks} == {"3"}
    assert len({r["port"] for r in ranks}) == 1
    assert len({r["hash"] for r in ranks}) == 3


RENDEZVOUS = r"""
import os, pathlib, sys, time
print("port", os.environ["MASTER_PORT"], flush=True)
go = pathlib.Path(sys.argv[1])
while not go.exists():  # the test checks the port before any rank binds or joins it
    time.sleep(0.05)
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(f"sum {t.item():g}", flush=True)
dist.destroy_process_group()
"""


def test_the_ranks_meet_on_a_port_held_from_before_they_start(tmp_path):
    """The port a multi-rank launch hands its ranks is bound by this process before the ranks start and until the job
    ends (a TCPStore the ranks join as clients, as torchrun's agent serves its ranks), so no other process can take it
    in between: CI once failed with EADDRINUSE on a port picked free and released before rank 0 bound it. The ranks'
    gloo group works over it (all_reduce 1 + 2 = 3). Mutation: the old pick (`free_port()` released before the fork,
    rank 0 binding it later) -> the port is free while the ranks wait -> this test's bind succeeds -> fails."""
    script, go = tmp_path / "rendezvous.py", tmp_path / "go"
    script.write_text(RENDEZVOUS)
    job = launcher.start(script, str(go), nproc=2)
    port = int(job.stdout.readline().split()[1])
    with socket.socket() as s, pytest.raises(OSError) as taken:
        s.bind(("127.0.0.1", port))
    go.touch()
    out, err = job.communicate(timeout=120)
    assert taken.value.errno == errno.EADDRINUSE
    assert job.returncode == 0, err[-3000:]
    assert out.count("sum 3") == 2  # the ranks share the pipe: lines may interleave


def test_one_failed_rank_stops_the_job_as_torchrun_does(probe):
    """Rank 1 exits 3 while rank 0 sleeps: the job stops rank 0 and exits 1 (torchrun's code for a failed rank),
    well before rank 0's sleep would end. Mutation: `Launch._update` skipping its `if failed and None in statuses`
    block -> the wait times out -> fails."""
    t0 = time.monotonic()
    job = launcher.start(probe, nproc=2, env_extra={"PROBE_EXIT": "rank1"})
    out, _ = job.communicate(timeout=60)
    assert job.returncode == 1 and time.monotonic() - t0 < 60
    assert len(_lines(out)) == 2


def test_background_launch_kill_and_poll(probe):
    """`start` returns a Popen-like handle: poll() is None while it runs, kill() ends it, returncode -9."""
    job = launcher.start(probe, env_extra={"PROBE_EXIT": "rank1", "RANK": "0"}, stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    assert job.poll() is None
    job.kill()
    assert job.wait(timeout=30) == -signal.SIGKILL


def test_fresh_interpreter_when_asked(probe):
    """`zygote=False` is a real `python SCRIPT`: its parent is this process (a forked launch's is its zygote)."""
    fresh = _lines(launcher.run(probe, zygote=False, env_extra={"PROBE_VAR": "fresh"}).stdout)[0]
    forked = _lines(launcher.run(probe).stdout)[0]
    assert fresh["env"] == "fresh" and fresh["ppid"] == os.getpid()
    assert forked["ppid"] != os.getpid()
