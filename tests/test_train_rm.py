"""launch/train_rm.py end to end on CPU: Bradley-Terry training of a tiny random Qwen2 on synthetic preference pairs,
the held-out pairwise accuracy per epoch, and the exported *ForSequenceClassification directory in transformers.

The pairs here reject answers the strict reward scores 0 for their format ("#### 47." and "#### 48.", the
`full_stop` and `both` kinds): a tiny random model learns that in a few dozen steps, and the held-out pairwise
accuracy must reach 0.9. (Rejecting a wrong number without a full stop needs the model to compare digits across
the conversation; from random initialisation it stays near chance in the few hundred steps tried, see
launch/demo_rm.py, which starts from the SFT warm start.)
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def launch(*args, check=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    if check:
        assert proc.returncode == 0, f"failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("train_rm")
    launch(ROOT / "launch" / "preprocess_data.py", "synthetic-preferences", "--n", "256", "--n-test", "64",
           "--rejected-kinds", "full_stop,both", "--output-dir", root / "prefs")
    launch(ROOT / "launch" / "train_rm.py", "--model", tiny_model_dir("qwen2"), "--train-file",
           root / "prefs" / "train.parquet", "--val-file", root / "prefs" / "test.parquet", "--out", root / "rm",
           "--epochs", "2", "--batch-size", "16", "--micro-batch-pairs", "4", "--lr", "2e-3", "--max-length", "128",
           "--device", "cpu", "--report", root / "report.json")
    return root, json.loads((root / "report.json").read_text())


def test_held_out_accuracy(trained):
    _, report = trained
    assert len(report["val_accuracy"]) == 2 and report["num_val_pairs"] == 64
    assert report["val_accuracy"][-1] >= 0.9, report


def test_export_loads_in_transformers_and_scores_the_same(trained, tiny_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_mcore.data.preferences import read_preference_rows
    from rlhf_mcore.rewards.reward_model import check_reward_model_dir
    from rlhf_mcore.trainer.rm_training import encode_pairs

    root, report = trained
    check_reward_model_dir(str(root / "rm"))
    cfg = json.loads((root / "rm" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForSequenceClassification"] and cfg["num_labels"] == 1
    model = AutoModelForSequenceClassification.from_pretrained(root / "rm", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(root / "rm")
    pairs, _ = encode_pairs(read_preference_rows(root / "prefs" / "test.parquet"), tok, 128)
    with torch.no_grad():
        margins = [float(model(torch.tensor([c])).logits[0, 0] - model(torch.tensor([r])).logits[0, 0])
                   for c, r in pairs]
    assert sum(m > 0 for m in margins) / len(margins) == report["val_accuracy"][-1]
    assert sum(margins) / len(margins) == pytest.approx(report["val_margin"][-1], abs=1e-4)


def test_preference_file_missing_a_column_is_one_line(tiny_model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "chosen": "a", "answer": "b"}]), tmp_path / "bad.parquet")
    proc = launch(ROOT / "launch" / "train_rm.py", "--model", tiny_model_dir("qwen2"), "--train-file",
                  tmp_path / "bad.parquet", "--out", tmp_path / "rm", "--device", "cpu", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "lacks column(s) ['rejected']" in proc.stderr
