"""setup.py declares every file the package ships: each tracked file under rlhf_mcore/ is a module of a listed
package or matches that package's package_data (an undeclared data directory made setuptools print ~40 lines of
"Package ... is absent from the `packages` configuration" on every `make install`, issue 32)."""
import fnmatch
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_shipped_file_is_declared(monkeypatch):
    """Mutation: drop DATA_PACKAGES from `packages` in setup.py -> fails; drop "LICENSE" from package_data ->
    fails."""
    from distutils.core import run_setup

    monkeypatch.chdir(ROOT)  # find_packages looks from the current directory
    dist = run_setup(str(ROOT / "setup.py"), stop_after="init")
    tracked = subprocess.run(["git", "ls-files", "rlhf_mcore", "kernels"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    files = [f.replace("kernels/", "rlhf_mcore/kernels/", 1) if f.startswith("kernels/") else f for f in tracked
             if f != "rlhf_mcore/kernels"]  # rlhf_mcore/kernels is a symlink to kernels/
    data = [f for f in files if not f.endswith(".py")]
    assert "rlhf_mcore/data/raw/gsm8k/train.jsonl" in data  # the vendored GSM8K copy the tiny models train on
    for f in files:
        package = str(Path(f).parent).replace("/", ".")
        assert package in dist.packages, (f, package)
        if f in data:
            globs = dist.package_data.get(package, [])
            assert any(fnmatch.fnmatch(Path(f).name, g) for g in globs), (f, package, globs)
