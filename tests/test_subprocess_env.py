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
