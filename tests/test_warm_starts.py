"""The committed SFT warm starts (tests/warm_starts.py) still match their specs, so the learning tests that start
from them start where training them with today's code would: the manifest holds the spec it was trained with, the
model's config.json and tokenizer are those make_tiny_model writes for that spec today, and the project's loader
reads the directory. (Retrain with `python tests/data/make_warm_starts.py` when one of these fails on purpose.)"""
import json

import pytest
from warm_starts import AGENT, AGENT_ARGS, SPECS, VLA, VLA_ARGS, agent_settings, manifest, vla_settings, warm_start


@pytest.mark.parametrize("name", sorted(SPECS))
def test_committed_warm_start_matches_its_spec(name, tmp_path):
    """Mutation: a spec's sft steps 300 -> 200 (the manifest differs), or make_tiny_model's default intermediate
    2 * hidden -> 3 * hidden (the config differs) -> fails."""
    from rlhf_mcore.models.hf_config import load_hf_config
    from rlhf_mcore.models.tiny import make_tiny_model

    spec = SPECS[name]
    assert manifest(name)["spec"] == json.loads(json.dumps(spec)), f"{name}: retrain (tests/data/make_warm_starts.py)"
    fresh = make_tiny_model(tmp_path / "fresh", **spec["model"])
    committed = warm_start(name)

    def config(path):
        return {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k != "transformers_version"}

    assert config(committed) == config(fresh)
    assert (committed / "tokenizer.json").read_text() == (fresh / "tokenizer.json").read_text()
    assert load_hf_config(committed).hidden_size == spec["model"]["hidden"]


def test_committed_agent_warm_start_matches_the_demo(tmp_path):
    """The agent demo's committed warm start (tests/test_agent_learning.py starts GRPO from it) was trained with the
    settings launch/demo_agent.py derives today from AGENT_ARGS, and its config and tokenizer are those the demo's
    step 1 builds today. Mutation: demo_agent's `--sft-steps` default 400 -> 300, or its tiny model's kv_heads 2 -> 4
    -> fails."""
    from launch.demo_agent import WARM_START_FILE, build_tiny_model, parse_args

    committed = warm_start(AGENT)
    assert manifest(AGENT)["spec"] == {"demo_agent": AGENT_ARGS}
    assert json.loads((committed / WARM_START_FILE).read_text()) == agent_settings(), \
        "retrain: python tests/data/make_warm_starts.py agent_multiply"
    fresh = build_tiny_model(parse_args(AGENT_ARGS), tmp_path / "fresh")

    def config(path):
        return {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k != "transformers_version"}

    assert config(committed) == config(fresh)
    assert (committed / "tokenizer.json").read_text() == (fresh / "tokenizer.json").read_text()


def test_committed_vla_warm_start_matches_the_demo():
    """The VLA demo's committed warm start (tests/test_vla_learning.py starts GRPO from it) was trained with the
    settings launch/demo_vla.py derives today from VLA_ARGS and its config (BC steps, lr, demonstrations and their
    stop-short habit, the env's sizes), on the tiny LLaVA the demo writes. Mutation: the config's
    vla.demo_stop_short 0.7 -> 0.6 -> fails."""
    from launch.demo_vla import WARM_START_FILE

    committed = warm_start(VLA)
    assert manifest(VLA)["spec"] == {"demo_vla": VLA_ARGS}
    assert json.loads((committed / WARM_START_FILE).read_text()) == vla_settings(), \
        "retrain: python tests/data/make_warm_starts.py vla_reachpush"
    config = json.loads((committed / "config.json").read_text())
    assert config["model_type"] == "llava" and config["vision_config"]["image_size"] == 16
