"""launch/generate.py: chat-templated offline generation from parquet / jsonl, one output line per input row."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from launch.generate import main
from rlhf_mcore.rollout import SamplingParams, build_rollout_engine

QUESTIONS = ["Natalia sold 48 clips in April and half as many in May. How many clips altogether?",
             "Weng earns $12 an hour. She did 50 minutes of babysitting. How much did she earn?",
             "What is 7 times 8?"]


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny shapes run as fast on one thread, and stay fast when other jobs load the shared CPUs."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def write_parquet(path):
    """veRL's schema: chat-message prompts plus metadata columns that must pass through."""
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}}
            for i, q in enumerate(QUESTIONS)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return rows


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_greedy_from_parquet_matches_engine(tiny_model_dir, tmp_path, engine):
    model = tiny_model_dir("qwen2")
    rows = write_parquet(tmp_path / "in.parquet")
    main(["--model", str(model), "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out.jsonl"),
          "--engine", engine, "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"])
    out = read_jsonl(tmp_path / "out.jsonl")
    assert len(out) == len(rows)
    tok = AutoTokenizer.from_pretrained(model)
    ids = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in ids]
    assert all(i[-3:] == tok("<|im_start|>assistant\n")["input_ids"][-3:] for i in ids)
    ref = build_rollout_engine("native", model, max_num_seqs=4, max_model_len=128, device="cpu").generate(
        ids, SamplingParams(temperature=0, max_new_tokens=12))
    for row, rec, r in zip(rows, out, ref):
        assert rec["reward_model"] == row["reward_model"] and rec["extra_info"] == row["extra_info"]  # in order
        assert rec["response_ids"] == [r.samples[0].token_ids]
        assert rec["responses"] == [tok.decode(r.samples[0].token_ids, skip_special_tokens=True)]
        assert len(rec["logprobs"][0]) == len(rec["response_ids"][0])
        assert rec["finish_reasons"] == [r.samples[0].finish_reason]


def test_jsonl_string_prompts_with_samples(tiny_model_dir, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": q, "id": i}) + "\n" for i, q in enumerate(QUESTIONS)))
    args = ["--model", str(tiny_model_dir("llama")), "--input", str(inp), "--n", "3", "--temperature", "1.0",
            "--max-new-tokens", "6", "--seed", "0"]
    main(args + ["--output", str(tmp_path / "a.jsonl")])
    main(args + ["--output", str(tmp_path / "b.jsonl")])
    a, b = read_jsonl(tmp_path / "a.jsonl"), read_jsonl(tmp_path / "b.jsonl")
    assert [r["id"] for r in a] == [0, 1, 2]
    assert all(len(r["responses"]) == len(r["response_ids"]) == len(r["logprobs"]) == 3 for r in a)
    assert a == b  # seeded


def test_clear_errors(tiny_model_dir, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"question": "no prompt column"}) + "\n")
    cases = [(["--model", str(tmp_path / "nope"), "--input", str(inp)], "no config.json"),
             (["--model", str(tiny_model_dir("qwen2")), "--input", str(tmp_path / "missing.parquet")],
              "file not found"),
             (["--model", str(tiny_model_dir("qwen2")), "--input", str(inp)], "no `prompt` field"),
             (["--model", str(tiny_model_dir("qwen2")), "--input", str(inp), "--temperature", "0", "--n", "2"],
              "greedy")]
    for args, message in cases:
        with pytest.raises(SystemExit):
            main(args + ["--output", str(tmp_path / "o.jsonl")])
        assert message in capsys.readouterr().err


def test_model_without_tokenizer_files(tiny_model_dir, tmp_path, capsys):
    """A model directory with weights but no tokenizer files: one line naming it and the missing files (it used to
    end in "prompt 0 is empty" from the engine). Mutation: return the tokenizer unchecked in
    `models.tokenizer.load_tokenizer` -> fails."""
    import shutil

    model = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_model_dir("qwen2"), model,
                    ignore=shutil.ignore_patterns("tokenizer.json", "tokenizer_config.json"))
    write_parquet(tmp_path / "in.parquet")
    with pytest.raises(SystemExit) as e:
        main(["--model", str(model), "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "o.jsonl"),
              "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert f"--model='{model}' has no usable tokenizer (missing tokenizer.json, tokenizer_config.json" in line, err
    assert not (tmp_path / "o.jsonl").exists()


def _edited_model(src, dst, *, drop=(), add=None, config=None):
    """A copy of the tiny model directory `src` with tensors dropped / added and config.json keys set."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in drop:
        del tensors[name]
    save_file({**tensors, **(add or {})}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_model_directories_that_do_not_match_their_config(tiny_model_dir, tmp_path, capsys, engine):
    """The native engine loading a user's directory: a tensor config.json does not describe, one it needs but the
    checkpoint lacks, a quantized checkpoint -- each one line naming the tensor or key, exit code 2, no traceback
    (native: a KeyError, a RuntimeError at the first generate, an UnsupportedModelError traceback; hf: transformers
    dropped the tensor, or initialised the head at random, and generated). Mutations, each run once:
    `_load_checkpoint` back to a bare `update_weights` -> fails at the first case (the KeyError); the `except
    UserError` around the engine's build dropped -> fails (the ModelFileError's traceback); `check_loading_info` not
    called -> the hf case fails (it generates)."""
    write_parquet(tmp_path / "in.parquet")
    qwen2, untied = tiny_model_dir("qwen2"), tiny_model_dir("qwen2", tie_word_embeddings=False)
    extra = {"native": ["unexpected weight 'model.layers.0.self_attn.q_norm.weight'", "config.json describes"],
             "hf": ["belong to no parameter", "['model.layers.0.self_attn.q_norm.weight']"]}
    missing = {"native": ["lack 1 tensors", "'lm_head.weight'", "right model directory"],
               "hf": ["lacks tensors", "['lm_head.weight']", "right model directory"]}
    cases = [
        (_edited_model(qwen2, tmp_path / "extra", add={"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
         extra[engine]),
        (_edited_model(untied, tmp_path / "no_head", drop=["lm_head.weight"]), missing[engine]),
    ]
    if engine == "native":  # transformers has its own word on quantized checkpoints
        cases.append((_edited_model(qwen2, tmp_path / "fp8", config={"quantization_config": {"quant_method": "fp8"}}),
                      ["quantization_config", "quant_method 'fp8'"]))
    for model, fragments in cases:
        with pytest.raises(SystemExit) as e:
            main(["--model", str(model), "--input", str(tmp_path / "in.parquet"), "--output",
                  str(tmp_path / "o.jsonl"), "--device", "cpu", "--max-new-tokens", "4", "--engine", engine])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err, err
        line = err.strip().splitlines()[-1]
        assert str(model) in line or "quantization_config" in line, line
        for fragment in fragments:
            assert fragment in line, (fragment, line)
        assert not (tmp_path / "o.jsonl").exists()


def test_over_long_prompts_are_refused_or_cut(tiny_model_dir, tmp_path, capsys):
    """A 12k-token prompt on a 4k-context model: refused with the row named, or cut from the left on request."""
    model = tiny_model_dir("qwen2")  # max_position_embeddings 4096
    inp = tmp_path / "long.jsonl"
    inp.write_text(json.dumps({"prompt": "What is 7 times 8?"}) + "\n"
                   + json.dumps({"prompt": "seven " * 12_000}) + "\n")
    out = tmp_path / "o.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["--model", str(model), "--input", str(inp), "--output", str(out), "--max-new-tokens", "8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "row 1: its prompt is" in err and "context of 4096 tokens" in err and "--truncate-prompts left" in err
    assert not out.exists()
    main(["--model", str(model), "--input", str(inp), "--output", str(out), "--max-new-tokens", "4",
          "--temperature", "0", "--truncate-prompts", "left", "--device", "cpu"])
    assert "1 prompt(s) cut to their last 4092 tokens" in capsys.readouterr().err
    assert len(read_jsonl(out)) == 2


AGENT_PLUGIN = '''
from rlhf_mcore.agents import AgentLoop, ToolCall, register_agent


@register_agent("cli_test_calc_agent")
class CalcAgent(AgentLoop):
    """A model turn, then a calculator call of the row's numbers (whatever the random model said), then a turn."""

    async def run(self, row, traj):
        await self.generate(traj)
        if traj.done:
            return
        a, b = row["extra_info"]["question"].split()[2:5:2]
        calls = [ToolCall("calculator", {"expression": f"{a} * {b.rstrip('?')}"}), ToolCall("nope", {})]
        if traj.add_messages(await self.call_tools(traj, calls), role="tool"):
            await self.generate(traj)
'''


def test_agent_loops_offline(tiny_model_dir, tmp_path):
    """--agent: rows without agent_name run it (a --plugins loop calling the calculator), a row's own agent_name
    (tool_agent) wins; every sample carries its mask, model-token log-probs, turns, tool calls and messages."""
    from rlhf_mcore.agents.tasks import multiply_rows

    rows = multiply_rows(3, seed=1, split="test")
    for r in rows[:2]:
        r["agent_name"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    (tmp_path / "cli_agent_plugin.py").write_text(AGENT_PLUGIN)
    main(["--model", str(tiny_model_dir("qwen2")), "--input", str(tmp_path / "in.parquet"), "--output",
          str(tmp_path / "out.jsonl"), "--agent", "cli_test_calc_agent", "--tools", "configs/tools/calculator.yaml",
          "--plugins", str(tmp_path / "cli_agent_plugin.py"), "--n", "2", "--seed", "0", "--max-new-tokens", "96",
          "--max-tokens-per-turn", "8", "--device", "cpu"])
    out = read_jsonl(tmp_path / "out.jsonl")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen2"))
    assert [r["extra_info"]["index"] for r in out] == [0, 1, 2]
    for k, rec in enumerate(out):
        for i in range(2):
            ids, mask, turns = rec["response_ids"][i], rec["response_mask"][i], rec["turns"][i]
            assert len(ids) == len(mask) <= 96 and len(rec["logprobs"][i]) == sum(mask) > 0
            assert all(lp <= 0 for lp in rec["logprobs"][i])
            for t in turns:  # the mask is 1 exactly on the model's turns
                assert set(mask[t["start"]:t["end"]]) == {int(t["role"] == "assistant")}
            assert rec["messages"][i][:1] == rows[k]["prompt"]  # the conversation, from the prompt on
            if k == 2:  # its own tool_agent: the random model writes no call, one turn
                assert [t["role"] for t in turns] == ["assistant"] and rec["tool_calls"][i] == []
                continue
            assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"]
            a, b = rows[k]["extra_info"]["question"].split()[2:5:2]
            product = str(int(a) * int(b.rstrip("?")))
            calls = rec["tool_calls"][i]
            assert [(c["turn"], c["name"], c["outcome"]) for c in calls] == [(0, "calculator", "ok"),
                                                                              (0, "nope", "unknown")]
            assert calls[0]["arguments"] == {"expression": f"{a} * {b.rstrip('?')}"}
            assert [m["content"] for m in rec["messages"][i] if m["role"] == "tool"][0] == product
            tool_text = tok.decode(ids[turns[1]["start"]:turns[1]["end"]])
            assert product in tool_text and "unknown tool 'nope'" in tool_text
            assert rec["stats"][i]["tool_calls"] == 2 and rec["stats"][i]["tool_unknown"] == 1


def test_agent_flag_errors(tiny_model_dir, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "What is 7 times 8?"}) + "\n")
    base = ["--model", str(tiny_model_dir("qwen2")), "--input", str(inp), "--output", str(tmp_path / "o.jsonl")]
    cases = [(["--tools", "configs/tools/calculator.yaml"], "add --agent NAME"),
             (["--agent", "no_such_agent"], "--agent: unknown agent_name='no_such_agent'"),
             (["--agent", "tool_agent", "--tools", str(tmp_path / "missing.yaml")], "missing.yaml: file not found"),
             (["--agent", "tool_agent", "--max-turns", "0"], "--max-turns 0 must be >= 1")]
    for args, message in cases:
        with pytest.raises(SystemExit):
            main(base + args)
        assert message in capsys.readouterr().err
