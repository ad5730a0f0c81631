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
