"""launch/train_rm.py end to end on CPU: Bradley-Terry training of a tiny random Qwen2 on synthetic preference pairs,
the held-out pairwise accuracy per epoch, and the exported *ForSequenceClassification directory in transformers.

The pairs here reject answers the strict reward scores 0 for their format ("#### 47." and "#### 48.", the
`full_stop` and `both` kinds): a tiny random model learns that in a few dozen steps, and the held-out pairwise
accuracy must reach 0.9. (Rejecting a wrong number without a full stop needs the model to compare digits across
the conversation; from random initialisation it stays near chance in the few hundred steps tried, see
launch/demo_rm.py, which starts from the SFT warm start.)

Then GRPO with that reward model as the only reward raises the task's true (rule) accuracy: a policy warm-started
on the synthetic task (one-digit numbers, 70% of the targets ending with the full stop the strict rule rejects)
copies the number but ends every greedy answer with a full stop; three GRPO steps on the reward model's score
alone make its held-out greedy answers pass the rule. The same run checks that the trainer scored the reward
model's batches while the rollout generated.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from launcher import QUIET, run

pytestmark = pytest.mark.cost(30)

ROOT = Path(__file__).resolve().parents[1]
GRPO_STEPS = 3


def launch(script, *args, check=True):
    return run(script, *map(str, args), check=check, env_extra=QUIET)


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


def held_out_bt_loss(model, pairs) -> float:
    """Mean over the pairs of -log sigmoid(r_chosen - r_rejected), each sequence scored alone by `model`."""
    import math

    total = 0.0
    with torch.no_grad():
        for c, r in pairs:
            margin = float(model(torch.tensor([c])).logits[0, 0] - model(torch.tensor([r])).logits[0, 0])
            total += -math.log(1 / (1 + math.exp(-margin)))
    return total / len(pairs)


def test_bradley_terry_loss_falls_on_held_out_pairs(trained, tiny_model_dir):
    """The held-out pairs' Bradley-Terry loss, recomputed pair by pair from transformers' scores: the model
    train_rm.py started from (the causal LM with the engine's initial score head, `ValueHead`'s seeded weight)
    against the exported one. Measured: 0.701 -> 0.097; the bar is 0.35, half of log 2.

    Mutation: `bradley_terry_loss` returning `-loss * ctx.scale` for the backward (gradient ascent, the logged loss
    kept) -> fails."""
    import math

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_mcore.data.preferences import read_preference_rows
    from rlhf_mcore.models.value_head import ValueHead
    from rlhf_mcore.trainer.rm_training import encode_pairs

    root, _ = trained
    tok = AutoTokenizer.from_pretrained(root / "rm")
    pairs, _ = encode_pairs(read_preference_rows(root / "prefs" / "test.parquet"), tok, 128)
    start = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir("qwen2"), num_labels=1,
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        start.score.weight.copy_(ValueHead(start.config.hidden_size).weight)
    end = AutoModelForSequenceClassification.from_pretrained(root / "rm", dtype=torch.float32).eval()
    before, after = held_out_bt_loss(start, pairs), held_out_bt_loss(end, pairs)
    print(f"\nheld-out Bradley-Terry loss: {before:.3f} -> {after:.3f}")
    assert before == pytest.approx(math.log(2), abs=0.05)  # the small initial head: margins near 0
    assert after < 0.5 * math.log(2), (before, after)


def test_preference_file_missing_a_column_is_one_line(tiny_model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "chosen": "a", "answer": "b"}]), tmp_path / "bad.parquet")
    proc = launch(ROOT / "launch" / "train_rm.py", "--model", tiny_model_dir("qwen2"), "--train-file",
                  tmp_path / "bad.parquet", "--out", tmp_path / "rm", "--device", "cpu", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "lacks column(s) ['rejected']" in proc.stderr


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    """The demo's tiny policy shape, supervised on the synthetic task with one-digit numbers (tests/warm_starts.py's
    "one_digit", 300 steps of 16: it copies the number in every greedy answer of the held-out split and ends it with
    a full stop), and that task's data."""
    from warm_starts import warm_start as committed
    from warm_starts import write_task

    root = tmp_path_factory.mktemp("rm_grpo")
    shutil.copytree(committed("one_digit"), root / "sft")
    write_task("one_digit", root / "syn")
    return root


def test_grpo_with_the_reward_model_alone_raises_rule_accuracy(trained, warm_start):
    """GRPO (configs/demo_cpu.yaml, one process) whose only reward is the reward model trained above (rule_weight
    0), validated greedily by the strict rule on the 64 held-out problems: before the first step -> after step 3
    measured 0.000 -> 1.000 at seed 1 and at seed 2 (warm start and GRPO both on that seed)."""
    rm_dir, out = trained[0] / "rm", warm_start / "grpo"
    launch(ROOT / "launch" / "train.py", "--config", ROOT / "configs" / "demo_cpu.yaml",
           f"actor_rollout_ref.model.path={warm_start / 'sft'}",
           f"data.train_files=[{warm_start / 'syn' / 'train.parquet'}]",
           f"data.val_files=[{warm_start / 'syn' / 'test.parquet'}]", "reward_model.enable=true",
           f"reward_model.model.path={rm_dir}", "reward_model.micro_batch_size_per_gpu=16",
           "trainer.n_gpus_per_node=1", f"trainer.default_local_dir={out}",
           f"trainer.total_training_steps={GRPO_STEPS}", f"trainer.test_freq={GRPO_STEPS}", "trainer.save_freq=-1",
           "trainer.logger=[jsonl]", "trainer.export_hf_final=false", "trainer.seed=1", "data.seed=1",
           "trainer.device=cpu")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in records if r["kind"] == "val"]
    train = [r for r in records if r["kind"] == "train"]
    assert [v["step"] for v in vals] == [0, GRPO_STEPS], vals
    before, after = vals[0]["val/synthetic/arithmetic/acc"], vals[-1]["val/synthetic/arithmetic/acc"]
    print(f"\nrule accuracy (greedy, 64 held-out problems) with the reward model as the only reward: "
          f"{before:.3f} -> {after:.3f}")
    assert before <= 0.2 and after >= before + 0.5, (before, after)
    for r in train:  # the reward model scored every batch as the rollout produced it, none after
        assert r["reward_model/num_streamed_batches"] >= 128 / 16 and r["reward_model/num_scored_after"] == 0, r
        assert r["reward_model/num_scored"] == 128
        assert r["critic/score/mean"] == pytest.approx(r["reward_model/score_mean"], abs=1e-5)
        assert "timing_s/reward_tail" in r
