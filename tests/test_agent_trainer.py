"""The trainer with multi-turn rollouts on the multiply task (every trajectory calls the calculator: a model turn,
the tool's answer, a model turn), through launch/train.py: a run resumed from its step-1 checkpoint logs exactly
the metrics of the uninterrupted run for step 2, the agent metrics included; the one-step-off-policy trainer runs
the same agent loops on its rollout pool, trains the tool tokens masked out, and its step 1 (the initial weights'
samples, as the synchronous trainer's) logs the synchronous run's metrics."""
import json
import shutil

import pytest
from e2e_helpers import torchrun_train
from test_trainer import NONDETERMINISTIC, launch

from rlhf_mcore.agents.tasks import multiply_rows
from rlhf_mcore.data.preprocess import write_parquet

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A dense stand-in reward so that an untrained model's updates are not zero: the share of digits."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''

CALLS_CALCULATOR = '''
from rlhf_mcore.agents import AgentLoop, parse_tool_calls, register_agent


@register_agent("calls_calculator_agent")
class CallsCalculator(AgentLoop):
    """The multiply task's tool exchange whatever an untrained model writes: a model turn, the row's calculator
    call run as if the model had made it (its tool message masked out), a second model turn."""

    async def run(self, row, traj):
        if await self.generate(traj) is None or traj.done:
            return
        calls = parse_tool_calls(row["extra_info"]["answer"])  # the multiply row's call
        if traj.add_messages(await self.call_tools(traj, calls), role="tool"):
            await self.generate(traj)
'''



def _metrics(path):
    rows = [json.loads(line) for line in open(path)]
    timing = (*NONDETERMINISTIC, "agent/engine_busy_fraction", "agent/tool_seconds")  # wall-clock, not computation
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(timing)}
            for r in rows if r.get("kind") == "train"}


@pytest.fixture(scope="module")
def task(tmp_path_factory, tiny_model_dir):
    """(train.py arguments for an output directory and a step count, the directory of the files they name)."""
    tmp = tmp_path_factory.mktemp("multiply_task")
    model = tiny_model_dir("qwen2")
    rows = multiply_rows(32)
    for r in rows:
        r["agent_name"] = "calls_calculator_agent"
    write_parquet(rows, tmp / "train.parquet")
    (tmp / "reward.py").write_text(REWARD)
    (tmp / "agent.py").write_text(CALLS_CALCULATOR)

    def args(out, steps):
        return ["--config", "configs/demo_agent_cpu.yaml", f"actor_rollout_ref.model.path={model}",
                f"data.train_files=[{tmp / 'train.parquet'}]", "data.val_files=[]",
                f"trainer.plugins=[{tmp / 'agent.py'}]",
                f"trainer.default_local_dir={out}", f"trainer.total_training_steps={steps}", "trainer.save_freq=1",
                "trainer.max_actor_ckpt_to_keep=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
                "trainer.export_hf_final=false", "data.train_batch_size=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
                "data.max_response_length=48", f"reward.custom_reward_function.path={tmp / 'reward.py'}",
                "trainer.logger=[jsonl]", "trainer.max_rollout_logprob_gap=null"]

    return args, tmp


@pytest.fixture(scope="module")
def uninterrupted(task):
    """The synchronous trainer's two steps: (output directory, metrics by step)."""
    args, tmp = task
    launch("train.py", *args(tmp / "full", 2))
    return tmp / "full", _metrics(tmp / "full" / "metrics.jsonl")


def test_multi_turn_resume_matches_uninterrupted(tmp_path, task, uninterrupted):
    args, _ = task
    full, want = uninterrupted
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "global_step_1", part / "checkpoints" / "global_step_1")
    for f in (full / "checkpoints").iterdir():  # the tracker file, if any
        if f.is_file():
            shutil.copy(f, part / "checkpoints" / f.name)
    launch("train.py", *args(part, 2))
    got = _metrics(part / "metrics.jsonl")
    assert sorted(got) == [2]
    assert got[2]["agent/tool_calls/mean"] == 1.0 and got[2]["agent/message_tokens/mean"] > 0
    assert want[1]["actor/grad_norm"] > 0  # the weights step 2 samples from were trained: equality means something
    assert got[2] == want[2], "step 2 differs after resume"


def test_one_step_off_multi_turn_masks_tool_tokens_and_matches_step_1(tmp_path, task, uninterrupted):
    """One rollout + one training process, async_training.mode=one_step_off: the rows that come over the data bus
    keep their response masks (the trained token count is the trajectories' model tokens, the calculator's tokens
    excluded), the agent metrics are logged, and step 1 (the initial weights' samples in both trainers) logs the
    synchronous trainer's metrics."""
    args, _ = task
    _, sync = uninterrupted
    run = torchrun_train(2, args(tmp_path, 2) + ["trainer.save_freq=-1", "async_training.mode=one_step_off",
                                                 "rollout.n_gpus_per_node=1"])
    assert run.returncode == 0, run.stderr[-4000:]
    got = _metrics(tmp_path / "metrics.jsonl")
    assert sorted(got) == [1, 2]
    for step, g in got.items():
        assert g["agent/tool_calls/mean"] == 1.0 and g["agent/tool_errors"] == 0.0, (step, g)
        assert g["agent/message_tokens/mean"] > 0  # the calculator's answer is in the trajectories ...
        assert g["response_length/mean"] == pytest.approx(g["agent/model_tokens/mean"])  # ... but not trained
    keys = [k for k in sync[1] if k.startswith(("critic/", "response_length/", "agent/", "actor/"))]
    assert "actor/pg_loss" in keys and "agent/message_tokens/mean" in keys
    for k in keys:
        assert got[1][k] == pytest.approx(sync[1][k], rel=1e-4, abs=1e-6), (k, got[1][k], sync[1][k])
