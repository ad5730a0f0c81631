"""Megatron-Core on CPU over gloo: a small GPTModel at TP=2, PP=2, DP=2 (2 processes) and TP=2×PP=2 (4 processes)
runs forward, backward and one optimizer step through get_forward_backward_func; the loss is identical on all TP
ranks and equal (1e-5) to a TP=1, PP=1 run of the same data and initial weights, before and after the update.

Each torchrun launch runs several layouts inside one process group (start-up dominates on 2 cores).
"""
import json
from pathlib import Path

import pytest
from launcher import CPU, run

pytestmark = pytest.mark.cost(50)

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "gpt_step.py"


def torchrun(nproc: int, layouts: str, out: Path) -> dict:
    # CPU fp32, what the tolerances are calibrated on (a GPU would build bf16)
    run(WORKER, "--out", str(out), "--layouts", layouts, nproc=nproc, env_extra={**CPU, "PYTHONWARNINGS": "ignore"})
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel")
    ref = torchrun(1, "1x1,1x1:tied", tmp / "w1.json")
    two = torchrun(2, "2x1,1x2,1x1,1x1:dist,2x1:dist,1x2:tied", tmp / "w2.json")
    four = torchrun(4, "2x2,2x2:dist,2x2:tied,1x2:dist", tmp / "w4.json")
    return ref, {"world2": two, "world4": four}


CASES = [
    ("world2", "2x1", "1x1"), ("world2", "1x2", "1x1"), ("world2", "1x1", "1x1"),
    ("world2", "1x1:dist", "1x1"), ("world2", "2x1:dist", "1x1"), ("world2", "1x2:tied", "1x1:tied"),
    ("world4", "2x2", "1x1"), ("world4", "2x2:dist", "1x1"), ("world4", "2x2:tied", "1x1:tied"),
    ("world4", "1x2:dist", "1x1"),
]


@pytest.mark.slow
@pytest.mark.parametrize("world,layout,reference", CASES)
def test_layout_matches_single_process(results, world, layout, reference):
    ref, runs = results
    got, want = runs[world][layout], ref[reference]
    assert got["update_ok"]
    assert len(set(got["tp_losses"])) == 1, f"TP ranks disagree: {got['tp_losses']}"
    assert got["loss0"] == pytest.approx(want["loss0"], abs=1e-5)
    assert got["loss1"] == pytest.approx(want["loss1"], abs=1e-5), "the optimizer step diverged from TP=1, PP=1"
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], abs=1e-5)
    assert got["loss1"] < got["loss0"]


def test_reference_run_learns(results):
    ref, _ = results
    assert ref["1x1"]["loss1"] < ref["1x1"]["loss0"]


# ------------------------------------------------------------------ which device a rank gets


@pytest.mark.parametrize("gpus,local_world,local_rank,requested,want", [
    (2, 2, 1, "auto", "cuda:1"),  # a GPU each
    (2, 4, 3, "auto", "cpu"),  # more processes than GPUs: every rank on the CPU (gloo), none past the last GPU
    (2, 4, 0, "auto", "cpu"),  # ... rank 0 included: the ranks agree on one backend
    (0, 1, 0, "auto", "cpu"),
    (1, 1, 0, "auto", "cuda:0"),
    (4, 2, 1, "cuda", "cuda:1"),
    (2, 2, 0, "cpu", "cpu"),
])
def test_pick_device_gives_each_rank_its_own_gpu_or_the_cpu(monkeypatch, gpus, local_world, local_rank, requested,
                                                             want):
    import torch

    from rlhf_mcore.parallel import pick_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert str(pick_device(requested)) == want


def test_pick_device_cuda_with_too_few_gpus_says_how_to_fix(monkeypatch):
    import torch

    from rlhf_mcore.parallel import pick_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(RuntimeError, match=r"4 processes on this node but 2 GPU.*nproc_per_node.*trainer.device=auto"):
        pick_device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        pick_device("cuda")
    with pytest.raises(ValueError, match="trainer.device='gpu'"):
        pick_device("gpu")
