"""Learning with tools on CPU: launch/demo_agent.py end to end (tiny model, SFT warm start on the multiply task
where half the targets call the calculator and half guess a wrong product, GRPO with tool_agent, held-out
evaluation before and after). GRPO must raise the mean reward and the rate of calculator calls with the
question's exact operands, each by a clear margin; the demo's figures are in its docstring."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# seed 2 measured +0.26 reward, +0.30 exact operands (64 prompts); seed 1 does not learn to copy the calculator's
# answer in its warm start (the demo's docstring)
MIN_REWARD_GAIN = 0.15
MIN_CORRECT_CALL_GAIN = 0.15


@pytest.mark.slow
def test_grpo_raises_reward_and_correct_tool_use(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "agent_demo"
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "demo_agent.py"), "--out", str(out),
                           "--seed", "2"],  # the demo's settings as measured (about 6 minutes on one core)
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["after_sft"], summary["after_grpo"]
    print(json.dumps(summary))
    assert 0.1 < before["call"] < 0.9, f"the warm start should call the calculator in some samples only: {before}"
    assert after["reward"] - before["reward"] >= MIN_REWARD_GAIN, (before, after)
    assert after["operands"] - before["operands"] >= MIN_CORRECT_CALL_GAIN, (before, after)
