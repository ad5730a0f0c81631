"""The supervised warm starts the learning tests start RL from, committed under tests/data/warm_starts/.

Each spec names the tiny model (`rlhf_mcore.models.tiny.make_tiny_model`), the synthetic task its targets come
from (`rlhf_mcore.data.write_synthetic_parquet`) and launch/sft.py's arguments. A warm start costs minutes of CPU
to train (300 SFT steps); the suite trains none: tests/data/make_warm_starts.py trains each with these specs and
writes its Hugging Face directory plus a manifest of the spec, and tests/test_warm_starts.py checks that every
committed directory still matches its spec (the manifest, the model's config, the tokenizer) and that the loading
code reads it. launch/sft.py's own training is tested by the demo (tests/test_demo.py) and tests/test_sft_*.

    warm_start("demo")          # -> Path of the committed HF directory (warm_start(AGENT): the agent demo's)
    write_task("demo", out)     # the synthetic task it was trained on (train.parquet, test.parquet)
"""
from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "warm_starts"

SPECS: dict[str, dict] = {
    # tests/test_trainer.py's learning runs (the `make demo` pipeline): 300 steps of 32 on difficulty 0 with 70% of
    # the targets ending in a full stop the strict GSM8K reward rejects; greedy answers copy the number (~80% of
    # held-out problems) but keep the full stop, so the strict reward scores them ~0 before RL.
    "demo": {
        "model": dict(arch="qwen2", layers=2, hidden=128, heads=4, kv_heads=2, seed=0, init_std=0.02),
        "task": dict(n=2048, difficulty=0, seed=0, n_test=64, period_answers=0.7),
        "sft": dict(steps=300, batch_size=32, lr=3e-3, max_length=160, seed=1),
    },
    # tests/test_train_rm.py's GRPO with the reward model alone: one-digit numbers, 300 steps of 16.
    "one_digit": {
        "model": dict(arch="qwen2", layers=2, hidden=128, heads=4, kv_heads=2, seed=0, init_std=0.02),
        "task": dict(n=1024, difficulty=0, seed=0, n_test=64, max_operand=9, period_answers=0.7),
        "sft": dict(steps=300, batch_size=16, lr=3e-3, max_length=160, seed=1),
    },
}


# tests/test_agent_learning.py's warm start: launch/demo_agent.py's steps 1-3 (`--sft-only`) at its defaults and
# these arguments (400 SFT steps of the multiply task with the calculator); tests/test_warm_starts.py checks that
# the settings it records (warm_start.json) are still the demo's.
AGENT = "agent_multiply"
AGENT_ARGS = ["--seed", "1"]


# tests/test_vla_learning.py's warm start: launch/demo_vla.py's behaviour cloning (`--bc-only`) at its config's
# defaults and these arguments (1,000 BC steps on 2,048 expert episodes, 70% of them stopping short of the block);
# tests/test_warm_starts.py checks that the settings it records (warm_start.json) are still the demo's.
VLA = "vla_reachpush"
VLA_ARGS = ["--seed", "1"]


def vla_settings() -> dict:
    """The warm start settings launch/demo_vla.py derives today from VLA_ARGS and its config."""
    import sys

    sys.path.insert(0, str(DATA.parents[2]))
    from launch.demo_vla import CONFIG, warm_start_settings
    from rlhf_mcore.config import load_config

    seed = VLA_ARGS[VLA_ARGS.index("--seed") + 1]
    return warm_start_settings(load_config(DATA.parents[2] / CONFIG, [f"trainer.seed={seed}", "vla.image_size=16"]))


def agent_settings() -> dict:
    """The warm start settings launch/demo_agent.py derives today from AGENT_ARGS and its config."""
    import sys

    sys.path.insert(0, str(DATA.parents[2]))
    from launch.demo_agent import CONFIG, parse_args, warm_start_settings
    from rlhf_mcore.config import load_config

    cfg = load_config(DATA.parents[2] / CONFIG, [])
    return warm_start_settings(parse_args(AGENT_ARGS), cfg.data.max_prompt_length + cfg.data.max_response_length)


def warm_start(name: str) -> Path:
    """The committed warm start `name`'s Hugging Face directory (read-only: copy it to change it)."""
    path = DATA / name
    if not (path / "manifest.json").is_file():
        raise FileNotFoundError(f"{path} has no manifest.json: run `python tests/data/make_warm_starts.py {name}`")
    return path


def manifest(name: str) -> dict:
    return json.loads((warm_start(name) / "manifest.json").read_text())


def write_task(name: str, out: Path) -> Path:
    """Write the synthetic task warm start `name` was trained on to `out` (train.parquet, test.parquet)."""
    from rlhf_mcore.data import write_synthetic_parquet

    write_synthetic_parquet(out, **SPECS[name]["task"])
    return out
