"""`kernels/` stands alone: it imports nothing from the rest of `rlhf_mcore`, and `rlhf_mcore.kernels` (a symlink
to it) imports from a plain checkout on PYTHONPATH, without an install."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from subprocess_env import child_env

REPO = Path(__file__).resolve().parents[1]
KERNEL_MODULES = ("rlhf_mcore.kernels.logprob_reference", "rlhf_mcore.kernels.fused_logprob",
                  "rlhf_mcore.kernels.fused_layer")


def test_package_is_a_symlink_to_the_top_level_directory():
    link = REPO / "rlhf_mcore" / "kernels"
    assert link.is_symlink() and os.readlink(link) == "../kernels", "rlhf_mcore/kernels must link to ../kernels"
    assert link.resolve() == (REPO / "kernels").resolve()


def test_kernel_sources_import_nothing_from_rlhf_mcore():
    offenders = []
    sources = sorted((REPO / "kernels").glob("*.py"))
    assert len(sources) >= 3, sources
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                offenders += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                              if a.name.split(".")[0] == "rlhf_mcore"]
            elif isinstance(node, ast.ImportFrom):
                absolute = node.level == 0 and (node.module or "").split(".")[0] == "rlhf_mcore"
                if absolute or node.level > 1:  # level 2+ climbs out of the package into rlhf_mcore
                    offenders.append(f"{path.name}:{node.lineno} from {'.' * node.level}{node.module or ''} import")
    assert not offenders, offenders


def test_kernels_import_from_the_checkout_alone(tmp_path):
    """A fresh interpreter with the checkout first on PYTHONPATH (run from elsewhere, so the working directory
    adds nothing) imports the kernel modules from the checkout, and no rlhf_mcore module outside the kernels."""
    code = (f"import importlib, json, sys\n"
            f"files = [importlib.import_module(m).__file__ for m in {KERNEL_MODULES!r}]\n"
            f"print(json.dumps({{'files': files, 'modules': sorted(m for m in sys.modules "
            f"if m.split('.')[0] == 'rlhf_mcore')}}))\n")
    env = child_env(TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for file in report["files"]:
        assert Path(file).resolve().is_relative_to(REPO), f"{file} is not from the checkout {REPO}"
    # the package's __init__ installs rlhf_mcore.lazy_compile's import hook (torch-free, imports nothing of ours)
    others = [m for m in report["modules"]
              if m not in ("rlhf_mcore", "rlhf_mcore.lazy_compile") and not m.startswith("rlhf_mcore.kernels")]
    assert not others, f"importing the kernels pulled in {others}"
    assert set(KERNEL_MODULES) <= set(report["modules"])


def test_the_checkout_does_not_shadow_a_top_level_kernels_package(tmp_path):
    """`kernels/` is a namespace package (no __init__.py): with the checkout first on PYTHONPATH, a regular package
    named `kernels` later on the path is the one `import kernels` gives (Hugging Face's `kernels`, which transformers
    5.25 requires and imports: with an __init__.py here, every transformers model import failed with "cannot import
    name 'CUDAProperties' from 'kernels'"), while `rlhf_mcore.kernels` still comes from the checkout.

    Mutation: put back kernels/__init__.py -> fails (the fake's marker is not seen)."""
    assert not (REPO / "kernels" / "__init__.py").exists(), "kernels/ must stay a namespace package (kernels/README.md)"
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("MARK = 'the installed kernels'\n")
    code = ("import kernels, rlhf_mcore.kernels.logprob_reference as ref, json\n"
            "print(json.dumps({'mark': getattr(kernels, 'MARK', None), 'ref': ref.__file__}))\n")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(site)])  # the checkout first, the "installed" one after it
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["mark"] == "the installed kernels", report
    assert Path(report["ref"]).resolve().is_relative_to(REPO), report


def test_transformers_models_import_with_the_checkout_first_on_the_path(tmp_path):
    """Where Hugging Face's `kernels` is installed (transformers 5.25 requires it), a transformers model module imports
    in a process whose PYTHONPATH starts with the checkout, as every process the tests start has it."""
    from importlib import metadata

    try:
        metadata.version("kernels")
    except metadata.PackageNotFoundError:
        import pytest

        pytest.skip("Hugging Face's `kernels` is not installed here: nothing to shadow")
    proc = subprocess.run([sys.executable, "-c", "import transformers.models.qwen2.modeling_qwen2"], cwd=tmp_path,
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
