"""Config loading, overrides and every class of error message (content asserted), plus the CLI contract:
a bad config ends with the message (no traceback) and a non-zero exit; --print-config prints and exits 0."""
import copy
import functools
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from launcher import env as child_env
from launcher import run

from rlhf_mcore.config import ConfigError, critic_enabled, load_config, reference_enabled, to_dict, validate_config

pytestmark = pytest.mark.cost(25)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["actor_rollout_ref.model.path=/models/m"]

# veRL's quickstart command (docs: "Quickstart: PPO training on GSM8K"), minus the python entry point.
VERL_QUICKSTART = """
data.train_files=/d/gsm8k/train.parquet data.val_files=/d/gsm8k/test.parquet data.train_batch_size=256
data.max_prompt_length=512 data.max_response_length=512 actor_rollout_ref.model.path=/m/Qwen2.5-0.5B-Instruct
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=64
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.4
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 critic.optim.lr=1e-5
critic.model.path=/m/Qwen2.5-0.5B-Instruct critic.ppo_micro_batch_size_per_gpu=4 algorithm.kl_ctrl.kl_coef=0.001
trainer.logger=console trainer.val_before_train=False trainer.n_gpus_per_node=1 trainer.nnodes=1
trainer.save_freq=10 trainer.test_freq=10 trainer.total_epochs=15
""".split()


def write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_defaults_and_overrides_precedence(tmp_path):
    p = write(tmp_path, """
        data:
          train_batch_size: 64
          max_prompt_length: 100
        trainer:
          logger: tensorboard
    """)
    cfg = load_config(p, MODEL + ["data.train_batch_size=32", "actor_rollout_ref.actor.optim.lr=3e-6"])
    assert cfg.data.train_batch_size == 32  # command line beats YAML
    assert cfg.data.max_prompt_length == 100  # YAML beats defaults
    assert cfg.data.max_response_length == 512  # schema default
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-6)
    assert cfg.trainer.logger == ["tensorboard"]  # a scalar stands for a one-element list


def test_verl_quickstart_translates_one_to_one():
    cfg = load_config(None, VERL_QUICKSTART)
    assert cfg.data.train_batch_size == 256
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4
    assert cfg.critic.optim.lr == pytest.approx(1e-5)
    assert cfg.algorithm.kl_ctrl.kl_coef == pytest.approx(0.001)
    assert cfg.trainer.logger == ["console"] and cfg.trainer.val_before_train is False
    assert critic_enabled(cfg) and not reference_enabled(cfg)
    validate_config(cfg, world_size=1, model_max_positions=32768)


def test_shipped_configs_load_and_validate():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path, [])
        world = (cfg.trainer.nnodes or 1) * (cfg.trainer.n_gpus_per_node or 1)
        if cfg.async_training.mode != "off":  # the rollout pool is launched too
            world += (cfg.rollout.nnodes or 1) * cfg.rollout.n_gpus_per_node
        validate_config(cfg, world_size=world)


def test_offload_is_opt_in_small_configs_keep_everything_on_the_gpu():
    """veRL's megatron.*_offload flags decide what leaves the GPU around generation: the 0.5B configs move
    nothing (it fits with room to spare), the 7B 8-GPU config moves the actor's params, grads and optimizer."""
    def flags(m):
        return (m.param_offload, m.grad_offload, m.optimizer_offload)

    assert flags(load_config(None, MODEL).actor_rollout_ref.actor.megatron) == (False, False, False)
    for name in ("gsm8k_ppo_qwen2.5_0.5b.yaml", "gsm8k_grpo_qwen2.5_0.5b.yaml"):
        cfg = load_config(ROOT / "configs" / name, [])
        for m in (cfg.actor_rollout_ref.actor.megatron, cfg.actor_rollout_ref.ref.megatron, cfg.critic.megatron):
            assert flags(m) == (False, False, False), name
    cfg = load_config(ROOT / "configs" / "gsm8k_grpo_qwen2.5_7b_8gpu.yaml", [])
    assert flags(cfg.actor_rollout_ref.actor.megatron) == (True, True, True)


@pytest.mark.parametrize("override,fragments", [
    ("data.train_batchsize=4", ["unknown config key 'data.train_batchsize'", "section 'data'",
                                "Did you mean 'data.train_batch_size'"]),
    ("actor_rollout_ref.actor.ppo_mini_bach_size=2", ["'actor_rollout_ref.actor'",
                                                      "'actor_rollout_ref.actor.ppo_mini_batch_size'"]),
    ("algorithm.kl_ctrl.kl_cof=0.1", ["Did you mean 'algorithm.kl_ctrl.kl_coef'"]),
    ("tranier.total_epochs=2", ["section '<top level>'", "'trainer'"]),
])
def test_unknown_key_on_command_line(override, fragments):
    with pytest.raises(ConfigError) as e:
        load_config(None, MODEL + [override])
    for f in fragments:
        assert f in str(e.value)


def test_unknown_key_in_yaml(tmp_path):
    p = write(tmp_path, """
        actor_rollout_ref:
          rollout:
            temprature: 0.7
    """)
    with pytest.raises(ConfigError) as e:
        load_config(p, MODEL)
    msg = str(e.value)
    assert "actor_rollout_ref.rollout.temprature" in msg and "actor_rollout_ref.rollout.temperature" in msg


@pytest.mark.parametrize("override,key,value,typename", [
    ("data.train_batch_size=abc", "data.train_batch_size", "'abc'", "int"),
    ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr", "'fast'", "float"),
    ("trainer.val_before_train=maybe", "trainer.val_before_train", "'maybe'", "bool"),
])
def test_wrong_type_names_key_value_and_type(override, key, value, typename):
    with pytest.raises(ConfigError) as e:
        load_config(None, MODEL + [override])
    msg = str(e.value)
    assert f"'{key}'" in msg and value in msg and f"valid {typename}" in msg


def test_a_bad_trace_setting_is_one_line_with_the_key_the_value_and_the_fix(tmp_path):
    """trainer.trace takes a bool or a file's path: a number (OmegaConf's Union type error), null, an empty string,
    an existing directory or a path ending in '/' are refused in one line saying what it must be. Mutations: the
    loader's Union case removed from `_omegaconf_message` ("which is not a valid Union") -> fails; `_trace_setting`
    without its directory check -> fails."""
    for value in ["1", "null", "''", str(tmp_path), f"{tmp_path}/trace/"]:
        with pytest.raises(ConfigError) as e:
            load_config(None, MODEL + [f"trainer.trace={value}"])
        msg = str(e.value)
        assert msg.startswith("config key 'trainer.trace' has value ") and "\n" not in msg, msg
        assert msg.endswith("; it must be true (writes <default_local_dir>/trace.json), false (no trace) or the path "
                            "of the JSON file to write (not a directory), e.g. trainer.trace=/runs/a/trace.json."), msg
    for good, want in (("true", True), ("false", False), (str(tmp_path / "t.json"), str(tmp_path / "t.json"))):
        assert load_config(None, MODEL + [f"trainer.trace={good}"]).trainer.trace == want


def test_wrong_type_in_yaml(tmp_path):
    p = write(tmp_path, "data:\n  max_prompt_length: long\n")
    with pytest.raises(ConfigError, match=r"'data.max_prompt_length' has value 'long'.*valid int"):
        load_config(p, MODEL)


def test_bad_choice_and_missing_model_and_section_value():
    with pytest.raises(ConfigError, match=r"data.truncation.*'lft'.*Did you mean 'left'"):
        load_config(None, MODEL + ["data.truncation=lft"])
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref.model.path' must be set"):
        load_config(None, [])
    with pytest.raises(ConfigError, match=r"'algorithm.kl_ctrl' is a section"):
        load_config(None, MODEL + ["algorithm.kl_ctrl=3"])
    with pytest.raises(ConfigError, match=r"not of the form key=value"):
        load_config(None, MODEL + ["data.train_batch_size"])


def layout(*extra):
    return load_config(None, MODEL + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                      "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                                      *extra])


def test_cross_field_checks_say_what_to_change():
    validate_config(layout(), world_size=4)
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by TP×PP = 2×2 = 4"):
        validate_config(layout("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                               "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"), world_size=6)
    with pytest.raises(ConfigError, match=r"train_batch_size=64 is not divisible by "
                                          r"actor_rollout_ref.actor.ppo_mini_batch_size=24"):
        validate_config(layout("actor_rollout_ref.actor.ppo_mini_batch_size=24"), world_size=1)
    with pytest.raises(ConfigError, match=r"ppo_mini_batch_size=16 \(prompts\) is not divisible by the "
                                          r"data-parallel size 32"):
        validate_config(layout("data.train_batch_size=64"), world_size=32)
    with pytest.raises(ConfigError, match=r"16 prompts × rollout.n 1 / DP 1 = 16 sequences per rank, not "
                                          r"divisible by ppo_micro_batch_size_per_gpu=5"):
        validate_config(layout("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"), world_size=1)
    with pytest.raises(ConfigError, match=r"512 \+ 600 = 1112 exceeds the model's context of 1024"):
        validate_config(layout("data.max_response_length=600"), world_size=1, model_max_positions=1024)
    with pytest.raises(ConfigError, match=r"critic.megatron.tensor_model_parallel_size' is 2 but the actor's is 1"):
        validate_config(layout("critic.megatron.tensor_model_parallel_size=2"), world_size=2)
    with pytest.raises(ConfigError, match=r"adv_estimator='grpoo' is not registered.*grpo"):
        validate_config(layout("algorithm.adv_estimator=grpoo"), world_size=1)
    with pytest.raises(ConfigError, match=r"needs a critic"):
        validate_config(layout("critic.enable=false"), world_size=1)
    with pytest.raises(ConfigError, match=r"rollout.sleep_level must be 1 \(free the KV cache\) or 2 .*got 3"):
        validate_config(layout("actor_rollout_ref.rollout.sleep_level=3"), world_size=1)
    with pytest.raises(ConfigError, match=r"sleep_level=2 releases .* set free_cache_engine=true or sleep_level=1"):
        validate_config(layout("actor_rollout_ref.rollout.sleep_level=2",
                               "actor_rollout_ref.rollout.free_cache_engine=false"), world_size=1)
    validate_config(layout("actor_rollout_ref.rollout.sleep_level=2"), world_size=1)


def test_grpo_needs_no_critic_and_kl_loss_needs_reference():
    cfg = layout("algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true",
                 "actor_rollout_ref.rollout.n=4")
    assert not critic_enabled(cfg) and reference_enabled(cfg)
    validate_config(cfg, world_size=2)


def run_cli(*args, env_extra=None):
    return run("launch/train.py", *args, check=False, timeout=120, env_extra=env_extra)


def test_cli_print_config_and_clean_errors(tmp_path):
    ok = run_cli("--config", str(ROOT / "configs" / "gsm8k_ppo_qwen2.5_0.5b.yaml"), "--print-config",
                 "data.train_batch_size=128")
    assert ok.returncode == 0, ok.stderr
    assert "train_batch_size: 128" in ok.stdout and "adv_estimator: gae" in ok.stdout

    bad = run_cli("--config", str(ROOT / "configs" / "gsm8k_ppo_qwen2.5_0.5b.yaml"), "data.train_bach_size=1")
    assert bad.returncode != 0
    assert "Did you mean 'data.train_batch_size'" in bad.stderr and "Traceback" not in bad.stderr

    p = write(tmp_path, "data:\n  train_batch_size: 100\nactor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 64\n")
    bad = run_cli("--config", str(p), *MODEL, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "data.train_batch_size=100 is not divisible by actor_rollout_ref.actor.ppo_mini_batch_size=64" in bad.stderr

    bad = run_cli("--config", str(tmp_path / "nope.yaml"))
    assert bad.returncode != 0 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr

    layout_bad = run_cli("--config", str(ROOT / "configs" / "gsm8k_ppo_qwen2.5_0.5b.yaml"),
                         "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=3",
                         env_extra={"WORLD_SIZE": "3"})
    assert layout_bad.returncode != 0 and "world size 3 is not divisible" in layout_bad.stderr
    # veRL's layout keys must match what torchrun launched (the config says 1 GPU; 3 processes were started)
    world_bad = run_cli("--config", str(ROOT / "configs" / "gsm8k_ppo_qwen2.5_0.5b.yaml"),
                        env_extra={"WORLD_SIZE": "3"})
    assert world_bad.returncode == 2 and "Traceback" not in world_bad.stderr
    assert "3 were launched" in world_bad.stderr and "torchrun --nnodes=1 --nproc_per_node=1" in world_bad.stderr


# One plain `python` process runs launch/train.py --print-config on every config (one interpreter start for all of
# them), recording each run's exit code, output and the files it opened (the audit hook's `open` events, raised
# before the open: a missing file counts).
PRINT_ALL = r"""
import contextlib, io, json, os, runpy, sys
train, out_path, configs = sys.argv[1], sys.argv[2], sys.argv[3:]
opened = []
sys.addaudithook(lambda event, args: opened.append(os.path.abspath(os.fsdecode(args[0])))
                 if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) else None)
results = {}
for path in configs:
    out, err, code = io.StringIO(), io.StringIO(), None
    opened.clear()
    sys.argv = [train, "--config", path, "--print-config"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(train, run_name="__main__")
        except SystemExit as e:
            code = e.code
    results[path] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "opened": list(opened)}
heavy = ("torch", "megatron", "transformers", "rlhf_mcore.engine", "rlhf_mcore.rollout", "rlhf_mcore.trainer")
results["imported"] = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))
with open(out_path, "w") as f:
    json.dump(results, f)
"""
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))
ALIASES = {"reward_model": "reward.reward_model", "custom_reward_function": "reward.custom_reward_function"}


@pytest.fixture(scope="module")
def printed_configs(tmp_path_factory):
    out = tmp_path_factory.mktemp("print_config") / "printed.json"
    env = child_env()  # a plain `python`, not torchrun: no distributed variables
    proc = subprocess.run([sys.executable, "-c", PRINT_ALL, str(ROOT / "launch" / "train.py"), str(out),
                           *map(str, SHIPPED)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _leaves(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_prints_in_one_plain_process(printed_configs, path):
    """`python launch/train.py --config X --print-config` exits 0 for every file in configs/, without torchrun
    (configs that name 2 or 8 processes included), prints YAML holding the file's every key with its value
    (veRL's top-level aliases under `reward.`), and opens no model or data file (the paths need not exist).

    Mutation: validate_config(cfg, world_size_from_env(), ...) under --print-config -> fails (demo_cpu and 3 more:
    "2 processes, but 1 were launched"); read_model=True there -> fails (<model>/config.json opened)."""
    from omegaconf import OmegaConf

    r = printed_configs[str(path)]
    assert r["code"] == 0, r["stderr"]
    printed = OmegaConf.to_container(OmegaConf.create(r["stdout"]))
    assert printed == to_dict(load_config(path, []))
    for key, value in _leaves(OmegaConf.to_container(OmegaConf.load(path))):
        head, _, rest = key.partition(".")
        node = printed
        for part in f"{ALIASES.get(head, head)}.{rest}".split("."):
            node = node[part]
        assert node == value or node == [value], (key, value, node)
    models = [Path(ROOT, v).resolve() for k, v in _leaves(printed) if k.endswith("model.path") and v]
    data = {Path(ROOT, f).resolve() for f in printed["data"]["train_files"] + printed["data"]["val_files"]}
    assert models and (data or printed["vla"]["enable"])  # a VLA run reads no data files (its env makes the states)
    for f in map(Path, r["opened"]):
        assert f not in data and not any(f == m or m in f.parents for m in models), f


def test_print_config_imports_no_torch_or_engine(printed_configs):
    """`launch/train.py --print-config` on every shipped config, in one process, imports neither torch nor megatron,
    transformers, an engine or the trainer. Mutation: `import torch` at the top of rlhf_mcore/cli.py -> fails."""
    assert printed_configs["imported"] == []


def test_print_config_needs_no_launch_but_launching_checks_the_world(tmp_path, monkeypatch):
    """The launch-layout check belongs to launching: demo_cpu.yaml (2 processes) prints under one process and is
    refused when launched as one; the model's config.json is read at launch only (its context is too short here).

    Mutation: drop the `nodes * per_node == world_size` check in validate_config -> fails."""
    from rlhf_mcore.cli import load_and_validate, parse_args

    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    demo = str(ROOT / "configs" / "demo_cpu.yaml")
    assert load_and_validate(parse_args(["--config", demo, "--print-config"])).trainer.n_gpus_per_node == 2
    with pytest.raises(ConfigError, match=r"trainer.nnodes=1 x trainer.n_gpus_per_node=2 = 2 processes, but 1 were "
                                          r"launched: launch with `torchrun --nnodes=1 --nproc_per_node=2"):
        load_and_validate(parse_args(["--config", demo]))
    model = tmp_path / "short_model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 16, "num_hidden_layers": 2}))
    args = ["--config", demo, f"actor_rollout_ref.model.path={model}"]
    load_and_validate(parse_args([*args, "--print-config"]))  # the model is not read
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"exceeds the model's context of 16 tokens"):
        load_and_validate(parse_args(args))


@pytest.mark.parametrize("config, overrides, world", [
    ("demo_cpu.yaml", [], 2),  # trainer.nnodes x trainer.n_gpus_per_node
    ("demo_async_cpu.yaml", [], 3),  # a training pool of 2 and a rollout pool of 1
    ("gsm8k_grpo_qwen2.5_7b_8gpu.yaml", [], 8),
    (None, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"], 2),  # no layout keys: TP x PP
    (None, ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4"], 4),  # ... and the colocated rollout's TP
    (None, ["trainer.nnodes=4", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"], 4),
])
def test_print_config_checks_the_layout_the_config_names(config, overrides, world):
    """--print-config validates at the world the config names, or the fewest processes its layout fits.

    Mutation: config_world_size returns 1 where the config names no layout -> fails (and --print-config then
    refuses the TP=2 config: world size 1 is not divisible by TP x PP)."""
    from rlhf_mcore.cli import config_world_size, load_and_validate, parse_args

    argv = (["--config", str(ROOT / "configs" / config)] if config else
            MODEL + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]) + overrides
    args = parse_args([*argv, "--print-config"])
    assert config_world_size(load_config(args.config, args.overrides)) == world
    load_and_validate(args)  # validated at that world


def test_verl_top_level_reward_sections_are_aliases(tmp_path):
    """veRL writes `reward_model.*` and `custom_reward_function.*` at the top level; both land under `reward`."""
    cfg = load_config(None, VERL_QUICKSTART + [
        "reward_model.enable=False", "custom_reward_function.path=/r/my.py", "custom_reward_function.name=score",
        "reward_model.reward_manager=naive"])
    assert cfg.reward.custom_reward_function.path == "/r/my.py" and cfg.reward.custom_reward_function.name == "score"
    assert cfg.reward.reward_model.enable is False
    validate_config(cfg, world_size=1, model_max_positions=32768)
    p = write(tmp_path, """
        custom_reward_function:
          path: /r/other.py
    """)
    assert load_config(p, MODEL).reward.custom_reward_function.path == "/r/other.py"
    p = write(tmp_path, """
        custom_reward_function:
          path: /r/a.py
        reward:
          custom_reward_function:
            path: /r/b.py
    """)
    with pytest.raises(ConfigError, match="sets both 'custom_reward_function' and 'reward.custom_reward_function'"):
        load_config(p, MODEL)


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.optim.lr=-1", r"optim.lr' has value -1.0; it must be >= 0"),
    ("critic.optim.betas=[0.9,1.5]", r"critic.optim.betas' .* two numbers in \[0, 1\)"),
    ("actor_rollout_ref.actor.clip_ratio=1.5", r"clip_ratio' has value 1.5; it must be in \(0, 1\)"),
    ("actor_rollout_ref.actor.clip_ratio_high=-0.1", r"clip_ratio_high' has value -0.1"),
    ("actor_rollout_ref.rollout.temperature=-0.5", r"rollout.temperature' has value -0.5; it must be >= 0"),
    ("actor_rollout_ref.rollout.top_p=0", r"rollout.top_p' has value 0.0; it must be in \(0, 1\]"),
    ("actor_rollout_ref.rollout.top_k=0", r"rollout.top_k' has value 0; it must be -1 \(off\) or > 0"),
    ("algorithm.gamma=1.5", r"algorithm.gamma' has value 1.5"),
    ("reward.timeout_s=0", r"reward.timeout_s' has value 0.0; it must be > 0"),
    ("data.val_batch_size=0", r"data.val_batch_size' has value 0"),
    ("actor_rollout_ref.model.trust_remote_code=true", r"never runs a model repository's Python"),
    ("reward.reward_model.enable=true", r"reward.reward_model.model.path' has value None; it must be set with"),
    ("reward_model.enable=true", r"reward.reward_model.model.path' has value None; it must be set with"),
    ("actor_rollout_ref.rollout.mode=async", r"rollout.mode' has value 'async'; choose one of sync"),
    ("actor_rollout_ref.rollout.response_length=300", r"equal to data.max_response_length \(512\)"),
    ("actor_rollout_ref.rollout.load_format=dummy_dtensor", r"does not apply to rlhf_mcore: the rollout engine always"),
    ("actor_rollout_ref.rollout.decode_steps_per_launch=0", r"decode_steps_per_launch' has value 0; it must be unset"),
])
def test_single_key_values_are_checked_at_load(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, MODEL + [override])


def test_accepted_values_of_the_checked_keys_load():
    cfg = load_config(None, MODEL + ["actor_rollout_ref.rollout.response_length=512", "data.val_batch_size=8",
                                     "actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.rollout.top_k=50",
                                     "actor_rollout_ref.rollout.decode_steps_per_launch=4"])
    assert cfg.data.val_batch_size == 8 and cfg.actor_rollout_ref.rollout.response_length == 512
    assert cfg.actor_rollout_ref.rollout.decode_steps_per_launch == 4


def test_decode_steps_per_launch_is_the_native_engines_and_reaches_it(tiny_model_dir):
    """Refused with another rollout engine (the key, the value, the fix); with the native one it reaches the engine
    the trainer builds. Mutation: build_rollout not passing it -> the engine keeps its default 1, fails."""
    from types import SimpleNamespace

    import torch

    from rlhf_mcore.trainer.roles import build_rollout

    with pytest.raises(ConfigError, match=r"decode_steps_per_launch' has value 4; it must be unset with "
                                          r"rollout.name=hf.*rollout.name=native"):
        load_config(None, MODEL + ["actor_rollout_ref.rollout.name=hf",
                                   "actor_rollout_ref.rollout.decode_steps_per_launch=4"])
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir('qwen2')}", "trainer.device=cpu",
                             "data.max_prompt_length=16", "data.max_response_length=16",
                             "actor_rollout_ref.rollout.max_num_seqs=2",
                             "actor_rollout_ref.rollout.decode_steps_per_launch=3"])
    engine = build_rollout(cfg, SimpleNamespace(device=torch.device("cpu"), world_size=1, rank=0))
    assert engine.decode_steps_per_launch == 3


def test_estimator_facts_come_from_the_registry():
    """Needs are registered with the estimator (a plugin's estimator gets the same checks as the built-ins)."""
    from rlhf_mcore.algos import register_adv_estimator

    @register_adv_estimator("test_needs_critic_and_groups", needs_critic=True, needs_group_index=True)
    def _est(*, token_level_rewards, response_mask, **_):
        return token_level_rewards, token_level_rewards

    cfg = load_config(None, MODEL + ["algorithm.adv_estimator=test_needs_critic_and_groups",
                                     "actor_rollout_ref.rollout.n=4",
                                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                     "critic.ppo_micro_batch_size_per_gpu=4"])
    assert critic_enabled(cfg)
    validate_config(cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"compares the samples of each prompt.*rollout.n=1"):
        validate_config(load_config(None, MODEL + ["algorithm.adv_estimator=grpo",
                                                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]),
                        world_size=1)
    grpo = load_config(None, MODEL + ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"])
    assert not critic_enabled(grpo)


def test_pipeline_stage_split_is_checked_against_the_model(tmp_path):
    """veRL's override_transformer_config keys for uneven PP stages: checked against the model's layer count and
    PP, shared by ref and critic; unset, any layer count works (a split is chosen)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "max_position_embeddings": 4096}))
    model = [f"actor_rollout_ref.model.path={tmp_path}",
             "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"]
    key = "actor_rollout_ref.actor.megatron.override_transformer_config"
    validate_config(layout(*model), world_size=2)  # 3 layers at PP=2: chosen split
    cfg = layout(*model, f"{key}.num_layers_in_first_pipeline_stage=1", f"{key}.num_layers_in_last_pipeline_stage=2")
    validate_config(cfg, world_size=2)
    from rlhf_mcore.config import pipeline_split

    assert pipeline_split(cfg) == {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 2}
    with pytest.raises(ConfigError, match=rf"model.path={tmp_path} has num_hidden_layers=3.*"
                                          r"pipeline_model_parallel_size=2.*must add up to the model's 3 layers.*"
                                          r"num_layers_in_first_pipeline_stage=2 and num_layers_in_last_"):
        validate_config(layout(*model, f"{key}.num_layers_in_first_pipeline_stage=2",
                               f"{key}.num_layers_in_last_pipeline_stage=2"), world_size=2)
    with pytest.raises(ConfigError, match=r"num_layers_in_last_pipeline_stage=0 must be >= 1"):
        validate_config(layout(*model, f"{key}.num_layers_in_last_pipeline_stage=0"), world_size=2)
    with pytest.raises(ConfigError, match=r"apply to pipeline parallelism only; at PP=1"):
        validate_config(layout(f"actor_rollout_ref.model.path={tmp_path}",
                               f"{key}.num_layers_in_first_pipeline_stage=1"), world_size=1)
    with pytest.raises(ConfigError, match=r"'critic.megatron.override_transformer_config.num_layers_in_first_"
                                          r"pipeline_stage' is 2 but the actor's is 1"):
        validate_config(layout(*model, f"{key}.num_layers_in_first_pipeline_stage=1",
                               "critic.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=2"),
                        world_size=2)
    with pytest.raises(ConfigError, match=r"unknown config key .*override_transformer_config.num_layers_in_first"):
        load_config(None, MODEL + [f"{key}.num_layers_in_first_stage=1"])


def test_cuda_graphs_true_where_they_cannot_run_is_refused_with_the_reason():
    """`megatron.cuda_graphs`: unset or false anywhere; true is refused up front where graphs cannot run."""
    validate_config(layout("actor_rollout_ref.actor.megatron.cuda_graphs=true"), world_size=2)
    validate_config(layout("actor_rollout_ref.actor.megatron.cuda_graphs=false",
                           "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"), world_size=2)
    cases = {
        "trainer.device=cpu": ("actor_rollout_ref.actor", "trainer.device=cpu"),
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2": ("actor_rollout_ref.actor", "TP or PP > 1"),
        "actor_rollout_ref.model.enable_gradient_checkpointing=true": ("actor_rollout_ref.actor", "recompute"),
        "actor_rollout_ref.model.use_remove_padding=false": ("actor_rollout_ref.actor", "padded sequences"),
    }
    for override, (role, why) in cases.items():
        with pytest.raises(ConfigError, match=rf"{role}\.megatron\.cuda_graphs=true, but CUDA graphs cannot run "
                                              rf"with .*{why}.*set it to false"):
            validate_config(layout(f"{role}.megatron.cuda_graphs=true", override), world_size=2)
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.ref\.megatron\.cuda_graphs=true.*TP or PP"):
        validate_config(layout("actor_rollout_ref.ref.megatron.cuda_graphs=true",
                               "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"), world_size=2)


def test_rollout_mode_async_points_at_async_training_mode():
    """veRL's `actor_rollout_ref.rollout.mode=async` is refused with the key that does asynchronous training here
    and its values. Mutation: `choice_error` (rlhf_mcore/config/checks.py) ignores `hint` -> fails."""
    with pytest.raises(ConfigError, match=r"config key 'actor_rollout_ref\.rollout\.mode' has value 'async'; choose "
                                          r"one of sync\. .*async_training\.mode=one_step_off or fully_async \(off: "
                                          r"synchronous\)"):
        load_config(None, MODEL + ["actor_rollout_ref.rollout.mode=async"])


def test_keys_unused_in_the_setup_get_one_notice(tmp_path, capsys, monkeypatch):
    """Keys set (command line or YAML) that the chosen setup never reads -- `critic.*` under GRPO,
    `algorithm.kl_ctrl.kl_coef` without `use_kl_in_reward` -- are named in one notice line on rank 0, with the
    reason; a path among them that does not exist is said to be missing. The same keys where they are read, and
    keys left at their defaults, give no notice. Mutation: `return sorted(found.items())` -> `return []` in
    `rlhf_mcore/config/unused.py: unused_keys` -> fails; mutation: `if decided[i]:` -> `if not decided[i]:` -> fails."""
    monkeypatch.delenv("RANK", raising=False)
    habit = ["critic.model.path=/nonexistent", "critic.optim.lr=1e-5", "algorithm.kl_ctrl.kl_coef=0.001",
             "actor_rollout_ref.actor.megatron.fp8_recipe=rowwise"]
    cfg = load_config(None, MODEL + ["algorithm.adv_estimator=grpo", *habit])
    assert cfg.critic.model.path == "/nonexistent" and not critic_enabled(cfg)  # accepted, as veRL sets them
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("notice: config keys unused in this setup"), lines
    assert "critic.optim.lr (algorithm.adv_estimator=grpo builds no critic)" in lines[0], lines[0]
    assert ("critic.model.path (algorithm.adv_estimator=grpo builds no critic; and critic.model.path='/nonexistent' "
            "does not exist)") in lines[0], lines[0]
    assert "algorithm.kl_ctrl.kl_coef (algorithm.use_kl_in_reward=false: no KL penalty in the reward)" in lines[0]
    assert ("actor_rollout_ref.actor.megatron.fp8_recipe (actor_rollout_ref.actor.megatron.fp8=null: no FP8 GEMMs)"
            in lines[0])
    assert "actor_rollout_ref.model.path" not in lines[0] and "adv_estimator (" not in lines[0]

    # where they are read: PPO builds the critic, use_kl_in_reward applies kl_ctrl (the path is then checked when
    # the critic is built); and nothing set beyond the defaults
    load_config(None, MODEL + ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true",
                               "actor_rollout_ref.actor.megatron.fp8=hybrid", *habit])
    load_config(None, MODEL + ["algorithm.adv_estimator=grpo"])
    assert capsys.readouterr().err == ""

    # from a YAML file (veRL's top-level reward_model section too), and never on another rank
    p = write(tmp_path, "algorithm:\n  adv_estimator: grpo\ncritic:\n  ppo_micro_batch_size_per_gpu: 4\n"
                        "reward_model:\n  micro_batch_size_per_gpu: 8\n")
    load_config(p, MODEL)
    err = capsys.readouterr().err
    assert "critic.ppo_micro_batch_size_per_gpu (algorithm.adv_estimator=grpo builds no critic)" in err, err
    assert "reward.reward_model.micro_batch_size_per_gpu (reward.reward_model.enable=false: no reward model)" in err
    monkeypatch.setenv("RANK", "1")
    load_config(p, MODEL)
    assert capsys.readouterr().err == ""



# Every path a repeated section is nested under, with what it takes to build that role (veRL's top-level
# `reward_model` alias for PRIME's PRM).
OPTIM_PATHS = {
    "actor_rollout_ref.actor.optim": [],
    "critic.optim": [],
    "reward.reward_model.model.optim": ["reward.reward_model.enable=true", "reward.reward_model.model.path=/rm"],
    "reward_model.model.optim": ["reward_model.enable=true", "reward_model.reward_manager=prime",
                                 "algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=2"],
}
# (key under the section, its value on the command line and in Python, what the refusal says)
BAD_VALUES = {
    "optim": [("lr_scheduler", "cosinee", "cosinee",
               r"'cosinee'; choose one of constant, cosine, linear\. Did you mean 'cosine'\?"),
              ("betas", "[0.9,1.5]", [0.9, 1.5], r"\[0.9, 1.5\]; it must be two numbers in \[0, 1\)"),
              ("weight_decay", "-0.1", -0.1, r"-0.1; it must be >= 0")],
    "grad_clip": [("grad_clip", "0", 0.0, r"0.0; it must be > 0 \(the max global gradient norm\)")],
    "sampling": [("temperature", "-1", -1.0, r"-1.0; it must be >= 0 \(0 is greedy\)")],
    "dtype": [("dtype", "bf16", "bf16", r"'bf16'; choose one of auto, bfloat16, float16, float32\. Did you mean")],
}
NESTED = [(path, extra, bad) for path, extra in OPTIM_PATHS.items() for bad in BAD_VALUES["optim"]] + [
    (path, [], bad) for path in ("actor_rollout_ref.actor", "critic") for bad in BAD_VALUES["grad_clip"]] + [
    (path, [], bad) for path in ("actor_rollout_ref.rollout", "actor_rollout_ref.rollout.val_kwargs", "reward.judge")
    for bad in BAD_VALUES["sampling"]] + [
    (path, extra, bad) for path, extra in (("actor_rollout_ref.model", []), ("actor_rollout_ref.rollout", []),
                                           ("critic.model", []), ("reward.reward_model.model", OPTIM_PATHS[
                                               "reward.reward_model.model.optim"])) for bad in BAD_VALUES["dtype"]]


@functools.cache
def _loaded(extra: tuple) -> object:
    return load_config(None, MODEL + list(extra))


@pytest.mark.parametrize("path, extra, bad", NESTED, ids=[f"{p}.{b[0]}={b[1]}" for p, _, b in NESTED])
def test_a_section_rule_holds_wherever_the_section_is_nested(path, extra, bad):
    """A rule is written once on its section (OptimConfig's scheduler, betas, weight decay; grad_clip; the sampling
    temperature; the dtype choices) and refuses the same bad value under every path the section appears: the
    actor, the critic, the reward model and PRIME's PRM; at load, and at validate_config for a config changed in
    code, naming the full key.

    Mutation: `check_sections` skips nested dataclasses (`continue` instead of recursing) -> fails (the Literal
    cases at load still pass, OmegaConf refuses them through the same message, but not at validate_config)."""
    leaf, text, value, message = bad
    full = f"reward.{path}" if path.startswith("reward_model.") else path
    expected = rf"config key '{re.escape(full)}\.{leaf}' has value {message}"
    with pytest.raises(ConfigError, match=expected):
        load_config(None, MODEL + extra + [f"{path}.{leaf}={text}"])
    cfg = copy.deepcopy(_loaded(tuple(extra)))
    section = cfg
    for part in full.split("."):
        section = getattr(section, part)
    setattr(section, leaf, value)
    with pytest.raises(ConfigError, match=expected):
        validate_config(cfg, world_size=1, read_model=False)


def test_recompute_layout_keys_are_checked(tmp_path):
    """override_transformer_config.recompute_method / recompute_num_layers: only where the role recomputes, and
    against the model's layers per chunk (uniform: a divisor; block: at most a chunk); recompute_granularity
    (veRL's megatron switch) and recompute_modules consistent with enable_gradient_checkpointing and with what runs
    without Transformer Engine. Mutations: the recompute-on requirement dropped from `_check_recompute` -> the first
    refusal fails; the uniform divisor rule dropped -> the 3-of-4 case fails; the Transformer Engine rule dropped ->
    the mlp case fails."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "max_position_embeddings": 4096}))
    key = "actor_rollout_ref.actor.megatron.override_transformer_config"
    on = ["actor_rollout_ref.model.enable_gradient_checkpointing=true", f"actor_rollout_ref.model.path={tmp_path}"]
    validate_config(layout(*on, f"{key}.recompute_method=block", f"{key}.recompute_num_layers=3"), world_size=1)
    validate_config(layout(*on, f"{key}.recompute_num_layers=2"), world_size=1)  # uniform, 2 divides 4
    validate_config(layout(*on, f"{key}.recompute_num_layers=2",  # PP=2: chunks of 2 layers
                           "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"), world_size=2)
    cases = [
        ([f"{key}.recompute_method=block"], rf"{key}.recompute_method is set, but activation recompute is off: "
                                            r"set actor_rollout_ref.model.enable_gradient_checkpointing=true"),
        ([*on, f"{key}.recompute_num_layers=3"],
         rf"{key}.recompute_num_layers=3 with recompute_method=uniform must divide the layers of each model chunk "
         r".*4 layers: chunks of 4 at PP=1"),
        ([*on, f"{key}.recompute_method=block", f"{key}.recompute_num_layers=3",
          "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"],
         r"recompute_num_layers=3 with recompute_method=block is more than the 2 layers of a model chunk"),
        ([*on, "actor_rollout_ref.ref.megatron.override_transformer_config.recompute_num_layers=1"],
         r"ref\.megatron\.override_transformer_config\.recompute_num_layers is set, but the reference policy runs no "
         r"backward pass"),
        ([*on, "critic.megatron.override_transformer_config.recompute_method=uniform", "algorithm.adv_estimator=gae"],
         r"critic\.megatron\.override_transformer_config\.recompute_method is set, but activation recompute is off: "
         r"set critic\.model\.enable_gradient_checkpointing=true"),
    ]
    validate_config(layout(f"{key}.recompute_granularity=full", f"{key}.recompute_method=block",  # veRL's way
                           f"{key}.recompute_num_layers=2", f"actor_rollout_ref.model.path={tmp_path}"), world_size=1)
    validate_config(layout(f"{key}.recompute_granularity=selective", f"{key}.recompute_modules=[core_attn]"),
                    world_size=1)
    cases += [
        ([on[0], f"{key}.recompute_granularity=selective"],
         r"recompute_granularity=selective with actor_rollout_ref.model.enable_gradient_checkpointing=true"),
        ([f"{key}.recompute_granularity=selective", f"{key}.recompute_modules=[core_attn,mlp]"],
         r"\['mlp'\] need Transformer Engine"),
        ([f"{key}.recompute_modules=[mlp]"], r"recompute_modules=\['mlp'\] is read only with recompute_granularity="
                                             r"selective"),
        ([f"{key}.recompute_granularity=selective", f"{key}.recompute_num_layers=1"],
         r"recompute_num_layers chooses which whole layers recompute"),
        (["actor_rollout_ref.ref.megatron.override_transformer_config.recompute_granularity=full"],
         r"ref\.megatron\.override_transformer_config\.recompute_granularity is set, but the reference policy"),
    ]
    for extra, message in cases:
        world = 2 if any("pipeline_model_parallel_size=2" in e for e in extra) else 1
        with pytest.raises(ConfigError, match=message):
            validate_config(layout(*extra), world_size=world)
    with pytest.raises(ConfigError, match=r"recompute_num_layers' has value 0; it must be unset or >= 1"):
        layout(f"{key}.recompute_num_layers=0")
    with pytest.raises(ConfigError, match=r"recompute_method' has value 'selective'; choose one of"):
        layout(f"{key}.recompute_method=selective")
