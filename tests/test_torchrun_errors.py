"""A bad input under `torchrun --nproc_per_node=2` ends in ONE line of ours (rank 0's `<kind>: <message>`), a
non-zero exit, and no traceback from our code: torchrun's own failure summary (its ChildFailedError traceback)
is the only traceback in the output. Each case is one torchrun launch (about ten seconds on CPU)."""
import re
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from launcher import CPU, run

pytestmark = pytest.mark.cost(30)

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = ("config error:", "input error:", "reward error:", "error:")
OUR_FRAME = re.compile(r'File "[^"]*(/rlhf_mcore/|/launch/)')


def torchrun(script: str, *args: str) -> subprocess.CompletedProcess:
    # CPU fp32, what the tolerances are calibrated on (a GPU would build bf16)
    return run(f"launch/{script}", *args, nproc=2, check=False, env_extra={**CPU, "PYTHONWARNINGS": "ignore"},
               zygote=False)  # torchrun itself: what a user launches


def assert_one_clean_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    ours = [line for line in out.splitlines() if line.startswith(PREFIXES)]
    assert len(ours) == 1, out[-4000:]
    assert not OUR_FRAME.search(out), out[-4000:]
    assert out.count("Traceback") <= 1, out[-4000:]  # torchrun's ChildFailedError, nothing of ours
    assert not re.search(r"^\[rank \d+\]", out, re.M), out[-3000:]  # rank 0 reported it; no other rank had to
    for fragment in fragments:
        assert fragment in ours[0], (fragment, ours[0])
    return ours[0]


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    """A 3-layer model, and copies of the tiny model with a truncated / garbage-filled model.safetensors."""
    root = tmp_path_factory.mktemp("torchrun_errors")
    three = tiny_model_dir("qwen2", layers=3)
    src = tiny_model_dir("qwen2")
    out = {"three": three}
    for name in ("truncated", "garbage"):
        d = root / name
        shutil.copytree(src, d)
        weights = d / "model.safetensors"
        data = weights.read_bytes()
        garbage = (bytes(range(256)) * (len(data) // 256 + 1))[: len(data)]
        weights.write_bytes(data[: len(data) * 2 // 3] if name == "truncated" else garbage)
        out[name] = d
    return out


@pytest.mark.slow
def test_convert_with_stage_sizes_that_do_not_add_up(models, tmp_path):
    line = assert_one_clean_line(
        torchrun("convert_checkpoint.py", "--direction", "hf2mcore", "--hf-dir", str(models["three"]),
                 "--mcore-dir", str(tmp_path / "out"), "--tp", "1", "--pp", "2",
                 "--num-layers-in-first-pipeline-stage", "2", "--num-layers-in-last-pipeline-stage", "2"),
        "config error:", "--pp 2", "3-layer model", "must add up to the model's 3 layers",
        "num_layers_in_first_pipeline_stage=2 and num_layers_in_last_pipeline_stage=1")
    assert str(models["three"]) in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_convert_without_hf_dir(tmp_path):
    assert_one_clean_line(
        torchrun("convert_checkpoint.py", "--direction", "hf2mcore", "--mcore-dir", str(tmp_path / "out"),
                 "--pp", "2"),
        "config error:", "--direction hf2mcore needs --hf-dir")


@pytest.mark.slow
def test_convert_a_truncated_safetensors_file(models, tmp_path):
    weights = models["truncated"] / "model.safetensors"
    assert_one_clean_line(
        torchrun("convert_checkpoint.py", "--direction", "hf2mcore", "--hf-dir", str(models["truncated"]),
                 "--mcore-dir", str(tmp_path / "out"), "--tp", "1", "--pp", "2"),
        "input error:", f"model file {weights}", "truncated", "re-download the model")


@pytest.mark.slow
def test_train_with_a_corrupt_safetensors_file(models, tmp_path):
    """Every rank meets the file in the HF loader (after the process groups exist) and stops there."""
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}}
            for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    weights = models["garbage"] / "model.safetensors"
    assert_one_clean_line(
        torchrun("train.py", f"actor_rollout_ref.model.path={models['garbage']}",
                 f"data.train_files=[{tmp_path / 'train.parquet'}]", "data.train_batch_size=4",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                 "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "trainer.device=cpu",
                 f"trainer.default_local_dir={tmp_path / 'run'}"),
        "input error:", f"model file {weights}", "not a safetensors file", "re-download the model")
