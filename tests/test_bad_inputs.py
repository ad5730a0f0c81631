"""Every bad input a user can hand `launch/train.py` ends in one line naming the input, the problem and the fix,
exit code 2, no traceback, before any model is built (each case here takes a few seconds: imports only)."""
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from launcher import run

pytestmark = pytest.mark.cost(40)

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = ("config error:", "input error:", "reward error:", "error:")


def train(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return run("launch/train.py", *args, check=False, timeout=300, cwd=cwd)


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


def test_quantized_model(inputs, tiny_model_dir):
    """A checkpoint whose config.json announces a quantization (Qwen3-8B-FP8's layout): refused in one line, not
    loaded as if its codes were the weights. Mutation: `UnsupportedModelError` a plain ValueError again (as it was:
    an unsupported architecture ended in a traceback) -> fails, exit 1 with a traceback."""
    import json
    import shutil

    root, base = inputs
    model = root / "fp8_model"
    shutil.copytree(tiny_model_dir("qwen2"), model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (model / "config.json").write_text(json.dumps(cfg))
    assert_one_line(train(*base, f"actor_rollout_ref.model.path={model}"), "input error:", "quantization_config",
                    "quant_method 'fp8'", "unquantized (bf16) checkpoint")


def test_weights_the_config_does_not_describe(inputs, tiny_model_dir):
    """A Qwen2 checkpoint holding a q_norm its config does not announce: one line naming the tensor. Mutation: the
    loader raising a plain ValueError there -> fails, exit 1 with a traceback."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    root, base = inputs
    model = root / "extra_tensor_model"
    shutil.copytree(tiny_model_dir("qwen2"), model)
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    assert_one_line(train(*base, f"actor_rollout_ref.model.path={model}"), "input error:",
                    "model.layers.0.self_attn.q_norm.weight", "belong to no parameter", "architectures")


def test_weights_missing_a_tensor_the_config_needs(inputs, tiny_model_dir):
    """An untied model's checkpoint without its `lm_head.weight`: one line naming the tensor and the directory.
    Mutation: the loader's missing-tensor error a KeyError again (as it was) -> fails, exit 1 with a traceback."""
    import shutil

    from safetensors.torch import load_file, save_file

    root, base = inputs
    model = root / "no_head_model"
    shutil.copytree(tiny_model_dir("qwen2", tie_word_embeddings=False), model)
    tensors = load_file(str(model / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    assert_one_line(train(*base, f"actor_rollout_ref.model.path={model}"), "input error:", "'lm_head.weight'",
                    f"not in the checkpoint {model}", "right model directory")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # chat_template.jinja stays: the case reported


def copy_without_tokenizer(src: Path, dst: Path) -> Path:
    """The model directory `src` with its weights and config but none of its tokenizer files."""
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    assert (dst / "config.json").is_file() and not (dst / "tokenizer.json").exists()
    return dst


def test_model_without_tokenizer_files(inputs, tiny_model_dir):
    """train.py: transformers builds an empty-vocabulary tokenizer from such a directory (it does not raise), and
    the run used to die in a rank traceback ("prompt_ids is empty"). Now: one line naming the directory and the
    missing files. Mutation: return the tokenizer unchecked in `models.tokenizer.load_tokenizer` -> fails."""
    root, base = inputs
    model = copy_without_tokenizer(tiny_model_dir("qwen2"), root / "no_tokenizer_model")
    assert_one_line(train(*base, f"actor_rollout_ref.model.path={model}"), "input error:",
                    f"actor_rollout_ref.model.path='{model}'", "no usable tokenizer", "tokenizer.json",
                    "tokenizer_config.json")


def test_sft_model_without_tokenizer_files(tmp_path, tiny_model_dir):
    """launch/sft.py's body (run_sft) refuses the same directory before any process group is made, with the same
    one-line error (report_user_errors prints it). Mutation: return the tokenizer unchecked in `load_tokenizer` (the
    old path: the run died in the loss, "empty prompt") -> fails."""
    from rlhf_mcore.models.tokenizer import TokenizerFileError
    from rlhf_mcore.trainer.sft import run_sft

    model = copy_without_tokenizer(tiny_model_dir("qwen2"), tmp_path / "no_tokenizer_model")
    rows = [{"prompt": [{"role": "user", "content": f"What is {i}?"}], "response": str(i)} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    with pytest.raises(TokenizerFileError, match=r"--model='.*no_tokenizer_model' has no usable tokenizer "
                                                 r"\(missing tokenizer.json, tokenizer_config.json"):
        run_sft(str(model), str(tmp_path / "rows.parquet"), str(tmp_path / "out"), steps=1, batch_size=2, lr=1e-5,
                max_length=64, overrides=["trainer.device=cpu"])
    assert not (tmp_path / "out").exists()  # refused before the run lock / output directory


CONVERT_CASES = r"""
import contextlib, io, json, runpy, sys
out = []
for argv in json.loads(sys.argv[1]):
    sys.argv, err = ["launch/convert_checkpoint.py", *argv], io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path("launch/convert_checkpoint.py", run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code
    out.append({"code": code, "err": err.getvalue(), "megatron": any(m.startswith("megatron") for m in sys.modules)})
print(json.dumps(out))
"""


def test_convert_checkpoint_missing_directories(tmp_path):
    """launch/convert_checkpoint.py with a directory that does not exist says so, naming the flag, for either
    direction, before megatron is imported (mcore2hf used to say "no config.json in <dir>/hf_meta" after setting
    up the process group). The cases run in one process (one torch import). Mutation: drop the
    `check_input_dirs(args)` call in `convert` -> fails."""
    import json

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "a_file").write_text("x")
    missing, out = tmp_path / "missing", tmp_path / "out"
    cases = [
        (["--direction", "mcore2hf", "--mcore-dir", str(missing), "--out-hf-dir", str(out)], f"--mcore-dir {missing}"),
        (["--direction", "hf2mcore", "--hf-dir", str(missing), "--mcore-dir", str(out)], f"--hf-dir {missing}"),
        (["--direction", "mcore2hf", "--mcore-dir", str(tmp_path / "ckpt"), "--hf-dir", str(missing),
          "--out-hf-dir", str(out)], f"--hf-dir {missing}"),
        (["--direction", "mcore2hf", "--mcore-dir", str(tmp_path / "a_file"), "--out-hf-dir", str(out)],
         f"--mcore-dir {tmp_path / 'a_file'}: not a directory"),
    ]
    proc = subprocess.run([sys.executable, "-c", CONVERT_CASES, json.dumps([argv for argv, _ in cases])], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (argv, fragment), got in zip(cases, json.loads(proc.stdout.strip().splitlines()[-1]), strict=True):
        lines = got["err"].strip().splitlines()
        assert got["code"] == 2 and len(lines) == 1 and "Traceback" not in got["err"], (argv, got)
        assert lines[0].startswith(f"input error: {fragment}"), (fragment, lines[0])
        if "not a directory" not in fragment:
            assert "the directory does not exist" in lines[0], lines[0]
    assert not got["megatron"]  # all four refused before megatron was imported
    assert not out.exists()
