"""The scheduler and the trainer's side of multi-turn rollouts.

- 64 trajectories with tools of random latency (0-200 ms) all finish, with the engine kept busy meanwhile (the
  busy fraction is reported), on a scripted engine and on the native engine's stream (which keeps decoding other
  trajectories while tools run); a tool that never returns times out; malformed JSON, an unknown tool, a raising
  tool and too many calls each produce their error message and metric.
- On the native engine (CPU), the log-probs of the model's tokens equal a teacher-forced forward pass of the whole
  multi-turn trajectory (1e-4), and rows carry the trajectory's response mask into the batch.
- The policy loss, entropy and KL give a masked (tool) token's position zero gradient.
"""
import random
import threading
import time

import pytest
import torch
from agent_helpers import ScriptedEngine, fixture_tokenizer

from rlhf_mcore.agents import (
    AgentLoop,
    AgentRunner,
    Environment,
    MultiTurnSettings,
    Tool,
    ToolCall,
    get_tool,
    register_agent,
    register_environment,
    register_tool,
)
from rlhf_mcore.agents.rollout import agent_metrics, trajectory_info
from rlhf_mcore.agents.runner import TURN_KEY
from rlhf_mcore.rollout.base import SamplingParams


@register_tool()
class Sleepy(Tool):
    name = "test_sleepy"
    description = "sleeps `ms` milliseconds, returns `ms`"
    parameters = {"type": "object", "properties": {"ms": {"type": "integer"}}}
    active = 0
    peak = 0
    calls = 0
    lock = threading.Lock()
    barrier = None  # a threading.Barrier the first calls wait at (test_64_trajectories_with_slow_tools), or None
    broken = False  # ... it timed out: fewer calls than its parties ever ran at once

    def __call__(self, ms: int) -> str:
        with Sleepy.lock:
            Sleepy.active += 1
            Sleepy.peak = max(Sleepy.peak, Sleepy.active)
            first = Sleepy.barrier is not None and Sleepy.calls < Sleepy.barrier.parties
            Sleepy.calls += 1
        if first:
            try:
                Sleepy.barrier.wait()
            except threading.BrokenBarrierError:
                Sleepy.broken = True
        if ms < 0:
            threading.Event().wait()  # never returns
        time.sleep(ms / 1000)
        with Sleepy.lock:
            Sleepy.active -= 1
        return f"slept {ms}"


@register_tool(name="test_raises", description="always fails", parameters={"type": "object", "properties": {}})
def _raises():
    raise RuntimeError("disk on fire")


def _latency_policy(request_id, prompt):
    turn, traj = request_id % TURN_KEY, request_id // TURN_KEY
    if turn < 2:
        ms = random.Random(request_id).randint(0, 200)
        return f'calling <tool_call>{{"name": "test_sleepy", "arguments": {{"ms": {ms}}}}}</tool_call>'
    return f"#### {traj}"


def _rows(tok, n):
    msgs = [{"role": "user", "content": "go"}]
    ids = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    return [ids] * n, [{"raw_prompt": msgs, "agent_name": "tool_agent", "index": i} for i in range(n)]


@pytest.mark.parametrize("streaming", [True, False])
def test_64_trajectories_with_slow_tools(tiny_model_dir, streaming):
    """Tool calls overlap, shown without a clock: the first 9 calls wait at a barrier of 9 parties, which opens only
    once 9 calls run at the same time (the other trajectories' first turns end meanwhile and make theirs); with calls
    run one after the other the barrier's 20 s timeout breaks it, a wait no machine's slowness needs. Mutation: the
    runner's tool pool of `tool_workers` threads -> 1 thread -> fails."""
    tok, end = fixture_tokenizer(tiny_model_dir("qwen2"), "qwen2")
    engine = ScriptedEngine(tok, end, _latency_policy, step_s=0.002, streaming=streaming)
    runner = AgentRunner(engine, tok, MultiTurnSettings(max_assistant_turns=4, tool_workers=64),
                         {"test_sleepy": Sleepy()})
    prompts, rows = _rows(tok, 32)
    Sleepy.peak, Sleepy.calls, Sleepy.broken = 0, 0, False
    Sleepy.barrier = threading.Barrier(9, timeout=20)
    try:
        trajs = runner.run(prompts, rows, SamplingParams(n=2, max_new_tokens=600, seed=1))
    finally:
        Sleepy.barrier = None
    flat = [t for per in trajs for t in per]
    assert len(flat) == 64
    for k, t in enumerate(flat):
        assert t.finish_reason == "stop" and t.stats["tool_calls"] == 2 and t.stats["tool_errors"] == 0
        assert tok.decode(t.response_ids).endswith(f"#### {k}<|im_end|>")
    assert not Sleepy.broken and Sleepy.peak > 8  # 9 calls ran at once: the barrier opened
    m = agent_metrics([trajectory_info(t) for t in flat], runner.last_stats)
    assert m["agent/turns/mean"] == 3 and m["agent/tool_calls/max"] == 2
    assert 0 < m["agent/engine_busy_fraction"] <= 1
    if streaming:  # trajectories join the running batch while others wait for tools
        assert engine.max_concurrent > 1


class Gate(Tool):
    """Blocks until `opened` is set (by the engine, after it has decoded with a gate call pending)."""

    name = "test_gate"
    description = "waits for the gate"
    parameters = {"type": "object", "properties": {}}
    opened = threading.Event()
    waiting = 0
    lock = threading.Lock()

    def __call__(self) -> str:
        with Gate.lock:
            Gate.waiting += 1
        Gate.opened.wait()
        with Gate.lock:
            Gate.waiting -= 1
        return "open"


@register_agent("test_gate_agent")
class GateAgent(AgentLoop):
    """Whatever the (random) model says, its first two turns are followed by a tool call: even trajectories call
    test_gate, odd ones test_sleepy with a latency drawn from the key and the turn; the third turn ends it."""

    async def run(self, row, traj):
        for turn in range(3):
            if await self.generate(traj) is None or traj.done or turn == 2:
                return
            ms = random.Random(traj.key * 10 + turn).randint(0, 200)
            call = ToolCall("test_gate", {}) if traj.key % 2 == 0 else ToolCall("test_sleepy", {"ms": ms})
            if not traj.add_messages(await self.call_tools(traj, [call]), role="tool"):
                return


def test_native_stream_keeps_decoding_while_tools_run(tiny_model_dir, capsys):
    """Half the trajectories call a tool that only returns once the engine has run 4 decode steps while it was
    blocked: the rollout ends (and without a timeout) only if the others kept decoding meanwhile."""
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    model_dir = tiny_model_dir("qwen2")
    tok, end = fixture_tokenizer(model_dir, "qwen2")
    engine = NativeRolloutEngine(model_dir, max_num_seqs=64, max_model_len=512, device="cpu", dtype="float32")
    steps = {"all": 0, "while_gated": 0}
    step = engine.step

    def counting_step():
        steps["all"] += 1
        if Gate.waiting:
            steps["while_gated"] += 1
            if steps["while_gated"] >= 4:
                Gate.opened.set()
        return step()

    engine.step = counting_step
    Gate.opened.clear()
    runner = AgentRunner(engine, tok, MultiTurnSettings(max_tokens_per_turn=6, tool_workers=64, tool_timeout_s=30),
                         {"test_sleepy": Sleepy(), "test_gate": Gate()})
    prompts, rows = _rows(tok, 32)
    for r in rows:
        r["agent_name"] = "test_gate_agent"
    Sleepy.peak = 0
    trajs = [t for per in runner.run(prompts, rows, SamplingParams(n=2, max_new_tokens=100, seed=3)) for t in per]
    assert len(trajs) == 64 and engine.num_pending == 0 and Gate.opened.is_set()
    for t in trajs:
        assert t.stats["tool_calls"] == 2 and t.stats["tool_errors"] == 0 and t.stats["turns"] == 3
        assert len(t.logprobs) == len(t.response_ids) == len(t.response_mask)
        assert sum(t.response_mask) == sum(turn["end"] - turn["start"] for turn in t.turns if turn["role"] ==
                                           "assistant")
    assert Sleepy.peak > 8  # tool calls overlap
    m = agent_metrics([trajectory_info(t) for t in trajs], runner.last_stats)
    assert 0 < m["agent/engine_busy_fraction"] <= 1
    with capsys.disabled():
        print(f"\nnative stream, 64 trajectories: engine busy {m['agent/engine_busy_fraction']:.2f} of "
              f"{runner.last_stats['wall_s']:.2f} s; {steps['while_gated']} of {steps['all']} steps with a gate "
              f"call blocked")


def test_tool_errors_become_messages_and_metrics(tiny_model_dir):
    tok, end = fixture_tokenizer(tiny_model_dir("qwen2"), "qwen2")
    bad_turns = {
        0: '<tool_call>{"name": "test_sleepy", "arguments": {"ms": </tool_call>',     # malformed JSON
        1: '<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>',        # unknown tool
        2: '<tool_call>{"name": "test_raises", "arguments": {}}</tool_call>',         # raises
        3: '<tool_call>{"name": "test_sleepy", "arguments": {"ms": -1}}</tool_call>',  # never returns
        4: "".join('<tool_call>{"name": "test_sleepy", "arguments": {"ms": 1}}</tool_call>' for _ in range(3)),
    }

    def policy(request_id, prompt):
        traj, turn = request_id // TURN_KEY, request_id % TURN_KEY
        return bad_turns[traj] if turn == 0 else "#### 1"

    engine = ScriptedEngine(tok, end, policy, streaming=False)
    tools = {"test_sleepy": Sleepy(), "test_raises": get_tool("test_raises")}
    runner = AgentRunner(engine, tok, MultiTurnSettings(tool_timeout_s=0.5, max_parallel_calls=2), tools)
    prompts, rows = _rows(tok, 5)
    # The hung call never returns, so a rollout that waited for it would never end (no wall-clock bound to pass or
    # miss): the run is in a thread whose 120 s join only turns such a hang into a failure.
    out = []
    th = threading.Thread(target=lambda: out.append(runner.run(prompts, rows, SamplingParams(n=1, max_new_tokens=300,
                                                                                            seed=0))), daemon=True)
    th.start()
    th.join(timeout=120)
    assert out, "the rollout did not end: it waited for the hung tool call"
    trajs = [per[0] for per in out[0]]
    tool_text = [tok.decode(t.response_ids[t.turns[1]["start"]:t.turns[1]["end"]]) for t in trajs]
    assert "not valid JSON" in tool_text[0] and trajs[0].stats["tool_malformed"] == 1
    assert "unknown tool 'no_such_tool'" in tool_text[1] and trajs[1].stats["tool_unknown"] == 1
    assert "RuntimeError: disk on fire" in tool_text[2] and trajs[2].stats["tool_exceptions"] == 1
    assert "timed out after 0.5 s" in tool_text[3] and trajs[3].stats["tool_timeouts"] == 1
    assert tool_text[4].count("slept 1") == 2 and "at most 2 tool calls" in tool_text[4]
    for t in trajs:  # each trajectory went on after its error and answered
        assert t.finish_reason == "stop" and tok.decode(t.response_ids).endswith("#### 1<|im_end|>")
        assert t.stats["tool_errors"] == 1
    m = agent_metrics([trajectory_info(t) for t in trajs])
    assert m["agent/tool_errors"] == 5 and m["agent/tool_timeouts"] == 1 and m["agent/tool_malformed"] == 1


@register_environment("test_retry")
class Retry(Environment):
    def reset(self, row):
        self.n = 0
        return "Say something."

    def step(self, text):
        self.n += 1
        return f"Attempt {self.n} noted. Once more.", float(self.n), self.n >= 3


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_native_engine_logprobs_match_teacher_forcing(tiny_model_dir, arch):
    from transformers import AutoModelForCausalLM

    from rlhf_mcore.data.batch import build_batch, last_response_token
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    model_dir = tiny_model_dir(arch)
    tok, end = fixture_tokenizer(model_dir, "qwen2")  # the fixture's ChatML tokens
    engine = NativeRolloutEngine(model_dir, max_num_seqs=8, max_model_len=256, device="cpu", dtype="float32")
    runner = AgentRunner(engine, tok, MultiTurnSettings(max_tokens_per_turn=12, max_user_turns=5))
    msgs = [{"role": "user", "content": "Tell me a number."}]
    ids = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    rows = [{"raw_prompt": msgs, "agent_name": "env_agent", "extra_info": {"env_name": "test_retry"}, "index": 0}]
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=120, seed=5, stop_token_ids=(end,))
    trajs = runner.run([ids], rows, params)[0]
    assert runner.last_stats["kv_reused_tokens"] > 0  # later turns attended to the kept KV cache
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    checked = 0
    for t in trajs:
        assert 0 in t.response_mask and 1 in t.response_mask  # environment turns between model turns
        seq = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = model(seq).logits[0].float() / 0.8  # (L, V)
        lp = torch.log_softmax(logits, -1)[len(t.prompt_ids) - 1:-1].gather(
            1, torch.tensor(t.response_ids)[:, None])[:, 0]  # (R,)
        mask = torch.tensor(t.response_mask, dtype=torch.bool)
        torch.testing.assert_close(lp[mask], torch.tensor(t.logprobs)[mask], atol=1e-4, rtol=0)
        checked += int(mask.sum())
    assert checked > 20
    # the trainer's batch: masks carried, tool tokens attended, the reward on the last model token
    batch = build_batch([t.prompt_ids for t in trajs], [t.response_ids for t in trajs], [t.logprobs for t in trajs],
                        [t.finish_reason for t in trajs], [0] * 3, {}, pad_token_id=0,
                        response_masks=[t.response_mask for t in trajs])
    P = batch["prompts"].shape[1]
    for i, t in enumerate(trajs):
        R = len(t.response_ids)
        assert batch["response_mask"][i, :R].tolist() == t.response_mask
        assert batch["attention_mask"][i, P:P + R].tolist() == [1] * R
        last = max(k for k, m in enumerate(t.response_mask) if m)
        assert int(last_response_token(batch["response_mask"])[i]) == last


def test_losses_ignore_masked_tokens():
    """Policy loss, entropy and KL (every aggregation mode): the gradient at a masked position is exactly zero."""
    from rlhf_mcore.algos import agg_loss, compute_kl_loss, get_policy_loss

    torch.manual_seed(0)
    B, R = 3, 10
    mask = torch.ones(B, R)
    mask[:, 3:6] = 0  # a tool message in the middle
    mask[1, 8:] = 0  # and at the end of a row
    old = torch.randn(B, R) - 1
    ref = torch.randn(B, R) - 1
    adv = torch.randn(B, R)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        logp = (torch.randn(B, R) - 1).requires_grad_()
        ent = torch.rand(B, R).requires_grad_()
        pg, _ = get_policy_loss("vanilla")(old, logp, adv, mask, loss_agg_mode=mode)
        kl, _ = compute_kl_loss(logp, ref, mask, kl_loss_coef=0.1, kl_loss_type="low_var_kl", loss_agg_mode=mode)
        (pg + kl + agg_loss(ent, mask, mode)).backward()
        assert torch.all(logp.grad[mask == 0] == 0) and torch.all(ent.grad[mask == 0] == 0)
        assert logp.grad[mask == 1].abs().sum() > 0 and ent.grad[mask == 1].abs().sum() > 0
