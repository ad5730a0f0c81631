"""The children tests start keep the caller's PYTHONPATH and import rlhf_mcore from this checkout."""
import json
import subprocess
import sys

from subprocess_env import ROOT, child_env


def test_child_keeps_the_callers_pythonpath_behind_the_checkout(tmp_path, monkeypatch):
    """A package reachable only through the caller's PYTHONPATH imports in the child; rlhf_mcore comes from this
    checkout even where the caller's PYTHONPATH holds another copy of it; the extras and other variables arrive.

    Mutation: `child_env` sets PYTHONPATH to the checkout alone -> fails (no module named caller_only_pkg);
    the checkout appended after the caller's entries -> fails (rlhf_mcore from the decoy)."""
    site = tmp_path / "site"
    (site / "caller_only_pkg").mkdir(parents=True)
    (site / "caller_only_pkg" / "__init__.py").write_text("VALUE = 42\n")
    (site / "rlhf_mcore").mkdir()
    (site / "rlhf_mcore" / "__init__.py").write_text("")  # a decoy copy the checkout must shadow
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("RLHF_TEST_CALLER_VAR", "kept")
    code = ("import json, os, caller_only_pkg, rlhf_mcore\n"
            "print(json.dumps([caller_only_pkg.VALUE, rlhf_mcore.__file__, os.environ['RLHF_TEST_CALLER_VAR'], "
            "os.environ['RLHF_TEST_EXTRA']]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(RLHF_TEST_EXTRA="set"),
                          capture_output=True, text=True, timeout=120)  # cwd: the checkout is not the directory
    assert proc.returncode == 0, proc.stderr[-3000:]
    value, init, caller_var, extra = json.loads(proc.stdout)
    assert value == 42 and (caller_var, extra) == ("kept", "set")
    assert init == str(ROOT / "rlhf_mcore" / "__init__.py")


def test_free_ports_are_drawn_below_the_ephemeral_range():
    """`launcher.free_port()` (the rendezvous of multi-"node" tests, picked before the launch binds it) draws from
    below the kernel's ephemeral range, where no outgoing connection or `bind(port 0)` lands, and different draws
    differ. Mutation: the kernel's pick (`bind(("127.0.0.1", 0))`) -> a port inside the range -> fails."""
    from pathlib import Path

    import launcher
    import pytest

    range_file = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not range_file.exists():
        pytest.skip("no ip_local_port_range on this system (not Linux)")
    low = int(range_file.read_text().split()[0])
    ports = {launcher.free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1
