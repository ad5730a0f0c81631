"""`make demo` twice in a row: the second run trains again (it does not resume the finished run) and reports its
own numbers. Short settings (2 SFT steps, 1 GRPO step of 4 prompts x 2 samples, one process, no validation before
training: configs/demo_cpu.yaml shrunk); the demo's learning is checked by tests/test_trainer.py with the demo's
real settings."""
import json
import subprocess
from pathlib import Path

import pytest
from launcher import run

pytestmark = pytest.mark.cost(50)


ROOT = Path(__file__).resolve().parents[1]
SMALL = {"data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
         "trainer.val_before_train": False}


def demo(out: Path, config: Path) -> subprocess.CompletedProcess:
    return run("launch/demo.py", "--nproc", "1", "--out", str(out), "--sft-steps", "2", "--grpo-steps", "1",
               "--config", str(config))


def small_config(tmp_path: Path) -> Path:
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "configs" / "demo_cpu.yaml")
    for key, value in SMALL.items():
        OmegaConf.update(cfg, key, value)
    OmegaConf.save(cfg, tmp_path / "demo_small.yaml")
    return tmp_path / "demo_small.yaml"


def test_a_second_demo_run_trains_again(tmp_path):
    """The second run trains GRPO again (its own step, once) from the first run's warm start, which it reuses
    (the same SFT settings and base weights: tests/test_demo.py::test_warm_start_reused_only_when_unchanged)."""
    out, config = tmp_path / "demo", small_config(tmp_path)
    demo(out, config)
    (out / "grpo" / "marker_of_the_first_run").write_text("")
    second = demo(out, config)
    assert f"reusing the supervised warm start in {out / 'sft_model'}" in second.stdout
    assert "sft.py" not in second.stdout  # no SFT process started
    assert "removing the previous demo run" in second.stdout
    assert "resumed from" not in second.stdout + second.stderr
    assert not (out / "grpo" / "marker_of_the_first_run").exists()
    records = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1]  # its own step, once
    assert "validation curve" in second.stdout and "done in" in second.stdout
    plots = out / "grpo" / "plots" / "curves.png"  # drawn by train.py (the demo's console + jsonl loggers)
    assert plots.is_file() and f"plots (PNG)         {plots}" in second.stdout
    assert "run summary: 1 step, " in second.stdout  # train.py's end-of-run summary


def test_warm_start_reused_only_when_unchanged(tmp_path):
    """launch/demo.py reuses a warm start only when it finished (settings written after the SFT process exited)
    with the same settings and the same base weights. Mutation: `finished_warm_start` ignoring the settings'
    values (any settings file counts) -> fails."""
    from launch.demo import SFT_SETTINGS, finished_warm_start, weights_digest

    base, sft = tmp_path / "tiny", tmp_path / "sft"
    base.mkdir()
    sft.mkdir()
    (base / "model.safetensors").write_bytes(b"weights v1")
    settings = {"steps": 2, "seed": 1, "base": weights_digest(base)}
    assert not finished_warm_start(sft, settings)  # nothing there
    (sft / "config.json").write_text("{}")
    assert not finished_warm_start(sft, settings)  # an SFT that did not finish writes no settings
    (sft / SFT_SETTINGS).write_text(json.dumps(settings))
    assert finished_warm_start(sft, settings)
    assert not finished_warm_start(sft, {**settings, "steps": 300})
    (base / "model.safetensors").write_bytes(b"weights v2")  # the base was rebuilt
    assert not finished_warm_start(sft, {**settings, "base": weights_digest(base)})
    (sft / SFT_SETTINGS).write_text("{trunc")
    assert not finished_warm_start(sft, settings)
