"""Every bad input a user can hand `launch/train.py` ends in one line naming the input, the problem and the fix,
exit code 2, no traceback, before any model is built (each case here takes a few seconds: imports only)."""
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from subprocess_env import child_env

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = ("config error:", "input error:", "reward error:", "error:")


def train(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    env = child_env(OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=cwd)


def assert_one_line(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(PREFIXES)]
    assert len(errors) == 1, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("bad_inputs")
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}}
            for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), root / "good.parquet")
    data = (root / "good.parquet").read_bytes()
    (root / "truncated.parquet").write_bytes(data[: len(data) // 2])
    pq.write_table(pa.Table.from_pylist(rows).slice(0, 0), root / "empty.parquet")
    (root / "a_file").write_text("not a directory")
    (root / "bad_reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None)\n"
                                        "    return 1.0\n")
    base = [f"actor_rollout_ref.model.path={tiny_model_dir('qwen2')}", f"data.train_files=[{root / 'good.parquet'}]",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=2", "trainer.device=cpu", f"trainer.default_local_dir={root / 'run'}"]
    return root, base


def test_learning_rate_below_zero(inputs):
    _, base = inputs
    assert_one_line(train(*base, "actor_rollout_ref.actor.optim.lr=-1"), "actor_rollout_ref.actor.optim.lr",
                    "-1.0", ">= 0")


def test_truncated_parquet(inputs):
    root, base = inputs
    assert_one_line(train(*base, f"data.train_files=[{root / 'truncated.parquet'}]"),
                    str(root / "truncated.parquet"), "not a readable parquet file", "truncated")


def test_parquet_with_no_rows(inputs):
    root, base = inputs
    assert_one_line(train(*base, f"data.train_files=[{root / 'empty.parquet'}]"), str(root / "empty.parquet"),
                    "has 0 rows")


def test_run_directory_under_a_regular_file(inputs):
    root, base = inputs
    assert_one_line(train(*base, f"trainer.default_local_dir={root / 'a_file' / 'run'}"),
                    "trainer.default_local_dir", str(root / "a_file"))


def test_reward_file_with_a_syntax_error(inputs):
    root, base = inputs
    assert_one_line(train(*base, f"custom_reward_function.path={root / 'bad_reward.py'}"), "reward error:",
                    str(root / "bad_reward.py"), "line 1")


def test_hub_id_as_model_path(inputs):
    _, base = inputs
    assert_one_line(train(*base, "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct"),
                    "Qwen/Qwen2.5-0.5B-Instruct", "Hugging Face Hub id", "--local-dir")


def test_truncated_safetensors_model(inputs, tiny_model_dir):
    import shutil

    root, base = inputs
    model = root / "truncated_model"
    shutil.copytree(tiny_model_dir("qwen2"), model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    assert_one_line(train(*base, f"actor_rollout_ref.model.path={model}"), "input error:", f"model file {weights}",
                    "is truncated", "re-download the model")
