"""`make demo` twice in a row: the second run trains again (it does not resume the finished run) and reports its
own numbers. Short settings (2 SFT steps, 1 GRPO step, one process); the demo's learning is checked by
tests/test_trainer.py with the demo's real settings."""
import json
import subprocess
from pathlib import Path

import pytest
from launcher import run

pytestmark = pytest.mark.cost(95)


def demo(out: Path) -> subprocess.CompletedProcess:
    return run("launch/demo.py", "--nproc", "1", "--out", str(out), "--sft-steps", "2", "--grpo-steps", "1")


def test_a_second_demo_run_trains_again(tmp_path):
    out = tmp_path / "demo"
    demo(out)
    (out / "grpo" / "marker_of_the_first_run").write_text("")
    second = demo(out)
    assert "removing the previous demo run" in second.stdout
    assert "resumed from" not in second.stdout + second.stderr
    assert not (out / "grpo" / "marker_of_the_first_run").exists()
    records = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1]  # its own step, once
    assert "validation curve" in second.stdout and "done in" in second.stdout
    plots = out / "grpo" / "plots" / "curves.png"  # drawn by train.py (the demo's console + jsonl loggers)
    assert plots.is_file() and f"plots (PNG)         {plots}" in second.stdout
    assert "run summary: 1 step, " in second.stdout  # train.py's end-of-run summary
