"""Shared pytest fixtures.

`tiny_model_dir` builds tiny random Hugging Face model directories (see `rlhf_mcore.models.tiny`) once per
test session and argument set, so many tests can share one model without rebuilding it.
"""

from __future__ import annotations

import os
import sys
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
import torch  # noqa: E402

torch.set_num_threads(1)


# `make test` runs two pytest-xdist workers, one test file per worker at a time (--dist loadfile, and
# --no-loadscope-reorder so that xdist keeps this order). The files that take minutes go first, so that the last files
# to start are short ones and both workers end together.
_HEAVY_FIRST = ("test_trainer.py", "test_async.py", "test_agent_learning.py", "test_models.py", "test_engine.py",
                "test_four_ranks.py", "test_train_rm.py", "test_checkpoint_faults.py", "test_agent_trainer.py",
                "test_sync.py", "test_process_lifetime.py", "test_demo.py", "test_parallel.py", "test_prime.py",
                "test_reward_stream.py", "test_reward_model.py", "test_benchmark.py", "test_torchrun_errors.py",
                "test_reward_faults.py", "test_rollout_sglang.py", "test_sglang_contract.py", "test_bad_inputs.py",
                "test_config.py", "test_slurm.py", "test_agent_tools.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable: file order kept


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
