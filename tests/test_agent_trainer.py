"""The trainer with multi-turn rollouts on the multiply task (every trajectory calls the calculator: a model turn,
the tool's answer, a model turn), through launch/train.py: a run resumed from its step-1 checkpoint logs exactly
the metrics of the uninterrupted run for step 2, the agent metrics included (the rollout-vs-trainer log-prob gap,
fp32 noise that depends on the decode batches, within that noise); the one-step-off-policy trainer runs
the same agent loops on its rollout pool, trains the tool tokens masked out, and its step 1 (the initial weights'
samples, as the synchronous trainer's) logs the synchronous run's metrics; the fully asynchronous trainer streams
them across a weight sync, each model token's rollout log-prob that of the policy version that sampled it."""
import json
import shutil

import pytest
import torch
from launcher import run
from test_trainer import NONDETERMINISTIC, launch

from rlhf_mcore.agents.tasks import multiply_rows
from rlhf_mcore.data.preprocess import write_parquet

pytestmark = pytest.mark.cost(80)

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

GATED_CALCULATOR = '''
import threading
import time
from pathlib import Path

from rlhf_mcore.agents import register_tool
from rlhf_mcore.agents.calculator import Calculator

_calls, _lock = [0], threading.Lock()


@register_tool(override=True)
class GatedCalculator(Calculator):
    """The calculator, whose calls after the first `free` wait for the file `gate`, however long it takes (no clock
    decides the order; a gate that never comes ends in the rollout's tool timeout, an error the test fails on)."""

    def __init__(self, gate: str, free: int):
        self.gate, self.free = Path(gate), free

    def __call__(self, **arguments):
        with _lock:
            _calls[0] += 1
            gated = _calls[0] > self.free
        while gated and not self.gate.exists():
            time.sleep(0.02)
        return super().__call__(**arguments)
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
    # The rollout engine's log-probs carry the rounding of the decode batches they were computed in, and which turns
    # share a batch depends on when each calculator thread returns (wall-clock): the gap between them and the
    # trainer's is fp32 noise in both runs, equal within that noise; everything else is exact.
    noise = ("rollout/logprob_diff_abs", "rollout/k3_kl")
    exact = {k: v for k, v in got[2].items() if not k.startswith(noise)}
    assert exact == {k: v for k, v in want[2].items() if not k.startswith(noise)}, "step 2 differs after resume"
    assert sorted(got[2]) == sorted(want[2])
    for k in [k for k in want[2] if k.startswith(noise)]:
        bound = 1e-5 if k == "rollout/logprob_diff_abs" else 1e-9  # the rollout log-probs are the trained policy's
        assert got[2][k] < bound and want[2][k] < bound, (k, got[2][k], want[2][k])


def test_one_step_off_multi_turn_masks_tool_tokens_and_matches_step_1(tmp_path, task, uninterrupted):
    """One rollout + one training process, async_training.mode=one_step_off: the rows that come over the data bus
    keep their response masks (the trained token count is the trajectories' model tokens, the calculator's tokens
    excluded), the agent metrics are logged, and step 1 (the initial weights' samples in both trainers) logs the
    synchronous trainer's metrics."""
    args, _ = task
    _, sync = uninterrupted
    launch("train.py", *args(tmp_path, 2), "trainer.save_freq=-1", "async_training.mode=one_step_off",
           "rollout.n_gpus_per_node=1", nproc=2)
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


def test_fully_async_multi_turn_across_a_weight_sync(tmp_path, task, tiny_model_dir):
    """One rollout + one training process, async_training.mode=fully_async, one group (2 trajectories) in flight at
    a time: groups 1-2 (step 1) run under the initial weights; group 3's calculator calls are held (a gated
    calculator, released by the training pool after step 1's weight sync), so its trajectories cross the sync:
    first model turn under version 0, second under version 1. Every trained row's response mask is 0 exactly on
    the calculator's message; every model token's rollout log-prob equals a teacher-forced pass of the version it
    records (0: the initial model, 1: the weights the trainer pushed); step 2 counts group 3 as 1 version stale (its
    oldest token) and its 2 trajectories as across the sync. tests/scripts/async_agent_rows.py records the rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args, tmp = task
    (tmp_path / "gated.py").write_text(GATED_CALCULATOR)
    (tmp_path / "tools.yaml").write_text(f"tools:\n  - name: calculator\n    config: {{gate: {tmp_path / 'gate'}, "
                                         f"free: 4}}\n")
    run_args = args(tmp_path / "run", 2) + [
        f"trainer.plugins=[{tmp / 'agent.py'},{tmp_path / 'gated.py'}]", "trainer.save_freq=-1",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
        "actor_rollout_ref.rollout.multi_turn.tool_timeout_s=120", "async_training.mode=fully_async",
        "rollout.n_gpus_per_node=1", "async_training.staleness_threshold=1",
        "actor_rollout_ref.rollout.max_num_seqs=2"]  # n=2: one group in flight at a time
    run("tests/scripts/async_agent_rows.py", *run_args, "--out", str(tmp_path), nproc=2)
    lines = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    rows = [x for x in lines if "response_ids" in x]
    steps = {x["step"]: x["metrics"] for x in lines if "metrics" in x}
    assert sorted(steps) == [1, 2] and [sum(r["step"] == s for r in rows) for s in (1, 2)] == [4, 4]

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen2"))
    models = [AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"), dtype=torch.float32).eval()]
    models.append(AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"), dtype=torch.float32).eval())
    missing, unexpected = models[1].load_state_dict(torch.load(tmp_path / "v1.pt"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    across = []
    for r in rows:
        mask, versions = r["response_mask"], r["versions"]
        # the mask: model turn, the calculator's message (0), model turn
        first0, last0 = mask.index(0), len(mask) - 1 - mask[::-1].index(0)
        assert mask == [1] * first0 + [0] * (last0 + 1 - first0) + [1] * (len(mask) - last0 - 1), mask
        message = tok.decode(r["response_ids"][first0:last0 + 1])  # the fixture's ChatML template's tool turn
        expected = f"\n<|im_start|>tool\n{r['ground_truth']}<|im_end|>\n<|im_start|>assistant\n"
        assert message in (expected, "<|im_end|>" + expected), message
        if message.startswith("<|im_end|>"):  # closes a first turn the per-turn budget (12) cut
            assert first0 == 12 and tok.decode(r["response_ids"][first0 - 1:first0]) != "<|im_end|>"
        model_text = tok.decode([t for t, m in zip(r["response_ids"], mask) if m])
        assert "tool_response" not in model_text, model_text
        # versions: 0 or 1, never decreasing. A trajectory across the sync starts under 0 and its second turn (after
        # the held calculator call) is all 1; its first turn may have been running at the sync (paused there and
        # continued under 1: on a loaded machine the sync can come before group 3's first turns end)
        assert set(versions) <= {0, 1} and versions == sorted(versions)
        if len(set(versions)) > 1:
            across.append(r)
            assert versions[0] == 0 and versions[last0 + 1] == 1 and r["step"] == 2
        # every model token's rollout log-prob: a teacher-forced pass of the version it records (temperature 1)
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        got, want = torch.tensor(r["logprobs"]), []
        for model in models:
            with torch.no_grad():
                logits = model(ids).logits[0, len(r["prompt_ids"]) - 1:-1].float()
            want.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(r["response_ids"])[:, None])[:, 0])
        for v in (0, 1):
            mine = torch.tensor([m == 1 and x == v for m, x in zip(mask, versions)])
            if mine.any():
                assert torch.allclose(got[mine], want[v][mine], atol=1e-4), (r["step"], v, got[mine], want[v][mine])
                assert (got[mine] - want[1 - v][mine]).abs().max() > 1e-2  # the other version would not match
    assert len(across) == 2  # group 3's trajectories, trained at step 2
    m1, m2 = steps[1], steps[2]
    assert m1["fully_async/staleness/0"] == 2 and "fully_async/staleness/1" not in m1
    assert m2["fully_async/staleness/1"] == 1 and m2["fully_async/staleness/0"] == 1  # by the oldest token
    assert m2["fully_async/partial/samples_across_sync"] == 2 and m1["fully_async/partial/samples_across_sync"] == 0
    assert m2["fully_async/partial/max_partial_span"] == 1
    assert m1.get("agent/paused_turns", 0) == 0 and m2.get("agent/paused_turns", 0) <= 2  # group 3's first turns
    for m in (m1, m2):
        assert m["agent/tool_calls/mean"] == 1.0 and m["agent/tool_errors"] == 0.0
        assert m["response_length/mean"] == pytest.approx(m["agent/model_tokens/mean"])  # tool tokens not trained


def test_fully_async_multi_turn_validates_mid_stream(tmp_path, task):
    """fully_async with agent loops and validation every step: the rollout pool pauses its trajectories, runs the
    validation's agent loops on the same engine, and resumes them; both steps train, each validation reports the
    held-out reward of the weights of its step, and the trajectories validated call the calculator as the trained
    ones do. The step-2 validation (mid-stream, after the last weight sync) equals the synchronous trainer's
    validation of the exported final weights (its val_before_train, the path that
    test_trainer.py::test_validation_matches_standalone_eval checks against a standalone greedy evaluation).

    Mutation: the rollout worker validating with the training sampling params
    (`roles.train_sampling_params(self.cfg, 0)` for `roles.val_sampling_params(self.cfg)` in RolloutWorker.validate)
    -> fails (val/acc differs from the greedy evaluation's)."""
    args, tmp = task
    val = [f"data.val_files=[{tmp / 'train.parquet'}]", "data.max_val_samples=4"]
    out = tmp_path / "fully_async"
    launch("train.py", *args(out, 2), "trainer.save_freq=-1", "async_training.mode=fully_async",
           "rollout.n_gpus_per_node=1", *val, "trainer.test_freq=1", "trainer.export_hf_final=true", nproc=2)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in rows if r["kind"] == "train"}
    vals = [r for r in rows if r["kind"] == "val"]
    assert sorted(train) == [1, 2] and [v["step"] for v in vals] == [1, 2], [(r["kind"], r["step"]) for r in rows]
    for v in vals:
        assert v["val/policy_version"] == v["step"], v  # validated with the weights of its step
        assert v["val/agent/tool_calls/mean"] == 1.0 and v["val/agent/tool_errors"] == 0.0, v  # agent loops ran
    for m in train.values():
        assert m["agent/tool_calls/mean"] == 1.0 and m["agent/tool_errors"] == 0.0

    # the same validation set, greedy, on the exported step-2 weights, by the synchronous trainer before its step 1
    ref = tmp_path / "reference"
    launch("train.py", *args(ref, 1), f"actor_rollout_ref.model.path={out / 'hf_final'}", "trainer.save_freq=-1",
           *val, "trainer.val_before_train=true")
    want = [r for r in (json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "val"]
    assert [w["step"] for w in want] == [0]
    for k in ("val/acc", "val/agent/tool_calls/mean", "val/agent/model_tokens/mean", "val/agent/message_tokens/mean"):
        assert vals[-1][k] == pytest.approx(want[0][k], abs=1e-9), (k, vals[-1][k], want[0][k])
