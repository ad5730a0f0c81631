"""The tiny-model fixture loads like a real Qwen2.5/Llama-3/Qwen3 directory and is fixed by its seed."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rlhf_mcore.models.tiny import default_tokenizer_vocab, make_tiny_model

EXPECTED_CLASS = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_loads_with_transformers(tiny_model_dir, arch):
    d = tiny_model_dir(arch)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (d / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    cfg = model.config
    assert type(model).__name__ == EXPECTED_CLASS[arch]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 64, 4, 2)
    assert cfg.head_dim == 16 and cfg.intermediate_size == 128
    # The embedding covers the tokenizer with padding rows to spare, as in Qwen.
    assert len(tok) == default_tokenizer_vocab(1024) < cfg.vocab_size == 1024
    assert cfg.tie_word_embeddings == (arch != "llama")
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    if arch == "qwen3":
        assert model.model.layers[0].self_attn.q_norm.weight.shape == (16,)
    if arch == "llama":
        rope = cfg.rope_parameters
        assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    ids = torch.tensor([tok("Natalia sold 48 clips in April.")["input_ids"]])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 1024) and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_special_tokens_and_chat_template(tiny_model_dir, arch):
    d = tiny_model_dir(arch)
    tok = AutoTokenizer.from_pretrained(d)
    n = len(tok)
    # Special tokens follow the learned vocabulary, in Qwen's order.
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [n - 3, n - 2, n - 1]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == n - 1
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == n - 3
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [n - 1, n - 3] and gen["pad_token_id"] == n - 3
    assert AutoConfig.from_pretrained(d).eos_token_id == n - 1

    user = [{"role": "user", "content": "What is 2+3?"}]
    text = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    conv = [{"role": "system", "content": "Be brief."}, *user, {"role": "assistant", "content": "5"}]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
                    "<|im_start|>assistant\n5<|im_end|>\n")
    ids = tok(text)["input_ids"]
    assert ids.count(n - 2) == 3 and ids.count(n - 1) == 3  # special tokens are single ids, never split
    sample = "Weng earns $12 an hour.\n#### 10"
    assert tok.decode(tok(sample)["input_ids"]) == sample


def test_deterministic_by_seed(tmp_path):
    a = make_tiny_model(tmp_path / "a", arch="qwen3", seed=3)
    b = make_tiny_model(tmp_path / "b", arch="qwen3", seed=3)
    c = make_tiny_model(tmp_path / "c", arch="qwen3", seed=4)
    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert wa.keys() == wb.keys() == wc.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_cli_and_options(tmp_path):
    from launch.make_tiny_model import main

    out = main(["--arch", "llama", "--out", str(tmp_path / "m"), "--layers", "1", "--hidden", "32",
                "--heads", "2", "--kv-heads", "1", "--vocab", "600", "--dtype", "bfloat16"])
    cfg = AutoConfig.from_pretrained(out)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (1, 32, 1, 600)
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "model.safetensors").values())
    with pytest.raises(ValueError, match="kv_heads"):
        make_tiny_model(tmp_path / "bad", heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model(tmp_path / "bad", arch="gpt2")


def test_tokenizer_texts_make_a_task_layout_short(tmp_path):
    """`--multiply-digits`: the tokenizer also learns the multiply task's prompt and calculator call (a few tokens
    each, as in a real vocabulary); text still round-trips, digits stay single tokens, `--init-std` reaches the
    config."""
    from launch.make_tiny_model import main
    from rlhf_mcore.agents.tasks import multiply_rows

    row = multiply_rows(1, digits=2, call_fraction=1.0)[0]
    texts = [row["prompt"][0]["content"], row["extra_info"]["messages"][0]["content"]]
    plain = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "plain", hidden=32))
    out = main(["--out", str(tmp_path / "task"), "--hidden", "32", "--multiply-digits", "2", "--init-std", "0.02"])
    task = AutoTokenizer.from_pretrained(out)
    assert AutoConfig.from_pretrained(out).initializer_range == 0.02
    for text in texts:
        ids = task(text, add_special_tokens=False)["input_ids"]
        assert task.decode(ids) == text
        assert len(ids) < 0.6 * len(plain(text, add_special_tokens=False)["input_ids"]), text
        pieces = [task.decode([i]) for i in ids]
        assert all(p.isdigit() and len(p) == 1 for p in pieces if any(c.isdigit() for c in p)), pieces


def test_decode_texts_equals_tokenizer_decode(tiny_model_dir):
    """`decode_texts` (one batched call to the Rust backend) gives `tokenizer.decode`'s texts, special tokens
    skipped or kept, for responses with ChatML tokens, empty ones and random ids; a tokenizer that cleans up
    spaces takes `decode` itself. Mutation: `decode_batch(..., skip_special_tokens=False)` always -> fails."""
    from rlhf_mcore.models.tokenizer import decode_texts

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen2"))
    g = torch.Generator().manual_seed(0)
    special = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    seqs = [tok("The answer is 42.")["input_ids"] + [special[1]], [], [special[0]] + tok("x = 3")["input_ids"],
            *[torch.randint(0, len(tok), (n,), generator=g).tolist() for n in (1, 7, 64)]]
    for skip in (True, False):
        assert decode_texts(tok, seqs, skip_special_tokens=skip) == [tok.decode(s, skip_special_tokens=skip)
                                                                     for s in seqs]
    assert decode_texts(tok, seqs)[0] == "The answer is 42." and decode_texts(tok, []) == []
    tok.clean_up_tokenization_spaces = True
    assert decode_texts(tok, seqs) == [tok.decode(s, skip_special_tokens=True) for s in seqs]
