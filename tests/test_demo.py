"""`make demo` twice in a row: the second run trains again (it does not resume the finished run) and reports its
own numbers. Short settings (2 SFT steps, 1 GRPO step, one process); the demo's learning is checked by
tests/test_trainer.py with the demo's real settings."""
import json
import subprocess
import sys
from pathlib import Path

from subprocess_env import child_env

ROOT = Path(__file__).resolve().parents[1]


def demo(out: Path) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run([sys.executable, str(ROOT / "launch" / "demo.py"), "--nproc", "1", "--out", str(out),
                           "--sft-steps", "2", "--grpo-steps", "1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_second_demo_run_trains_again(tmp_path):
    out = tmp_path / "demo"
    first = demo(out)
    assert first.returncode == 0, first.stderr[-3000:]
    (out / "grpo" / "marker_of_the_first_run").write_text("")
    second = demo(out)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "removing the previous demo run" in second.stdout
    assert "resumed from" not in second.stdout + second.stderr
    assert not (out / "grpo" / "marker_of_the_first_run").exists()
    records = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1]  # its own step, once
    assert "validation curve" in second.stdout and "done in" in second.stdout
