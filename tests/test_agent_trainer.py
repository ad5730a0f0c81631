"""The trainer with multi-turn rollouts (tool_agent on the multiply task, the calculator), through launch/train.py:
a run resumed from its step-1 checkpoint logs exactly the metrics of the uninterrupted run for step 2, the
agent metrics included."""
import json
import shutil

from test_trainer import NONDETERMINISTIC, launch

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A dense stand-in reward so that an untrained model's updates are not zero: the share of digits."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''


def _metrics(path):
    rows = [json.loads(line) for line in open(path)]
    timing = (*NONDETERMINISTIC, "agent/engine_busy_fraction", "agent/tool_seconds")  # wall-clock, not computation
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(timing)}
            for r in rows if r.get("kind") == "train"}


def test_multi_turn_resume_matches_uninterrupted(tmp_path, tiny_model_dir):
    from rlhf_mcore.agents.tasks import write_multiply_parquet

    model = tiny_model_dir("qwen2")
    write_multiply_parquet(tmp_path / "data", n=32, n_test=4)
    (tmp_path / "reward.py").write_text(REWARD)

    def args(out, steps):
        return ["--config", "configs/demo_agent_cpu.yaml", f"actor_rollout_ref.model.path={model}",
                f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]", "data.val_files=[]",
                f"trainer.default_local_dir={out}", f"trainer.total_training_steps={steps}", "trainer.save_freq=1",
                "trainer.max_actor_ckpt_to_keep=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
                "trainer.export_hf_final=false", "data.train_batch_size=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
                "data.max_response_length=40", f"reward.custom_reward_function.path={tmp_path / 'reward.py'}",
                "trainer.logger=[jsonl]", "trainer.max_rollout_logprob_gap=null"]

    full, part = tmp_path / "full", tmp_path / "part"
    launch("train.py", *args(full, 2))
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "global_step_1", part / "checkpoints" / "global_step_1")
    for f in (full / "checkpoints").iterdir():  # the tracker file, if any
        if f.is_file():
            shutil.copy(f, part / "checkpoints" / f.name)
    launch("train.py", *args(part, 2))
    want, got = _metrics(full / "metrics.jsonl"), _metrics(part / "metrics.jsonl")
    assert sorted(got) == [2]
    assert any(k.startswith("agent/") for k in got[2])
    assert want[1]["actor/grad_norm"] > 0  # the weights step 2 samples from were trained: equality means something
    assert got[2] == want[2], "step 2 differs after resume"
