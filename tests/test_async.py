"""The asynchronous trainers (one-step-off-policy and fully asynchronous) on CPU with gloo: the data bus's
bookkeeping, partial rollout's versions and log-probs, one-step-off against its synchronous reference, fully async
at staleness threshold 0 against its own, the fully asynchronous trainer's stale-sample drop (a group held back by
its rollout worker until it must be dropped), each trained row's staleness from the row itself, both sides of the
data bus compared (tests/scripts/async_observers.py), a reward model in both modes, and a SIGKILL + resume."""
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from e2e_helpers import (
    check_buckets,
    check_plain_log,
    check_reward_workers,
    check_summary,
    parity_task,
    process_names,
    records,
    spans_in,
    step_phases,
    trace_tracks,
)
from launcher import run as run_script
from launcher import start, wait_all

from rlhf_mcore.config import ConfigError, load_config, validate_config
from rlhf_mcore.parallel.pools import Mailbox, PoolLayout
from rlhf_mcore.trainer.databus import GroupMeta, Ledger, pull_orders, send_orders, staleness_metrics

pytestmark = pytest.mark.cost(110)

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


def test_idle_backoff_lengthens_idle_turns_and_resets_after_work(monkeypatch):
    """The fully asynchronous rollout worker's idle turns sleep 1, 2, 4, ... ms up to 20 (a replica with nothing to
    do polls its mailbox at 50 Hz, not 500) and a busy turn brings the next idle one back to 1 ms.
    Mutation: `reset` not restoring `first_s` -> fails."""
    from rlhf_mcore.parallel import pools

    slept = []
    monkeypatch.setattr(pools.time, "sleep", slept.append)
    idle = pools.IdleBackoff(first_s=0.001, max_s=0.02)
    for _ in range(7):
        idle.wait()
    idle.reset()
    idle.wait()
    assert slept == pytest.approx([0.001, 0.002, 0.004, 0.008, 0.016, 0.02, 0.02, 0.001])


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
    # at step k the rollout holds the weights of the last sync, up to trigger - 1 versions behind: all stale
    (["async_training.mode=fully_async", "rollout.n_gpus_per_node=1", "data.train_batch_size=4",
      "async_training.trigger_parameter_sync_step=3", "async_training.staleness_threshold=1"], 2,
     ["async_training.staleness_threshold=1", "trigger_parameter_sync_step - 1 = 2", "never finish"]),
    (["async_training.mode=one_step_off", "rollout.n_gpus_per_node=1", "algorithm.filter_groups.enable=true"], 2,
     ["filter_groups"]),
    (["async_training.mode=one_step_off", "rollout.n_gpus_per_node=1", "reward.judge.enable=true",
      "reward.judge.model_path=/judge"], 2, ["reward.judge.enable=true", "second rollout engine", "mode=off"]),
    (["async_training.mode=fully_async", "rollout.n_gpus_per_node=1", "data.train_batch_size=4",
      "reward_model.enable=true", "reward_model.reward_manager=prime", "algorithm.adv_estimator=rloo"], 2,
     ["reward_model.reward_manager=prime", "synchronous step", "mode=off"]),
    (["async_training.mode=one_step_off", "rollout.n_gpus_per_node=3",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], 4, ["multiple of"]),
    (["async_training.prefetch_weights=true"], 1, ["prefetch_weights=True", "mode=one_step_off only"]),
    (["async_training.mode=fully_async", "rollout.n_gpus_per_node=1", "async_training.prefetch_weights=true"], 2,
     ["prefetch_weights=True", "mode=one_step_off only", "the mode is fully_async"]),
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
    validate_config(load_config(None, base + ["async_training.mode=one_step_off", "rollout.n_gpus_per_node=1",
                                              "async_training.prefetch_weights=true"]), 2)
    validate_config(load_config(None, base + ["async_training.mode=fully_async", "rollout.n_gpus_per_node=1",
                                              "async_training.require_batches=2"]), 2)
    validate_config(load_config(None, base + ["async_training.mode=fully_async", "rollout.n_gpus_per_node=1",
                                              "data.train_batch_size=4", "async_training.trigger_parameter_sync_step=2",
                                              "async_training.staleness_threshold=1"]), 2)  # the lag, at most
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
    [0]*5 + [1]*rest, and each token's log-prob equals a teacher-forced pass of the weights that sampled it and
    differs from the other version's (so the equality is not vacuous: the two weight versions score the tokens
    measurably apart). Mutation: `_perturbed`'s noise 0.05 * k -> 0 (both versions the same weights: the equality
    would hold whichever weights sampled) -> fails the guard."""
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
        got = torch.tensor(row.logprobs)
        for model, other, lo, hi in ((hf_a, hf_b, 0, 5), (hf_b, hf_a, 5, 20)):
            want = _teacher_forced(model, item["input_ids"], row.response_ids)
            assert torch.allclose(got[lo:hi], want[lo:hi], atol=1e-4), (model is hf_a, got[lo:hi], want[lo:hi])
            theirs = _teacher_forced(other, item["input_ids"], row.response_ids)
            assert (got[lo:hi] - theirs[lo:hi]).abs().max() > 1e-2, (model is hf_a, got[lo:hi], theirs[lo:hi])


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
    # the calls run and answer, and the scheduler takes their answers: both second turns wait to be submitted (no
    # clock: the scheduler's own state says when; 60 s only bounds a hang)
    run.pump_until(lambda: len(run.arrived) == 2 and run.stream._tool_waiting == 0 and len(run.stream._queue) == 2,
                   submit=False)
    assert run.engine.num_pending == 0 and run.stream.unfinished == 2  # ... and none has started
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


def _with_reference(reference: str, ref_args: list[str], script: str, args: list[str]) -> None:
    """tests/scripts/`reference` (one process) and the asynchronous run (`script` under a 2-process torchrun) side by
    side (the asynchronous run's pools wait for each other in turn, so the two share the cores well); both must
    succeed."""
    ref = start(f"tests/scripts/{reference}", *ref_args, stderr=subprocess.STDOUT)
    try:
        run_script(script, *args, nproc=2)
        wait_all({reference: ref}, timeout=600)
    finally:
        ref.kill()


def _jsonl(out: Path, stem: str) -> list[dict]:
    """tests/scripts/async_observers.py's records of every rank (`bus`: the rollout side, `trained`: the trainer's)."""
    return [json.loads(x) for f in sorted(out.glob(f"{stem}.rank*.jsonl")) for x in f.read_text().splitlines()]


def _check_trained_rows(trained: list[dict], bus: list[dict], threshold: int, n: int = 4) -> dict[int, set]:
    """What both sides of the data bus saw agrees, row by row: every trained row is of a group a rollout worker
    published (the same prompt, the same per-token versions), each group trained once and whole (n rows) and never
    also dropped, and no row staler than `threshold`: the trainer's policy version when its step took it less the
    row's oldest token's version (from the row itself, not from the coordinator's metadata). Returns the trained
    uids by step."""
    published = {e["uid"]: e for e in bus if e["event"] == "published"}
    dropped = {e["uid"] for e in bus if e["event"] == "dropped"}
    by_uid: dict[int, list] = {}
    for r in trained:
        assert r["uid"] in published, r
        pub = published[r["uid"]]
        assert r["prompt"] == pub["prompt"] and r["versions"] == pub["versions"][r["sample"]], (r, pub)
        assert r["trainer_version"] - min(r["versions"]) <= threshold, r
        by_uid.setdefault(r["uid"], []).append(r)
    for rows in by_uid.values():
        assert sorted(r["sample"] for r in rows) == list(range(n)) and len({r["step"] for r in rows}) == 1, rows
    assert not dropped & set(by_uid), dropped & set(by_uid)  # a dropped group is never trained
    steps: dict[int, set] = {}
    for uid, rows in by_uid.items():
        steps.setdefault(rows[0]["step"], set()).add(uid)
    return steps


def test_one_step_off_equals_its_synchronous_reference(tmp_path, tiny_model_dir):
    """1 rollout + 1 training process against one process whose step k is generated by the weights of step k-1's
    start (built from the synchronous trainer's parts): the same metrics, step by step. The rollout takes the
    weights of steps 1 and 2 in the background while it generates steps 2 and 3 (`prefetch_weights=true`; its
    trace shows it; the resumed run below keeps the default, false) and loads them only after. Mutation: the
    announced version loaded before the step it arrives during is generated -> step 2's scores differ from the
    reference's (0.375 vs 0.4375); mutation: prefetch ignored (`Generate.prefetch` always None) -> the trace
    check fails; mutation: the rollout worker's StepStats leaving out `rollout_engine/*` -> KeyError."""
    args = _setup(tmp_path, tiny_model_dir) + ["trainer.total_training_steps=4", "trainer.save_freq=2"]
    _with_reference("one_step_off_reference.py", args + [f"trainer.default_local_dir={tmp_path / 'ref'}"],
                    "launch/train.py", args + [f"trainer.default_local_dir={tmp_path / 'osp'}", "trainer.trace=true",
                                               "async_training.mode=one_step_off", "rollout.n_gpus_per_node=1",
                                               "async_training.prefetch_weights=true"])
    want, got = records(tmp_path / "ref"), records(tmp_path / "osp")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    keys = ["critic/score/mean", "critic/advantages/mean", "response_length/mean", "actor/pg_loss", "actor/entropy",
            "actor/grad_norm", "rollout/k3_kl", "actor/ppo_kl"]
    for w, g in zip(want, got):
        for k in keys:
            assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), (g["step"], k, g[k], w[k])
    assert got[1]["one_step_off/staleness/1"] == 4 and got[0]["one_step_off/staleness/0"] == 4
    assert got[2]["rollout/k3_kl"] > 0  # generated one update behind: off-policy, as in the reference
    # the rollout pool's engine counters reach the step's metrics (with its StepStats)
    assert all(g["rollout_engine/decode_steps"] > 0 and g["rollout_engine/graph_captures"] == 0 for g in got), got[0]
    # the weights of steps 1 and 2 reached the rollout while it generated steps 2 and 3 (prefetch_weights)
    _check_async_trace(tmp_path / "osp" / "trace.json", "one_step_off", [1, 2, 3, 4], train_ranks=(0,),
                       rollout_ranks=(1,), phases=[p for p in TRAIN_PHASES if p != "reward_model"], sequences=16,
                       checkpoints=(2, 4), run_dir=tmp_path / "osp", prefetch=True)

    # resumed from the step-2 checkpoint (steps 3 and 4 in flight are regenerated): the same prompts, each once
    resumed = tmp_path / "osp_resumed"
    shutil.copytree(tmp_path / "osp", resumed)
    shutil.rmtree(resumed / "checkpoints" / "global_step_4")
    osp_args = ["async_training.mode=one_step_off", "rollout.n_gpus_per_node=1"]
    proc = run_script("launch/train.py", *args, f"trainer.default_local_dir={resumed}", *osp_args, "trainer.trace=true",
                      "trainer.logger=[jsonl,console]", nproc=2)
    assert "resumed from" in proc.stdout + proc.stderr
    assert [r["step"] for r in records(resumed)] == [1, 2, 3, 4]
    check_plain_log(proc.stdout, proc.stderr, ["step 3/4 | reward", "step 4/4 | reward", "resumed from"])
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]  # the resume's FutureWarnings: silenced at their source
    summary = check_summary(proc.stdout, resumed)  # its numbers are metrics.jsonl's
    assert f"  plots               {resumed / 'plots' / 'curves.png'}" in summary  # drawn (console + jsonl loggers)
    assert f"  trace               {resumed / 'trace.json'} (open in ui.perfetto.dev)" in summary
    # its timeline (trainer.trace=true: <run dir>/trace.json): rank 0 trains, rank 1 is the rollout replica
    _check_async_trace(resumed / "trace.json", "one_step_off", [3, 4], train_ranks=(0,), rollout_ranks=(1,),
                       phases=[p for p in TRAIN_PHASES if p != "reward_model"], sequences=16, checkpoints=(4,),
                       run_dir=resumed)

    def trained(out):
        return json.loads((out / "checkpoints" / "global_step_4" / "trainer_state_rank0.json").read_text())[
            "trained_prompts"]

    assert trained(resumed) == trained(tmp_path / "osp") and len(set(trained(resumed))) == 16


def test_fully_async_at_threshold_0_equals_its_synchronous_reference(tmp_path, tiny_model_dir):
    """staleness_threshold=0 and partial_rollout=false (single-turn): the grant limit hands out one step's prompts at
    a time, after the weights of the step before were pushed, so every trained row is staleness 0 (checked row by
    row, from the rows' own versions, by tests/scripts/async_stream_rows.py's observer) and nothing is dropped; its
    first 2 steps log the metrics of tests/scripts/fully_async_reference.py, one process built from the synchronous
    trainer's parts. What each side of the data bus saw agrees (every trained group published, sent once, whole).
    At threshold 0 no group can become stale (each is granted after the weights it will be trained against were
    pushed), so the drop itself is exercised at threshold 1 (test_reward_model_scores_every_trained_row[fully_async]).
    Mutations: `TrainingPool.to_batch`'s `r.prompt_pos = pos` -> `= 0` (every row in one GRPO group) -> fails; the
    grant limit `(staleness_threshold + version + 1) * g` -> `+ 2` (groups sampled a version early, dropped, their
    prompts lost) -> fails."""
    steps = 2
    args = _setup(tmp_path, tiny_model_dir) + [f"trainer.total_training_steps={steps}",
                                               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"]
    bus = tmp_path / "bus"
    bus.mkdir()
    fa = args + [f"trainer.default_local_dir={tmp_path / 'fa'}", "async_training.mode=fully_async",
                 "rollout.n_gpus_per_node=1", "async_training.staleness_threshold=0",
                 "async_training.partial_rollout=false", "actor_rollout_ref.rollout.max_num_seqs=8", "--bus", str(bus)]
    _with_reference("fully_async_reference.py", args + [f"trainer.default_local_dir={tmp_path / 'ref'}"],
                    "tests/scripts/async_stream_rows.py", fa)
    want, got = records(tmp_path / "ref"), records(tmp_path / "fa")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, steps + 1))
    for w, g in zip(want, got):
        assert [k for k in g if k.startswith("fully_async/staleness/")] == ["fully_async/staleness/0"], g
        assert g["fully_async/staleness/0"] == 4 and g["fully_async/count/dropped_samples_total"] == 0
        for k in ["critic/score/mean", "critic/advantages/mean", "response_length/mean", "actor/pg_loss",
                  "actor/entropy", "actor/grad_norm", "actor/ppo_kl"]:
            assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), (g["step"], k, g[k], w[k])
    assert want[1]["actor/grad_norm"] > 0 and want[0]["critic/score/std"] > 0  # the updates moved the weights
    events = _jsonl(bus, "bus")
    trained = _jsonl(bus, "trained")
    by_step = _check_trained_rows(trained, events, threshold=0)
    assert {r["trainer_version"] for r in trained} == set(range(steps))
    assert all(set(r["versions"]) == {r["trainer_version"]} for r in trained)  # every token of the training policy
    assert by_step == {s: set(range((s - 1) * 4, s * 4)) for s in range(1, steps + 1)}  # uids granted in order
    sent = [e["uid"] for e in events if e["event"] == "sent"]
    assert sorted(sent) == list(range(steps * 4)) and not [e for e in events if e["event"] == "dropped"]


@pytest.mark.parametrize("kill_after", [3])
def test_fully_async_staleness_accounting_kill_and_resume(tmp_path, tiny_model_dir, kill_after, capsys):
    """Fully async (1 rollout + 1 training process, partial rollout, staleness_threshold=1), killed (SIGKILL to the
    whole job) at the end of step `kill_after` (a parameter, printed: tests/scripts/async_stream_rows.py's hook kills
    the process group itself, so the moment is a step boundary whatever the machine's speed; groups are then in
    flight on the rollout pool and queued on the bus), resumed from the last checkpoint before it (save_freq=2):
    every trained row within the threshold by its own versions and the trainer's version, each row of a group its
    rollout worker published, the prompts the checkpoint says were trained are the rows that were trained (the
    trainer's observer, both runs), every prompt's samples trained once and none lost. Mutation: the resume
    forgetting the groups in flight (`FullyAsync.load_state_dict` not restoring `regrant`) -> fails."""
    from rlhf_mcore.data import ResumableSampler

    with capsys.disabled():
        print(f"\nfully_async kill and resume: SIGKILL at the end of step {kill_after}")
    out, runs, steps = tmp_path / "fa", [tmp_path / "bus1", tmp_path / "bus2"], 6
    args = _setup(tmp_path, tiny_model_dir) + [
        f"trainer.default_local_dir={out}", "async_training.mode=fully_async", "rollout.n_gpus_per_node=1",
        f"trainer.total_training_steps={steps}", "trainer.save_freq=2", "async_training.staleness_threshold=1",
        "data.max_response_length=24", "actor_rollout_ref.rollout.max_num_seqs=8"]
    for d in runs:
        d.mkdir()
    killed = run_script("tests/scripts/async_stream_rows.py", *args, "--bus", str(runs[0]), "--kill-after",
                        str(kill_after), nproc=2, check=False, zygote=False)  # it kills its torchrun agent too
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-4000:])
    assert [r["step"] for r in records(out)] == list(range(1, kill_after + 1))
    resumed = run_script("tests/scripts/async_stream_rows.py", *args, "--bus", str(runs[1]), nproc=2)
    at = kill_after // 2 * 2  # the last checkpoint at or before the kill
    assert f"resumed from {out / 'checkpoints' / f'global_step_{at}'}" in resumed.stdout + resumed.stderr
    logged = records(out)
    assert [r["step"] for r in logged] == list(range(1, steps + 1))
    for r in logged:
        assert all(int(k.rsplit("/", 1)[1]) <= 1 for k in r if k.startswith("fully_async/staleness/")), r
        assert r["fully_async/count/trained_samples"] == r["step"] * 4 * 4
    by_step = {}
    for d, kept in zip(runs, (range(1, at + 1), range(at + 1, steps + 1))):  # what each run trained that stayed
        trained = [r for r in _jsonl(d, "trained") if r["step"] in kept]
        uids = _check_trained_rows(trained, _jsonl(d, "bus"), threshold=1)
        assert sorted(uids) == list(kept)
        for r in trained:
            by_step.setdefault(r["step"], set()).add(r["prompt"])
    final = sorted((out / "checkpoints").glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))[-1]
    state = json.loads((final / "trainer_state_rank0.json").read_text())  # the coordinator's
    trained, regrant, dropped = state["trained_prompts"], state["regrant"], state["dropped_prompts"]
    assert [set(trained[4 * k:4 * k + 4]) for k in range(steps)] == [by_step[s] for s in range(1, steps + 1)]
    assert len(trained) == steps * 4 and len(set(trained)) == len(trained), trained  # each prompt trained once
    drawn = ResumableSampler(64, shuffle=True, seed=1).next_batch(len(trained) + len(regrant) + len(dropped))
    assert sorted(trained + regrant + dropped) == sorted(drawn)  # none lost: trained, dropped (counted) or pending


TRAIN_PHASES = ["wait", "reward_model", "old_log_prob", "adv", "update", "sync"]  # a pool step with a reward model


def _check_async_trace(path: Path, mode: str, steps: list[int], train_ranks=(0, 1), rollout_ranks=(2,),
                       phases=TRAIN_PHASES, sequences: int = 8, reward_workers: int = 0,
                       checkpoints: tuple[int, ...] = (), run_dir: Path | None = None, prefetch: bool = False) -> None:
    """The trainer.trace file of an asynchronous run: a named track per rank, every training rank's steps in order
    with their phases in order inside them (tracks nest: e2e_helpers.trace_tracks), the actor's mini-batches inside
    each update, the checkpoints' spans, the rollout ranks' work, each weight version's buckets (sent by training
    rank 0 and received by every rollout rank bucket by bucket, tensors and bytes; as many as the step's `sync/*`
    metrics in `run_dir`'s metrics.jsonl say), every rollout rank's reward workers on tracks of their own
    (`reward_workers`: reward.num_workers), and one clock: each weight version's broadcast on training rank 0
    overlaps its receipt on every rollout rank."""
    names = process_names(path)
    assert sorted(names) == sorted([*train_ranks, *rollout_ranks]), names
    assert all(" · train" in names[r] for r in train_ranks), names
    assert all("rollout replica" in names[r] for r in rollout_ranks), names
    tracks = trace_tracks(path)
    for r in train_ranks:
        main = tracks[(r, 0)]
        assert step_phases(main) == {k: phases for k in steps}, (r, step_phases(main))
        step_spans = [e for e in main if e["name"] == "step"]
        assert [e["args"]["step"] for e in step_spans] == steps  # in time order
        assert all(e["args"]["sequences"] == sequences and e["args"]["tokens"] > 0 for e in step_spans)
        pulls = [e for e in main if e["name"] == "data-bus pull"]
        assert [e["args"]["step"] for e in pulls] == steps and all(e["args"]["bytes"] > 0 for e in pulls)
        for u in (e for e in main if e["name"] == "update"):
            minis = spans_in(main, u, "actor mini-batch")
            assert minis and sum(m["args"]["sequences"] for m in minis) == sequences, (u, minis)
        assert [e["args"]["step"] for e in main if e["name"] == "checkpoint"] == list(checkpoints)
    main0 = tracks[(train_ranks[0], 0)]
    sent = {e["args"]["version"]: e for e in main0 if e["name"] == "broadcast weights"}
    logged = {r["step"]: r for r in records(run_dir) if r["kind"] == "train"} if run_dir is not None else {}
    sent_buckets = {v: [(b["args"]["tensors"], b["args"]["bytes"]) for b in spans_in(main0, e, "weight bucket")]
                    for v, e in sent.items()}
    assert all(len(b) >= 1 for b in sent_buckets.values()), sent_buckets
    for v in set(sent) & set(logged):  # a step's push, as its metrics say
        check_buckets(main0, sent[v], logged[v])
    for r in rollout_ranks:
        work = [e for evs in (v for k, v in tracks.items() if k[0] == r) for e in evs]
        track_of = {id(e): k for k, evs in tracks.items() if k[0] == r for e in evs}
        got = {e["args"]["version"]: e for e in work if e["name"] == "receive weights"}
        assert got and set(got) <= set(sent), (sorted(got), sorted(sent))
        for v, e in got.items():  # a collective: both sides inside it at once, on the one clock
            b = sent[v]
            assert e["ts"] <= b["ts"] + b["dur"] and b["ts"] <= e["ts"] + e["dur"], (v, b, e)
            received = [(x["args"]["tensors"], x["args"]["bytes"])
                        for x in spans_in(tracks[track_of[id(e)]], e, "weight bucket")]
            assert received == sent_buckets[v], (v, received, sent_buckets[v])  # bucket by bucket
        if mode == "one_step_off":  # async_training.prefetch_weights: received on its own thread while generating
            gen = {e["args"]["step"]: e for e in work if e["name"] == "generate + score"}
            staged = {v: e for v, e in got.items() if e["args"].get("staged")}
            # versions pushed after the first trained step's (the run's start pushes its own version before any
            # generation) by a step that pushes (weights_due: v + 2 <= the last step)
            want = {v for v in got if v >= steps[0] and v + 2 <= steps[-1]} if prefetch else set()
            assert set(staged) == want, (sorted(staged), want, gen)
            for v, e in staged.items():
                g = gen[v + 1]  # the step generating while version v arrives
                assert track_of[id(e)][1] != 0 and e["ts"] < g["ts"] + g["dur"], (v, e, g)  # begun before it ends
                loads = [x for x in work if x["name"] == "load staged weights" and x["args"]["version"] == v]
                assert len(loads) == 1 and loads[0]["ts"] >= g["ts"] + g["dur"], (v, loads, g)  # after generating
        assert sum(e["args"]["items"] for e in work if e["name"] == "score") >= len(steps) * 16  # every sample
        if reward_workers:
            check_reward_workers(path, r, reward_workers)
        if mode == "one_step_off":
            gens = [e["args"]["step"] for e in work if e["name"] == "generate + score"]
            assert gens == steps, gens
        else:
            assert sum(e["args"]["finished"] for e in work if e["name"] == "engine step") >= len(steps) * 16
            assert sum(e["args"]["groups"] for e in work if e["name"] == "publish") >= len(steps) * 4


def _rm_rows(path: Path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(x) for f in sorted(path.parent.glob(path.name + ".rank*")) for x in f.read_text().splitlines()]
    return [x for x in lines if "ids" in x], [x for x in lines if "metrics" in x]


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_reward_model_scores_every_trained_row(tmp_path, tiny_model_dir, mode):
    """A reward model on the training pool (1 rollout + 2 training processes: each DP rank scores the rows it
    pulled; its weights offloaded between scorings): every trained row's reward equals reward_weight x the
    transformers sequence classifier's score of that row + rule_weight x the rule score + the overlong penalty,
    each computed offline from the row's tokens; the step's `reward_model/*` metrics describe all ranks' rows;
    the weights are off the device after each step. tests/scripts/async_reward_rows.py records the rows.

    fully_async (staleness_threshold=1, partial_rollout=false, 4 steps) also checks the stale-sample drop, with the
    rollout side of the data bus observed (tests/scripts/async_observers.py): the first granted group (uid 0,
    sampled by version 0) is held back by its rollout worker until it has the weights of version 2, so when the
    coordinator reads it (at step 3 or 4: it must read past it by step 4, the groups published before it being at
    most the 15 others the grant limit allowed) it is 2 or more versions stale and must be dropped. Asserted: the
    drop is counted, the producer was told (its drop events, rollout side, are what the trainer counts), no dropped
    group is ever trained, every trained row is within the threshold by its own versions and the trainer's
    version, and the trained / dropped counts equal the groups the rollout worker sent / dropped (not the ledger's
    own sum, which `Ledger.check` already enforces). Mutations: the coordinator's stale drop a no-op
    (`stale = []` in `FullyAsync.next_batch`'s `ready`) -> fails; the drop not told to the producer
    (`self.command(("drop", ...))` removed: the rows kept forever) -> fails."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_mcore.rewards.overlong import overlong_penalty

    policy = tiny_model_dir("qwen2")
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1, dtype=torch.float32)
    rm.save_pretrained(tmp_path / "rm")
    tok = AutoTokenizer.from_pretrained(policy)
    tok.save_pretrained(tmp_path / "rm")
    bus = tmp_path / "bus"
    bus.mkdir()
    steps = 2 if mode == "one_step_off" else 4
    mode_args = (["async_training.mode=one_step_off"] if mode == "one_step_off" else
                 ["async_training.mode=fully_async", "async_training.staleness_threshold=1",
                  "async_training.partial_rollout=false", "actor_rollout_ref.rollout.max_num_seqs=8",
                  "--bus", str(bus), "--hold", "0:2"])
    args = _setup(tmp_path, tiny_model_dir) + mode_args + [
        "rollout.n_gpus_per_node=1", "trainer.n_gpus_per_node=2", f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "reward_model.enable=true", f"reward_model.model.path={tmp_path / 'rm'}", "reward_model.reward_weight=2.0",
        "reward_model.rule_weight=0.5", "reward_model.micro_batch_size_per_gpu=4",
        "reward_model.megatron.param_offload=true", "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=6", "reward_model.overlong_buffer.penalty_factor=1.0",
        f"trainer.trace={tmp_path / 'timeline.json'}", "reward.num_workers=1"]
    run_script("tests/scripts/async_reward_rows.py", *args, "--rows", str(tmp_path / "rows.jsonl"), nproc=3)
    _check_async_trace(tmp_path / "timeline.json", mode, list(range(1, steps + 1)),  # the run's timeline
                       reward_workers=1, run_dir=tmp_path / "run")
    if mode == "fully_async":
        _check_stale_drop(tmp_path / "run", bus, steps)
    rows, step_lines = _rm_rows(tmp_path / "rows.jsonl")
    assert [s["step"] for s in step_lines] == list(range(1, steps + 1)) and len(rows) == steps * 4 * 4
    assert {(r["step"], r["rank"]) for r in rows} == {(s, k) for s in range(1, steps + 1) for k in (0, 1)}  # both DP
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
    for s in step_lines:
        mine = [x for x, r in zip(rm_scores, rows) if r["step"] == s["step"]]
        m = s["metrics"]
        assert m["reward_model/num_scored"] == m["reward_model/num_scored_after"] == 16
        assert m["reward_model/score_mean"] == pytest.approx(sum(mine) / len(mine), abs=1e-4)
        rule_mine = [x for x, r in zip(rules, rows) if r["step"] == s["step"]]  # the rule score logged beside it
        assert m["reward_model/rule_score_mean"] == pytest.approx(sum(rule_mine) / len(rule_mine), abs=1e-6)
        assert m["timing_s/reward_model"] > 0


def _check_stale_drop(out: Path, bus: Path, steps: int) -> None:
    """The fully asynchronous reward-model run's drop (test_reward_model_scores_every_trained_row's docstring)."""
    events, trained = _jsonl(bus, "bus"), _jsonl(bus, "trained")
    assert [e["uid"] for e in events if e["event"] == "held"] == [0]
    late = [e for e in events if e["event"] == "published" and e["uid"] == 0]
    assert len(late) == 1 and late[0]["rollout_version"] >= 2 and {v for vs in late[0]["versions"] for v in vs} == {0}
    by_step = _check_trained_rows(trained, events, threshold=1)
    assert sorted(by_step) == list(range(1, steps + 1)) and all(len(u) == 4 for u in by_step.values())
    sent = [e["uid"] for e in events if e["event"] == "sent"]
    dropped = [e["uid"] for e in events if e["event"] == "dropped"]
    assert 0 in dropped and len(set(dropped)) == len(dropped)  # the held group dropped, each drop told once
    assert sorted(sent) == sorted(u for uids in by_step.values() for u in uids)  # what was sent is what trained
    logged = records(out)
    last = logged[-1]
    assert last["fully_async/count/dropped_samples_total"] == 4 * len(dropped)
    assert last["fully_async/count/trained_samples"] == 4 * len(sent) == steps * 16
    assert sum(r["fully_async/count/dropped_stale_samples"] for r in logged) == 4 * len(dropped)
    published = {e["uid"] for e in events if e["event"] == "published"}
    assert 4 * (len(sent) + len(dropped)) <= last["fully_async/count/produced_samples"] <= 4 * len(published)
    for r in logged:  # the coordinator's histogram agrees with the rows' own versions
        assert all(int(k.rsplit("/", 1)[1]) <= 1 for k in r if k.startswith("fully_async/staleness/")), r
