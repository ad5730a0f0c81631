"""Shared pytest fixtures, and the order of the run.

`tiny_model_dir` builds tiny random Hugging Face model directories (see `rlhf_mcore.models.tiny`) once per
test session and argument set, so many tests can share one model without rebuilding it. Tests start the project's
scripts (plain or under torchrun) through tests/launcher.py; the `cost` mark orders the files (below).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Make the repository root importable (for `launch.*` scripts) however pytest is invoked.
_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

# One intra-op thread per test process (and, through the environment, per process a test starts). `make test` runs
# two xdist workers on CI's two cores: with torch's default of one thread per core, each worker's OpenMP threads
# spin against the other worker's, and small CPU ops slow down 20-80x (measured: the native engine's 64 samples of
# a tiny model, 0.45 s with one thread, 8-35 s with two while the other core was busy).
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

# The caches a test run writes go to one directory per run, which the process that made it removes when it exits:
# `datasets` keeps an arrow copy of every parquet file a test writes (~/.cache/huggingface/datasets had grown to
# 1.1 GB of entries never read again), and Inductor its compiled kernels (/tmp/torchinductor_<user>). CI runs on a
# machine whose disk other clones share; session 26's CI run failed its install with "No space left on device".
# xdist's workers inherit the directory from the controller through the environment: a worker's own exit handlers
# do not always run (two workers' directories were left behind).
if "_RLHF_MCORE_TEST_CACHES" not in os.environ:
    os.environ["_RLHF_MCORE_TEST_CACHES"] = tempfile.mkdtemp(prefix="rlhf_mcore_test_caches_")
    atexit.register(shutil.rmtree, os.environ["_RLHF_MCORE_TEST_CACHES"], ignore_errors=True)
os.environ["HF_DATASETS_CACHE"] = os.path.join(os.environ["_RLHF_MCORE_TEST_CACHES"], "hf_datasets")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(os.environ["_RLHF_MCORE_TEST_CACHES"], "torchinductor")
# Inductor's precompiled C++ header ignores TORCHINDUCTOR_CACHE_DIR: 155 MB in /tmp/torchinductor_<user> per venv
# path, one more for every clean clone. The one test that compiles CPU kernels ran 18 s without it, 22 s with it.
os.environ["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] = "0"
import torch  # noqa: E402

torch.set_num_threads(1)


# `make test` runs two pytest-xdist workers, one test file per worker at a time (--dist loadfile, and
# --no-loadscope-reorder so that xdist keeps this order). The files that take minutes carry a module-level
# `pytestmark = pytest.mark.cost(seconds)` (pyproject.toml registers it): about what the whole file takes on CI's two
# cores while the other worker runs too. They go first, the costliest first, so that the last files to start are
# short ones and both workers end together; unmarked files (seconds each) keep their order after them.


def file_cost(item) -> float:
    """The `cost` mark's seconds of the file `item` belongs to (0 without one)."""
    mark = item.get_closest_marker("cost")
    if mark is None:
        return 0.0
    if len(mark.args) != 1 or not isinstance(mark.args[0], (int, float)) or mark.kwargs:
        raise pytest.UsageError(f"{item.nodeid}: pytest.mark.cost takes one number, the file's seconds on CI "
                                f"(got args={mark.args} kwargs={mark.kwargs})")
    return float(mark.args[0])


def pytest_collection_modifyitems(config, items):
    cost: dict[str, float] = {}
    for item in items:
        path = str(item.fspath)
        cost[path] = max(cost.get(path, 0.0), file_cost(item))
    items.sort(key=lambda item: -cost[str(item.fspath)])  # stable: whole files stay together, in file order


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory fixture: `tiny_model_dir("qwen2", vocab=1000, ...) -> Path`, cached per argument set.

    Arguments are those of `rlhf_mcore.models.tiny.make_tiny_model` (without `out_dir`). The returned
    directory is shared across the session: treat it as read-only.
    """
    from rlhf_mcore.models.tiny import make_tiny_model

    cache: dict[tuple, Path] = {}

    def make(arch: str = "qwen2", **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny_{arch}")
            cache[key] = make_tiny_model(out, arch=arch, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def vla_llava(tmp_path_factory):
    """The tiny LLaVA the VLA tests train (16-pixel images, 4-pixel patches), built once per session; read-only."""
    from rlhf_mcore.models.vision.tiny import make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("vla_llava"), image_size=16, patch_size=4)


_CUDA_AT_START = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _gpus_stay_visible():
    """On a GPU machine, a test that runs a CPU engine in its own process (`init_distributed(device="cpu")`) hides
    the GPUs from its whole xdist worker (cpu_compat), and the GPU tests that worker runs next fail far from the
    cause (session 28: test_gpu_learning, test_kernel_fused_layer after test_fp8's CPU engine). Such a test fails
    here instead, by name; give it the `cpu_only` fixture."""
    def hidden() -> bool:
        compat = sys.modules.get("rlhf_mcore.parallel.cpu_compat")
        return compat is not None and getattr(compat, "_ENABLED", False)

    before = hidden()
    yield
    if _CUDA_AT_START and not before and hidden():
        pytest.fail("this test ran a CPU engine in the pytest process, which hid the GPUs from the rest of its xdist "
                    "worker (rlhf_mcore.parallel.cpu_compat): give it the `cpu_only` fixture (skipped with CUDA), or "
                    "run the CPU engine in a subprocess", pytrace=False)


@pytest.fixture(scope="module")
def cpu_state(cpu_only):
    """One process's CPU process groups (gloo, TP = PP = 1) for a module's in-process CPU engines; destroyed after
    the module."""
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    s = init_distributed(device="cpu")
    yield s
    destroy_distributed()


@pytest.fixture(scope="session")
def cpu_only():
    """For a test whose own process runs a CPU engine: on a GPU machine `cpu_compat` would hide the GPUs from the
    whole process, and from the GPU tests its xdist worker runs next. Skipped there (CI, without CUDA, runs it)."""
    if torch.cuda.is_available():
        pytest.skip("a CPU engine would hide the GPUs from this whole process (cpu_compat)")
