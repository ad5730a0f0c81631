"""What the end-to-end tests of launch/train.py share: a tiny task whose groups disagree and the metrics a run
logged (tests/launcher.py starts the runs)."""
import json
from pathlib import Path


def parity_task(tmp_path: Path, model_dir: Path, max_response_length: int = 8) -> list[str]:
    """Synthetic prompts and a reward that scores a random model's responses 0 or 1 by length (so a group's rewards
    vary); returns the train.py overrides of a small GRPO run on them (4 prompts x 4 samples, CPU, jsonl)."""
    from rlhf_mcore.data import write_synthetic_parquet

    write_synthetic_parquet(tmp_path / "syn", n=64, difficulty=0, seed=0, n_test=4)
    reward = tmp_path / "parity_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 2)\n")
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{tmp_path / 'syn' / 'train.parquet'}]",
            "data.val_files=[]", "data.train_batch_size=4", f"data.max_response_length={max_response_length}",
            "data.max_prompt_length=128", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=4",
            "trainer.device=cpu", "trainer.logger=[jsonl]", f"custom_reward_function.path={reward}"]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
