"""tests/conftest.py's check that no test hides the GPUs from its pytest worker (a CPU engine in the pytest process
on a GPU machine: cpu_compat), run here on a pretend GPU machine in a child pytest."""
import subprocess
import sys
import textwrap
from pathlib import Path

from subprocess_env import child_env

CONFTEST = Path(__file__).with_name("conftest.py")


def test_the_test_that_hides_the_gpus_fails_by_name(tmp_path):
    """The test that turns cpu_compat on fails with the fix named; the tests after it in the same process do not
    (the GPU tests there fail on their own); a test that leaves it alone passes. The child imports this checkout
    (`child_env`: where the package is not installed, as on the GPU machine, it failed to import rlhf_mcore).
    Mutations: the check removed -> the first fails (it passes); its `not before` dropped -> the third fails (an
    error on every later test)."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import torch
        torch.cuda.is_available = lambda: True  # a GPU machine, as far as the check can tell
        exec(compile(open({str(CONFTEST)!r}).read(), {str(CONFTEST)!r}, "exec"))  # the project's, as if here
        """))
    (tmp_path / "test_order.py").write_text(textwrap.dedent("""
        def test_a_plain_one():
            pass

        def test_b_hides_the_gpus():
            from rlhf_mcore.parallel import cpu_compat
            cpu_compat._ENABLED = True  # what enable(hide_gpus=True) leaves behind

        def test_c_runs_after_it():
            pass
        """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-rA",
                           "-p", "no:xdist", str(tmp_path / "test_order.py")], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "PASSED test_order.py::test_a_plain_one" in out, out[-3000:]
    assert "ERROR test_order.py::test_b_hides_the_gpus" in out, out[-3000:]
    assert "hid the GPUs from the rest of its xdist worker" in out and "`cpu_only` fixture" in out, out[-3000:]
    assert "PASSED test_order.py::test_c_runs_after_it" in out, out[-3000:]
    assert "ERROR test_order.py::test_c_runs_after_it" not in out, out[-3000:]
