"""The asynchronous trainers (one-step-off-policy and fully asynchronous) on CPU with gloo: the data bus's
bookkeeping, partial rollout's versions and log-probs, one-step-off against its synchronous reference, the
fully asynchronous trainer's staleness bound and sample accounting, and a SIGKILL + resume."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from e2e_helpers import parity_task, records
from subprocess_env import child_env

from rlhf_mcore.config import ConfigError, load_config, validate_config
from rlhf_mcore.parallel.pools import Mailbox, PoolLayout
from rlhf_mcore.trainer.databus import GroupMeta, Ledger, pull_orders, send_orders, staleness_metrics

ROOT = Path(__file__).resolve().parents[1]


def meta(uid, src=1, minv=0, maxv=None, tokens=10, prompt=None, spanning=None):
    partial = maxv not in (None, minv)
    return GroupMeta(uid=uid, src=src, nbytes=100, prompt=uid if prompt is None else prompt, tokens=tokens,
                     min_version=minv, max_version=minv if maxv is None else maxv, partial=partial,
                     spanning=int(partial) if spanning is None else spanning)


# ------------------------------------------------------------------------------------------------ unit
def test_ledger_accounting_and_staleness():
    led = Ledger()
    for uid, v in enumerate([0, 0, 1, 2, 2]):
        led.add(meta(uid, minv=v))
    led.check()
    stale = led.drop_stale(version=2, threshold=1)  # 2 - 0 > 1: the two version-0 groups
    assert [m.uid for m in stale] == [0, 1] and led.dropped == 2
    got = led.take([2, 3])
    assert [m.uid for m in got] == [2, 3] and list(led.queue) == [4]
    led.check()
    assert (led.produced, led.trained, led.dropped, len(led)) == (5, 2, 2, 1)
    led.produced += 1  # a group nobody accounted for
    with pytest.raises(RuntimeError, match="accounting"):
        led.check()


def test_staleness_histogram_and_partial_counts():
    ms = [meta(0, minv=3), meta(1, minv=2), meta(2, minv=2, maxv=3), meta(3, minv=1, maxv=3, spanning=3)]
    out = staleness_metrics(ms, version=3)
    assert out["fully_async/staleness/0"] == 1 and out["fully_async/staleness/1"] == 2
    assert out["fully_async/staleness/2"] == 1
    assert out["fully_async/count/stale_samples_processed"] == 3
    assert out["fully_async/partial/partial_ratio"] == 0.5 and out["fully_async/partial/max_partial_span"] == 2
    assert out["fully_async/partial/samples_across_sync"] == 4  # samples (trajectories) across a sync, summed


def test_orders_keep_groups_whole_and_route_to_model_parallel_ranks():
    chosen = [[meta(0, src=4), meta(1, src=5)], [meta(2, src=4)]]
    sends = send_orders(chosen, dp_ranks=[[0, 1], [2, 3]])  # DP rank 0 = ranks 0,1 (TP=2)
    assert sends == {4: [(0, [0, 1]), (2, [2, 3])], 5: [(1, [0, 1])]}
    assert pull_orders(chosen) == [[(4, 0, 100), (5, 1, 100)], [(4, 2, 100)]]


def test_mailbox_order_several_writers_and_cursor():
    store = dist.HashStore()
    a, b, reader = Mailbox(store, "coord"), Mailbox(store, "coord"), Mailbox(store, "coord")
    assert reader.poll() == []
    a.put(("group", 1))
    b.put(("group", 2))
    a.put(("stats", 3))
    assert reader.poll() == [("group", 1), ("group", 2), ("stats", 3)]
    b.put("late")
    assert reader.get(timeout_s=5) == "late" and reader.cursor == 4
    assert not store.check(["mb/coord/1"])  # read messages are deleted


def test_pool_layout():
    lay = PoolLayout(train_size=2, rollout_size=4, rollout_tp=2)
    assert lay.world_size == 6 and lay.replicas == 2 and lay.rollout_ranks == [2, 3, 4, 5]
    assert [lay.replica_leader(r) for r in range(2)] == [2, 4] and lay.replica_of(5) == 1
    assert not lay.is_rollout(1) and lay.is_rollout(2)
    with pytest.raises(ValueError):
        PoolLayout(1, 3, rollout_tp=2)


BASE = ["actor_rollout_ref.model.path=/x", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]


@pytest.mark.parametrize("overrides,world,fragments", [
    (["async_training.mode=fully_async"], 2, ["rollout.n_gpus_per_node"]),
    (["async_training.mode=one_step_off", "rollout.n_gpus_per_node=2"], 2, ["must add up", "2 processes"]),
    (["rollout.n_gpus_per_node=1"], 2, ["async_training.mode=one_step_off or fully_async"]),
    (["async_training.staleness_threshold=3"], 1, ["fully_async only"]),
    (["async_training.mode=fully_async", "rollout.n_gpus_per_node=1"], 2, ["data.train_batch_size=4"]),
    (["async_training.mode=fully_async", "rollout.n_gpus_per_node=1", "data.train_batch_size=4",
      "actor_rollout_ref.rollout.name=hf"], 2, ["does not stream"]),
    (["async_training.mode=one_step_off", "rollout.n_gpus_per_node=1", "algorithm.filter_groups.enable=true"], 2,
     ["filter_groups"]),
    (["async_training.mode=one_step_off", "rollout.n_gpus_per_node=1", "reward.judge.enable=true",
      "reward.judge.model_path=/judge"], 2, ["reward.judge.enable=true", "second rollout engine", "mode=off"]),
    (["async_training.mode=fully_async", "rollout.n_gpus_per_node=1", "data.train_batch_size=4",
      "reward_model.enable=true", "reward_model.reward_manager=prime", "algorithm.adv_estimator=rloo"], 2,
     ["reward_model.reward_manager=prime", "synchronous step", "mode=off"]),
    (["async_training.mode=one_step_off", "rollout.n_gpus_per_node=3",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], 4, ["multiple of"]),
])
def test_async_config_errors(overrides, world, fragments):
    base = BASE
    with pytest.raises(ConfigError) as e:
        validate_config(load_config(None, base + overrides), world)
    for f in fragments:
        assert f in str(e.value), str(e.value)


def test_async_config_accepted_layouts():
    base = BASE
    validate_config(load_config(None, base + ["async_training.mode=one_step_off", "rollout.n_gpus_per_node=1",
                                              "trainer.n_gpus_per_node=2",
                                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]), 3)  # DP=2
    validate_config(load_config(None, base + ["async_training.mode=fully_async", "rollout.n_gpus_per_node=1",
                                              "async_training.require_batches=2"]), 2)
    for mode in ("one_step_off", "fully_async", "fully_async partial_rollout=false"):  # agent loops
        mode, *more = mode.split()
        validate_config(load_config(None, base + [f"async_training.mode={mode}", "rollout.n_gpus_per_node=1",
                                                  "data.train_batch_size=4",
                                                  "actor_rollout_ref.rollout.multi_turn.enable=true",
                                                  *[f"async_training.{kv}" for kv in more]]), 2)
    for mode in ("one_step_off", "fully_async"):  # a reward model scores on the training pool
        validate_config(load_config(None, base + [f"async_training.mode={mode}", "rollout.n_gpus_per_node=1",
                                                  "data.train_batch_size=4", "reward_model.enable=true",
                                                  "reward_model.model.path=/rm"]), 2)


# ------------------------------------------------------------------------------------------------ partial rollout
def _perturbed(model_dir, k: int):
    """The model with seeded noise on every weight (k = 0: as saved): policy version k's stand-in."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(k)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * k * torch.randn(p.shape, generator=gen))
    return model


def _teacher_forced(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    """(R,) log-prob of each response token under `model`, the whole sequence in one pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_partial_rollout_versions_and_logprobs_match_the_weights_that_sampled_them(tiny_model_dir):
    """A sample paused after 5 tokens under weights A and continued under weights B carries versions
    [0]*5 + [1]*rest, and each token's log-prob equals a teacher-forced pass of the weights that sampled it."""
    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine
    from rlhf_mcore.trainer.sample_streams import SampleStream

    model_dir = tiny_model_dir("qwen2")
    engine = NativeRolloutEngine(model_dir, max_num_seqs=8, max_model_len=64, device="cpu")
    hf_a, hf_b = _perturbed(model_dir, 0), _perturbed(model_dir, 1)
    item = {"input_ids": [5, 17, 33, 2, 9]}
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=20, stop_token_ids=(), seed=3)
    stream = SampleStream(engine, params)
    stream.version = 0
    engine.open_stream(params)
    stream.add(7, item, None)
    for _ in range(4):  # the first token comes with the prefill
        assert stream.step() == []
    stream.pause()
    assert [len(v) for v in stream.versions[7]] == [5, 5]
    engine.update_weights(hf_b.state_dict().items())  # the new policy
    stream.version = 1
    stream.resume()
    done = []
    while not stream.drained():
        done += stream.step()
    engine.close_stream()
    assert len(done) == 2 and not stream.prompts  # the group's bookkeeping is gone with its last sample
    for uid, row in done:
        assert uid == 7 and row.versions == [0] * 5 + [1] * 15
        for model, lo, hi in ((hf_a, 0, 5), (hf_b, 5, 20)):
            want = _teacher_forced(model, item["input_ids"], row.response_ids)
            got = torch.tensor(row.logprobs)
            assert torch.allclose(got[lo:hi], want[lo:hi], atol=1e-4), (model is hf_a, got[lo:hi], want[lo:hi])


class _GatedAgents:
    """The fully asynchronous rollout's agent loops on the native engine, driven by hand: two trajectories of one
    multiply row (a model turn, the row's calculator call, a model turn), a calculator that answers once `gate` is
    set, and four policy versions (`models`, seeded perturbations of the tiny model)."""

    def __init__(self, tiny_model_dir, partial: bool):
        import threading

        from agent_helpers import fixture_tokenizer

        from rlhf_mcore.agents import AgentLoop, AgentRunner, MultiTurnSettings, parse_tool_calls, register_agent
        from rlhf_mcore.agents.calculator import Calculator
        from rlhf_mcore.agents.runner import AgentStream
        from rlhf_mcore.agents.tasks import multiply_rows
        from rlhf_mcore.rollout import SamplingParams
        from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

        @register_agent("test_async_calculator_agent", override=True)
        class CallsCalculator(AgentLoop):  # a model turn, the row's calculator call, a model turn
            async def run(self, row, traj):
                if await self.generate(traj) is None or traj.done:
                    return
                if traj.add_messages(await self.call_tools(traj, parse_tool_calls(row["extra_info"]["answer"])),
                                     role="tool"):
                    await self.generate(traj)

        self.gate, self.arrived = threading.Event(), []
        gate, arrived = self.gate, self.arrived

        class GatedCalculator(Calculator):  # the call returns once the test opens the gate
            def __call__(self, **arguments):
                arrived.append(1)
                assert gate.wait(60)
                return super().__call__(**arguments)

        model_dir = tiny_model_dir("qwen2")
        self.tok, end = fixture_tokenizer(model_dir, "qwen2")
        self.engine = NativeRolloutEngine(model_dir, max_num_seqs=4, max_model_len=512, device="cpu",
                                          dtype="float32")
        runner = AgentRunner(self.engine, self.tok, MultiTurnSettings(max_tokens_per_turn=12),
                             {"calculator": GatedCalculator()})
        self.row = multiply_rows(1, digits=3)[0]
        self.row.update(agent_name="test_async_calculator_agent", raw_prompt=self.row["prompt"])
        prompt = self.tok(self.tok.apply_chat_template(self.row["prompt"], tools=runner.tool_schemas,
                                                       add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)["input_ids"]
        self.models = [_perturbed(model_dir, k) for k in range(4)]  # policy versions 0..3
        self.partial, self.done = partial, {}
        self.stream = AgentStream(runner, SamplingParams(n=2, temperature=1.0, max_new_tokens=60, seed=11,
                                                         stop_token_ids=(end,)), self.done.__setitem__)
        self.engine.open_stream(self.stream.params)
        self.stream.add(prompt, self.row, key=0)

    def sync(self, version: int) -> int:
        """As the rollout worker does: with partial rollout, pause the model turns; without, hold new turns back
        until the engine has drained. Then the new weights. Returns the turns paused."""
        if self.partial:
            paused = self.stream.pause()
        else:
            self.pump_until(lambda: self.engine.num_pending == 0, submit=False)
            paused = 0
        self.engine.update_weights(self.models[version].state_dict().items())
        self.stream.version = version
        return paused

    def pump_until(self, cond, submit: bool = True) -> None:
        t0 = time.time()
        while not cond():
            assert time.time() - t0 < 60
            self.stream.pump(submit=submit)

    def finish(self) -> dict:
        self.pump_until(lambda: not self.stream.unfinished)
        self.engine.close_stream()
        self.stream.close()
        assert sorted(self.done) == [0, 1]
        return self.done

    def check(self, t) -> tuple[int, int, int, int]:
        """Masks exactly on the calculator's answer; each model token's log-prob equals a teacher-forced pass of
        the version it records (and not of another). Returns the two model turns' (start, end) positions."""
        model_turns = [x for x in t.turns if x["role"] == "assistant"]
        assert len(model_turns) == 2
        (a0, a1), (b0, b1) = [(x["start"], x["end"]) for x in model_turns]
        assert t.response_mask == [1] * a1 + [0] * (b0 - a1) + [1] * (b1 - b0) and b1 == len(t.response_ids)
        tool_text = self.tok.decode(t.response_ids[a1:b0])
        assert f"<tool_response>\n{self.row['reward_model']['ground_truth']}\n</tool_response>" in tool_text, tool_text
        assert tool_text.endswith("<|im_start|>assistant\n")
        got, checked = torch.tensor(t.logprobs), 0
        for v, model in enumerate(self.models):
            mine = torch.tensor([m == 1 and x == v for m, x in zip(t.response_mask, t.versions)])
            if not mine.any():
                continue
            want = _teacher_forced(model, t.prompt_ids, t.response_ids)
            assert torch.allclose(got[mine], want[mine], atol=1e-4), (v, got[mine], want[mine])
            other = _teacher_forced(self.models[(v + 1) % 4], t.prompt_ids, t.response_ids)
            assert not torch.allclose(got[mine], other[mine], atol=1e-3)  # the versions' weights differ
            checked += int(mine.sum())
        assert checked == sum(t.response_mask)
        return a0, a1, b0, b1


def test_trajectories_paused_at_weight_syncs_keep_each_tokens_policy(tiny_model_dir):
    """The fully asynchronous rollout's agent loops across three weight syncs: one in each trajectory's first
    model turn, one while its calculator call runs, one in its second model turn. Each model turn is continued
    from its tokens; every token records the version that sampled it (tool tokens: the model token's before them)
    and its rollout log-prob equals a teacher-forced pass of that version's weights; the tool's answer is exactly
    the masked span."""
    run = _GatedAgents(tiny_model_dir, partial=True)
    for _ in range(3):  # the first turns' first 4 tokens (the first one comes with the prefill)
        run.stream.pump()
    assert run.sync(1) == 2  # both first turns paused mid-generation
    run.pump_until(lambda: len(run.arrived) == 2)  # both first turns finished; their calls run
    assert run.sync(2) == 0  # nothing in the engine: the calls are in flight and finish under the new weights
    run.gate.set()
    run.pump_until(lambda: run.engine.num_pending == 2)  # both second turns started
    run.stream.pump()
    run.stream.pump()
    assert run.sync(3) == 2  # ... and are paused mid-generation
    for t in run.finish().values():
        a0, a1, b0, b1 = run.check(t)
        assert a1 - a0 > 4 and t.stats["paused_turns"] == 2.0  # the first turn went on after its pause
        second = t.versions[b0:]  # 2 or more tokens under version 2 (the prefill's, a step's at least), then 3
        k = second.count(2)
        assert t.versions[:b0] == [0] * 4 + [1] * (a1 - 4) + [1] * (b0 - a1) and second == [2] * k + [3] * (b1 - b0 - k)
        assert k >= 2 and second[-1] == 3  # paused mid-turn, continued under version 3


def test_trajectories_without_partial_rollout_finish_their_turn_before_a_sync(tiny_model_dir):
    """async_training.partial_rollout=false with agent loops: a sync requested mid-turn waits for the engine's
    turns to finish under the old weights (no new turn starts meanwhile: `pump(submit=False)`), so every model
    turn is sampled by one version; the next turns run under the new weights."""
    run = _GatedAgents(tiny_model_dir, partial=False)
    for _ in range(3):
        run.stream.pump()
    run.gate.set()  # the calculator answers at once: a second turn could start while the engine drains
    assert run.engine.num_pending == 2
    run.pump_until(lambda: run.engine.num_pending == 0, submit=False)  # a sync waits: the first turns end (v0)
    t0 = time.time()
    while len(run.arrived) < 2 or time.time() - t0 < 0.5:  # the calls run and answer; the scheduler takes them
        run.stream.pump(submit=False)
        time.sleep(0.01)
    assert run.engine.num_pending == 0 and run.stream.unfinished == 2  # ... and no second turn has started
    assert run.sync(1) == 0
    for t in run.finish().values():
        a0, a1, b0, b1 = run.check(t)
        assert t.stats.get("paused_turns", 0.0) == 0.0
        assert t.versions == [0] * b0 + [1] * (b1 - b0)  # first turn (and the tool's tokens) v0, second turn v1


# ------------------------------------------------------------------------------------------------ end to end
def _setup(tmp_path, tiny_model_dir):
    return parity_task(tmp_path, tiny_model_dir("qwen2"), max_response_length=12) + [
        "actor_rollout_ref.actor.optim.lr=1e-3", "algorithm.adv_estimator=grpo", "trainer.export_hf_final=false",
        "trainer.max_rollout_logprob_gap=null"]


def _env():
    return child_env(OMP_NUM_THREADS="1")


def _torchrun(nproc, args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(ROOT / "launch" / "train.py"), *args]


def test_one_step_off_equals_its_synchronous_reference(tmp_path, tiny_model_dir):
    """1 rollout + 1 training process against one process whose step k is generated by the weights of step k-1's
    start (built from the synchronous trainer's parts): the same metrics, step by step."""
    args = _setup(tmp_path, tiny_model_dir) + ["trainer.total_training_steps=4", "trainer.save_freq=2"]
    ref = subprocess.run([sys.executable, str(ROOT / "tests" / "workers" / "one_step_off_reference.py"), *args,
                          f"trainer.default_local_dir={tmp_path / 'ref'}"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-4000:]
    run = subprocess.run(_torchrun(2, args + [f"trainer.default_local_dir={tmp_path / 'osp'}",
                                              "async_training.mode=one_step_off", "rollout.n_gpus_per_node=1"]),
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    want, got = records(tmp_path / "ref"), records(tmp_path / "osp")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    keys = ["critic/score/mean", "critic/advantages/mean", "response_length/mean", "actor/pg_loss", "actor/entropy",
            "actor/grad_norm", "rollout/k3_kl", "actor/ppo_kl"]
    for w, g in zip(want, got):
        for k in keys:
            assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), (g["step"], k, g[k], w[k])
    assert got[1]["one_step_off/staleness/1"] == 4 and got[0]["one_step_off/staleness/0"] == 4
    assert got[2]["rollout/k3_kl"] > 0  # generated one update behind: off-policy, as in the reference

    # resumed from the step-2 checkpoint (steps 3 and 4 in flight are regenerated): the same prompts, each once
    resumed = tmp_path / "osp_resumed"
    shutil.copytree(tmp_path / "osp", resumed)
    shutil.rmtree(resumed / "checkpoints" / "global_step_4")
    osp_args = ["async_training.mode=one_step_off", "rollout.n_gpus_per_node=1"]
    run = subprocess.run(_torchrun(2, args + [f"trainer.default_local_dir={resumed}", *osp_args]),
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "resumed from" in run.stdout + run.stderr
    assert [r["step"] for r in records(resumed)] == [1, 2, 3, 4]

    def trained(out):
        return json.loads((out / "checkpoints" / "global_step_4" / "trainer_state_rank0.json").read_text())[
            "trained_prompts"]

    assert trained(resumed) == trained(tmp_path / "osp") and len(set(trained(resumed))) == 16


def test_fully_async_staleness_accounting_kill_and_resume(tmp_path, tiny_model_dir):
    """Fully async (1 rollout + 1 training process, partial rollout): no trained sample staler than the threshold,
    produced = trained + dropped + queued at every step; killed (SIGKILL to the whole job) after a checkpoint and
    resumed, every prompt's samples are trained once and none is lost."""
    from rlhf_mcore.data import ResumableSampler

    out = tmp_path / "fa"
    args = _setup(tmp_path, tiny_model_dir) + [
        f"trainer.default_local_dir={out}", "async_training.mode=fully_async", "rollout.n_gpus_per_node=1",
        "trainer.total_training_steps=8", "trainer.save_freq=2", "async_training.staleness_threshold=1",
        "data.max_response_length=24", "actor_rollout_ref.rollout.max_num_seqs=8"]
    job = subprocess.Popen(_torchrun(2, args), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    kill_after = 3 + int(time.time()) % 3  # steps 3..5: after the step-2 checkpoint, at a varying moment
    try:
        t0 = time.time()
        while time.time() - t0 < 300:
            if (out / "metrics.jsonl").exists() and len(records(out)) >= kill_after:
                break
            assert job.poll() is None, "the job ended before it was killed"
            time.sleep(0.2)
        os.killpg(job.pid, signal.SIGKILL)
    finally:
        job.wait()
    assert (out / "checkpoints").exists()
    resumed = subprocess.run(_torchrun(2, args), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    logged = records(out)
    assert [r["step"] for r in logged] == list(range(1, 9))
    for r in logged:
        thr_ok = all(int(k.rsplit("/", 1)[1]) <= 1 for k in r if k.startswith("fully_async/staleness/"))
        assert thr_ok, r
        c = {k.rsplit("/", 1)[1]: v for k, v in r.items() if k.startswith("fully_async/count/")}
        assert c["produced_samples"] == c["trained_samples"] + c["dropped_samples_total"] + c["queued_samples"]
        assert c["trained_samples"] == r["step"] * 4 * 4
    final = sorted((out / "checkpoints").glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))[-1]
    state = json.loads((final / "trainer_state_rank0.json").read_text())  # the coordinator's
    trained, regrant, dropped = state["trained_prompts"], state["regrant"], state["dropped_prompts"]
    assert len(trained) == 8 * 4 and len(set(trained)) == len(trained), trained  # each prompt trained once
    drawn = ResumableSampler(64, shuffle=True, seed=1).next_batch(len(trained) + len(regrant) + len(dropped))
    assert sorted(trained + regrant + dropped) == sorted(drawn)  # none lost: trained, dropped (counted) or pending


def _rm_rows(path: Path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(x) for f in sorted(path.parent.glob(path.name + ".rank*")) for x in f.read_text().splitlines()]
    return [x for x in lines if "ids" in x], [x for x in lines if "metrics" in x]


# "fully_async" passes as well (the same rows, the same checks); its own launch is more than the suite's time budget
@pytest.mark.parametrize("mode", ["one_step_off"])
def test_reward_model_scores_every_trained_row(tmp_path, tiny_model_dir, mode):
    """A reward model on the training pool (1 rollout + 2 training processes: each DP rank scores the rows it
    pulled; its weights offloaded between scorings): every trained row's reward equals reward_weight x the
    transformers sequence classifier's score of that row + rule_weight x the rule score + the overlong penalty,
    each computed offline from the row's tokens; the step's `reward_model/*` metrics describe all ranks' rows;
    the weights are off the device after each step. tests/workers/async_reward_rows.py records the rows."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_mcore.rewards.overlong import overlong_penalty

    policy = tiny_model_dir("qwen2")
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1, dtype=torch.float32)
    rm.save_pretrained(tmp_path / "rm")
    tok = AutoTokenizer.from_pretrained(policy)
    tok.save_pretrained(tmp_path / "rm")
    mode_args = (["async_training.mode=one_step_off"] if mode == "one_step_off" else
                 ["async_training.mode=fully_async", "async_training.staleness_threshold=1",
                  "actor_rollout_ref.rollout.max_num_seqs=8"])
    args = _setup(tmp_path, tiny_model_dir) + mode_args + [
        "rollout.n_gpus_per_node=1", "trainer.n_gpus_per_node=2", "trainer.total_training_steps=2",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "reward_model.enable=true", f"reward_model.model.path={tmp_path / 'rm'}", "reward_model.reward_weight=2.0",
        "reward_model.rule_weight=0.5", "reward_model.micro_batch_size_per_gpu=4",
        "reward_model.megatron.param_offload=true", "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=6", "reward_model.overlong_buffer.penalty_factor=1.0"]
    cmd = _torchrun(3, args + ["--rows", str(tmp_path / "rows.jsonl")])
    cmd[cmd.index(str(ROOT / "launch" / "train.py"))] = str(ROOT / "tests" / "workers" / "async_reward_rows.py")
    run = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    rows, steps = _rm_rows(tmp_path / "rows.jsonl")
    assert [s["step"] for s in steps] == [1, 2] and len(rows) == 2 * 4 * 4
    assert {(r["step"], r["rank"]) for r in rows} == {(s, k) for s in (1, 2) for k in (0, 1)}  # both DP ranks
    rm.eval()
    rm_scores, rules = [], []
    for r in rows:
        with torch.no_grad():
            rm_scores.append(float(rm(torch.tensor([r["ids"]])).logits[0, 0]))
        rule = float(len(tok.decode(r["response"], skip_special_tokens=True)) % 2)  # the task's parity reward
        rules.append(rule)
        penalty = overlong_penalty([len(r["response"])], 12, 6, 1.0)[0]
        assert r["score"] == pytest.approx(2.0 * rm_scores[-1] + 0.5 * rule + penalty, abs=1e-4), r
        assert r["rm_offloaded"]
    assert len({round(s, 4) for s in rm_scores}) > len(rows) // 2  # distinct scores: a row scored as another shows
    for s in steps:
        mine = [x for x, r in zip(rm_scores, rows) if r["step"] == s["step"]]
        m = s["metrics"]
        assert m["reward_model/num_scored"] == m["reward_model/num_scored_after"] == 16
        assert m["reward_model/score_mean"] == pytest.approx(sum(mine) / len(mine), abs=1e-4)
        rule_mine = [x for x, r in zip(rules, rows) if r["step"] == s["step"]]  # the rule score logged beside it
        assert m["reward_model/rule_score_mean"] == pytest.approx(sum(rule_mine) / len(rule_mine), abs=1e-6)
        assert m["timing_s/reward_model"] > 0
