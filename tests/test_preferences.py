"""Synthetic preference pairs (rlhf_mcore.data.preferences) and launch/preprocess_data.py synthetic-preferences."""
import json
import subprocess
import sys
from pathlib import Path

from subprocess_env import python_path

from rlhf_mcore.data.preferences import make_synthetic_preferences, read_preference_rows
from rlhf_mcore.rewards import default_compute_score

ROOT = Path(__file__).resolve().parents[1]


def test_chosen_passes_the_rule_and_rejected_fails_it():
    rows = make_synthetic_preferences(300, seed=3)
    kinds = {"wrong number": 0, "full stop": 0, "both": 0}
    for r in rows:
        chosen, rejected = (default_compute_score(r["data_source"], r[k], r["ground_truth"])
                            for k in ("chosen", "rejected"))
        assert chosen == 1.0 and rejected == 0.0, r
        final = r["rejected"].rsplit("####", 1)[1].strip()
        wrong = final.rstrip(".") != r["ground_truth"]
        kinds["both" if wrong and final.endswith(".") else "wrong number" if wrong else "full stop"] += 1
    assert kinds == {"wrong number": 100, "full stop": 100, "both": 100}
    assert make_synthetic_preferences(300, seed=3) == rows  # deterministic
    assert make_synthetic_preferences(300, seed=4) != rows
    only = make_synthetic_preferences(30, seed=3, rejected_kinds=("full_stop",))
    assert all(r["rejected"] == r["chosen"] + "." for r in only)


def test_preprocess_writes_disjoint_splits(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "preprocess_data.py"), "synthetic-preferences",
                           "--n", "200", "--n-test", "20", "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, env={"PYTHONPATH": python_path(), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["train"]["rows"] == 200 and summary["test"]["rows"] == 20
    train, test = read_preference_rows(tmp_path / "train.parquet"), read_preference_rows(tmp_path / "test.parquet")
    assert len(train) == 200 and len(test) == 20
    assert not {m[0]["content"] for m, _, _ in train} & {m[0]["content"] for m, _, _ in test}
