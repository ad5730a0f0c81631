"""The VLA demo's learning on CPU (`make demo-vla`, issue 37 item 5): from a behaviour-cloned warm start whose
demonstrations have one consistent habit, GRPO on task success raises the greedy held-out success; and so does PPO
with a value head (configs/vla_reachpush_ppo_cpu.yaml, the same demo with a critic and chunk-level GAE).

It runs `launch/demo_vla.py` at seed 1 from its committed warm start (tests/warm_starts.py's VLA: the demo's own
behaviour cloning at seed 1, so the numbers are those of the whole demo; tests/test_warm_starts.py checks it is
still the demo's): the tiny LLaVA after 1,000 BC steps on 2,048 scripted reach episodes, 70% of which stop 0.2
short of the named block and stand there (`vla.demo_stop_short`), then STEPS GRPO steps of 16 states x 4
episodes; greedy success over the 64 held-out scenes before and after (one standard error ~0.06 each, ~0.08 on a
difference). Measured (README, "VLA": `make demo-vla` at seeds 1-10, the same settings, validated at steps 5, 10,
15, 20): success_before 0.22 to 0.41, gains at step 5 of +0.14 (seed 6) and +0.26 to +0.40 (the other nine), at step
10 of +0.23 to +0.47; seed 1 0.33 -> 0.73 at step 5, which this test reproduces exactly from the committed warm
start. The margin below is 0.12. 5 steps, not 10: most of the gain is there by step 5 (the table), and the suite's
time is spent once instead of twice (session 46: each of the two tests took ~60 s of a two-worker suite at 10 steps).

Mutation: advantages zeroed in VLARun.train_step (`adv = 0 * episode_advantages(...)`: the clip loss at zero
advantage, no policy gradient) -> success_after 0.33 = success_before, the gain assert fails (run once).

PPO (README, "VLA": the PPO config at seeds 1-3 through launch/demo_vla.py, 20 steps validated every 5): gains at
step 5 of +0.36, +0.31, +0.31 (seed 1: 0.33 -> 0.69), so the same margin, measured over three seeds rather than ten.
Mutation: the advantages zeroed in VLARun.gae_targets (`batch["advantages"] = 0 * adv[:, None] * m`) ->
success_after 0.33 = success_before, fails (run once).
"""
import json
import shutil

import pytest
from launcher import run
from warm_starts import VLA, VLA_ARGS, warm_start

pytestmark = pytest.mark.cost(70)
STEPS = 5
MARGIN = 0.12  # under the smallest gain at step 5 over ten seeds (0.14); ~1.4 standard errors of a difference


def _demo(tmp_path, *config):
    bc = shutil.copytree(warm_start(VLA), tmp_path / "warm_start")
    run("launch/demo_vla.py", "--out", str(tmp_path), *VLA_ARGS, *config, "--warm-start", str(bc), "--steps",
        str(STEPS), f"trainer.test_freq={STEPS}", "trainer.save_freq=-1",
        env_extra={"MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return json.loads((tmp_path / "summary.json").read_text())


def test_grpo_raises_held_out_success_from_the_habit_warm_start(tmp_path):
    summary = _demo(tmp_path)
    _check_gain(summary)


def test_ppo_raises_held_out_success_from_the_habit_warm_start(tmp_path):
    summary = _demo(tmp_path, "--config", "configs/vla_reachpush_ppo_cpu.yaml")
    assert summary["algorithm"] == "ppo"
    _check_gain(summary)


def _check_gain(summary):
    before, after = summary["success_before"], summary["success_after"]
    assert summary["episodes_evaluated"] == 64 and [s for s, _ in summary["val_curve"]] == [0, STEPS]
    # the warm start has the habit: greedy, it mostly stands short of the block
    assert before <= 0.5, summary
    assert after >= before + MARGIN, summary
