"""Token-exact multi-turn trajectories through the fixture tokenizers (qwen2, llama, qwen3) with their families'
tool-aware chat templates: the ids are exactly what was generated and what was appended, masked spans decode to
the tool / environment messages, a conversation re-rendered by the template gives the same ids (or, where the
template rewrites history, Qwen3's <think> stripping, the drift is counted and the model's tokens are kept)."""
import random

import pytest
from agent_helpers import ScriptedEngine, fixture_tokenizer

from rlhf_mcore.agents import AgentRunner, Environment, MultiTurnSettings, get_tool, register_environment
from rlhf_mcore.agents.runner import TURN_KEY
from rlhf_mcore.agents.trajectory import TrajectoryBuilder, message_tokens
from rlhf_mcore.rollout.base import SamplingParams

WORDS = ["the", "answer", "is", "12", "apples", "Let", "me", "compute", "345", "+", "7", "then", "#### 9", "\n",
         "ok", "so", "we", "have", "  spaces", "é", "x=3"]


def _text(rng: random.Random, k: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(k))


def _calc_policy(seed: int):
    """Random text; on most turns 1-2 calculator calls (sometimes a malformed one); a final answer at the end."""
    def policy(request_id: int, prompt) -> str:
        rng = random.Random(seed * 1_000_003 + request_id)
        turn = request_id % TURN_KEY
        if turn >= 3 or rng.random() < 0.15:
            return _text(rng, rng.randint(1, 8)) + "\n#### 42"
        calls = []
        for _ in range(rng.randint(1, 2)):
            if rng.random() < 0.15:
                calls.append('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+"\n</tool_call>')
            else:
                a, b = rng.randint(1, 999999), rng.randint(1, 999999)
                calls.append(f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}\n'
                             f'</tool_call>')
        return _text(rng, rng.randint(0, 6)) + "\n" + "\n".join(calls)
    return policy


def _rows(tok, n: int, tools):
    rows, prompts = [], []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Question {i}: what is {i} * 3?"}]
        text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
        rows.append({"raw_prompt": msgs, "agent_name": "tool_agent", "index": i, "data_source": "t"})
    return prompts, rows


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_tool_trajectories_are_token_exact(tiny_model_dir, arch):
    tok, end = fixture_tokenizer(tiny_model_dir(arch), arch)
    engine = ScriptedEngine(tok, end, _calc_policy(seed=hash(arch) % 1000), streaming=False)
    runner = AgentRunner(engine, tok, MultiTurnSettings(max_assistant_turns=4), {"calculator": get_tool("calculator")})
    prompts, rows = _rows(tok, 6, runner.tool_schemas)
    trajs = runner.run(prompts, rows, SamplingParams(n=2, max_new_tokens=400, seed=3))
    n_tool_spans = drifted = 0
    for i, per in enumerate(trajs):
        for j, t in enumerate(per):
            assert t.prompt_ids == prompts[i]
            assert len(t.response_ids) == len(t.response_mask) == len(t.logprobs) <= 400
            # model spans are exactly the engine's samples, in order; the rest is the messages appended
            rebuilt, model_turns = [], [x for x in t.turns if x["role"] == "assistant"]
            for turn in t.turns:
                span = t.response_ids[turn["start"]:turn["end"]]
                mask = t.response_mask[turn["start"]:turn["end"]]
                if turn["role"] == "assistant":
                    s = engine.generated[(i * 2 + j) * TURN_KEY + model_turns.index(turn)]
                    assert span == s.token_ids and mask == [1] * len(span)
                    assert t.logprobs[turn["start"]:turn["end"]] == pytest.approx(s.logprobs)
                else:
                    n_tool_spans += 1
                    assert mask == [0] * len(span) and set(t.logprobs[turn["start"]:turn["end"]]) == {0.0}
                    text = tok.decode(span)
                    tool_msgs = t.messages[turn["messages"][0]:turn["messages"][1]]
                    assert tool_msgs
                    for m in tool_msgs:  # every tool message, verbatim, in the masked span
                        assert m["role"] == "tool" and m["content"] in text
                    assert text.endswith(("<|im_start|>assistant\n",
                                          "<|start_header_id|>assistant<|end_header_id|>\n\n"))
                rebuilt += span
            assert rebuilt == t.response_ids
            assert t.model_logprobs == [lp for lp, m in zip(t.logprobs, t.response_mask) if m]
            # re-rendering the conversation gives the trajectory's ids, except where the template rewrites what
            # the model wrote (Llama-3's template trims each message): then the drift is counted
            said = [m["content"] for m in t.messages if m["role"] == "assistant"]
            rewritten = arch == "llama" and any(c != c.strip() for c in said)
            closed = t.turns[-1]["role"] == "assistant" and t.turns[-1]["finish_reason"] == "stop"
            assert t.stats["template_drift"] == float(rewritten and closed)
            assert t.stats["template_fallbacks"] == 0.0
            drifted += rewritten
            if not rewritten and closed:
                full = tok.apply_chat_template(t.messages, tools=runner.tool_schemas, tokenize=False)
                ids = tok(full, add_special_tokens=False)["input_ids"]
                assert ids[:len(t.prompt_ids) + len(t.response_ids)] == t.prompt_ids + t.response_ids
    assert n_tool_spans >= 5
    assert (drifted > 0) == (arch == "llama")


def test_tool_message_span_is_the_templates_tool_turn(tiny_model_dir):
    """Qwen2.5's rendering of two tool results after an assistant turn ended by <|im_end|>: the newline the
    template writes after <|im_end|>, one user turn of <tool_response>s, and the next assistant header."""
    tok, _ = fixture_tokenizer(tiny_model_dir("qwen2"), "qwen2")
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<tool_call>x</tool_call>"}]
    new = [{"role": "tool", "content": "4"}, {"role": "tool", "content": "5"}]
    ids, fallback = message_tokens(tok, history, new, None, "<|im_end|>")
    assert not fallback
    assert tok.decode(ids) == ("\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n5\n"
                               "</tool_response><|im_end|>\n<|im_start|>assistant\n")


@register_environment("test_think_echo")
class ThinkEcho(Environment):
    def reset(self, row):
        self.turns = 0
        return None

    def step(self, text):
        self.turns += 1
        return f"Turn {self.turns} done. Again?", 0.5, self.turns >= 3


def _think_policy(request_id, prompt):
    return f"<think>\nstep {request_id % TURN_KEY}\n</think>\n\nanswer {request_id // TURN_KEY}"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_history_rewriting_template_keeps_model_tokens_and_counts_drift(tiny_model_dir, arch):
    tok, end = fixture_tokenizer(tiny_model_dir(arch), arch)
    engine = ScriptedEngine(tok, end, _think_policy, streaming=False)
    runner = AgentRunner(engine, tok, MultiTurnSettings(max_user_turns=5, max_assistant_turns=5))
    msgs = [{"role": "user", "content": "Play."}]
    prompt = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    row = {"raw_prompt": msgs, "agent_name": "env_agent", "extra_info": {"env_name": "test_think_echo"}}
    (t,), = runner.run([prompt], [row], SamplingParams(n=1, max_new_tokens=300, seed=0))
    assert [x["role"] for x in t.turns] == ["assistant", "user", "assistant", "user", "assistant"]
    assert t.turn_rewards == [0.5, 0.5, 0.5] and t.reward == pytest.approx(1.5)
    for turn in t.turns:  # the model's <think> blocks stay in the trajectory whatever the template does
        if turn["role"] == "assistant":
            assert "<think>" in tok.decode(t.response_ids[turn["start"]:turn["end"]])
        else:
            assert "Again?" in tok.decode(t.response_ids[turn["start"]:turn["end"]])
    drift = 1.0 if arch == "qwen3" else 0.0  # Qwen3 drops earlier think blocks once a new user turn follows
    assert t.stats["template_drift"] == drift and t.stats["template_fallbacks"] == 2 * drift


def test_response_budget_counts_message_tokens_and_ends_with_length(tiny_model_dir):
    tok, end = fixture_tokenizer(tiny_model_dir("qwen2"), "qwen2")
    prompt = tok("<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    b = TrajectoryBuilder(tok, [{"role": "user", "content": "x"}], prompt, max_response_tokens=30,
                          stop_token_ids=(end,))
    b.add_model_turn([5, 6, end], [-0.1, -0.2, -0.3], "stop")
    assert not b.done
    assert not b.add_messages([{"role": "tool", "content": "word " * 40}])  # does not fit: nothing appended
    t = b.finish()
    assert t.finish_reason == "length" and t.response_ids == [5, 6, end] and t.response_mask == [1, 1, 1]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_multiply_sft_target_is_the_rollout_of_the_same_moves(tiny_model_dir, tmp_path, arch):
    """The multiply task's multi-turn SFT target (call, calculator answer, "#### N"), as launch/sft.py tokenizes it,
    is token for token the trajectory tool_agent produces when the model makes those moves with the real
    calculator, and its loss mask is that trajectory's response mask (the model's turns only)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_mcore.agents import load_tool_config
    from rlhf_mcore.agents.tasks import multiply_rows
    from rlhf_mcore.trainer.sft import load_sft_rows

    tok, end = fixture_tokenizer(tiny_model_dir(arch), arch)
    tools = load_tool_config("configs/tools/calculator.yaml")
    schemas = [t.schema() for t in tools.values()]
    rows = multiply_rows(4, seed=2)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    sft = load_sft_rows(str(tmp_path / "train.parquet"), tok, 2048, schemas)
    assert len(sft) == 4

    def policy(request_id, prompt):  # the target's assistant turns
        return rows[request_id // TURN_KEY]["extra_info"]["messages"][2 * (request_id % TURN_KEY)]["content"]

    runner = AgentRunner(ScriptedEngine(tok, end, policy, streaming=False), tok, MultiTurnSettings(), tools)
    items = [{"raw_prompt": r["prompt"], "agent_name": r["agent_name"], "index": i} for i, r in enumerate(rows)]
    params = SamplingParams(n=1, max_new_tokens=2048 - max(len(p) for p, _, _ in sft), seed=0)
    trajs = runner.run([p for p, _, _ in sft], items, params)
    for (prompt_ids, response, mask), [t], row in zip(sft, trajs, rows):
        text = tok.apply_chat_template(row["prompt"], tools=schemas, add_generation_prompt=True, tokenize=False)
        assert "calculator" in text and prompt_ids == tok(text, add_special_tokens=False)["input_ids"]
        assert t.stats["tool_calls"] == 1 and t.stats["tool_errors"] == 0 and t.finish_reason == "stop"
        assert response == t.response_ids and mask == t.response_mask
        tool_span = [x for x, m in zip(response, mask) if not m]
        truth = row["reward_model"]["ground_truth"]
        assert truth in tok.decode(tool_span)  # the calculator's answer, not in the loss
        assert tok.decode([x for x, m in zip(response, mask) if m]).endswith(f"#### {truth}{tok.decode([end])}")
