"""Tiny Hugging Face-format models for tests and CPU demos.

`make_tiny_model` writes a directory that loads exactly like a real Qwen2.5 / Llama-3 / Qwen3 checkpoint:
`config.json` + `model.safetensors` (random weights from transformers' own initialisation, seeded),
`generation_config.json`, and a byte-level BPE tokenizer trained on the vendored GSM8K text with the ChatML
special tokens and a Qwen2.5-style chat template.

Why train a tokenizer instead of shipping one: the tests must run offline, and a tokenizer trained on the
task's own text gives short, realistic token sequences for GSM8K prompts. Training uses a fixed slice of the
data so it is quick and deterministic; nothing is cached outside `out_dir`.

The model's `vocab_size` is deliberately larger than the tokenizer's vocabulary (as in Qwen, whose embedding
has 151936 rows for 151665 tokens) so that code handling padded vocabularies gets exercised.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

ARCHS = ("qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe")

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# A ChatML template in the style of Qwen2.5's (without tool calls): a default system turn when none is given,
# every turn wrapped in <|im_start|>role\n ... <|im_end|>\n, and an open assistant turn on request.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Qwen2's pre-tokenization regex (contractions, letter runs, single digits, punctuation, newlines, spaces).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)

_GSM8K_TRAIN = Path(__file__).resolve().parents[1] / "data" / "raw" / "gsm8k" / "train.jsonl"
# Rows of GSM8K used to train the tokenizer: enough for sensible merges, few enough to train in a moment.
_TOKENIZER_TRAIN_ROWS = 1500
# How often the caller's extra texts (make_tiny_model's `tokenizer_texts`) repeat among those rows: often enough
# that their words become single tokens even in a small vocabulary.
_EXTRA_TEXT_REPEATS = 1000


def default_tokenizer_vocab(vocab: int) -> int:
    """Tokenizer vocabulary for a model vocabulary `vocab`: ~6% smaller, so the embedding has padding rows."""
    return vocab - max(1, vocab // 16)


def _gsm8k_texts(n_rows: int, extra_texts: Sequence[str] = ()) -> list[str]:
    if not _GSM8K_TRAIN.exists():
        raise FileNotFoundError(
            f"vendored GSM8K not found at {_GSM8K_TRAIN}; the tiny tokenizer is trained on it. "
            "Restore rlhf_mcore/data/raw/gsm8k/train.jsonl from the repository."
        )
    texts = []
    with open(_GSM8K_TRAIN) as f:
        for i, line in enumerate(f):
            if i >= n_rows:
                break
            row = json.loads(line)
            texts.append(row["question"])
            texts.append(row["answer"])
    # Chat-template words, so rendered prompts tokenize into few tokens.
    texts.extend(["system", "user", "assistant", "You are a helpful assistant.",
                  "Let's think step by step and output the final answer after \"####\"."] * 50)
    texts.extend(list(extra_texts) * _EXTRA_TEXT_REPEATS)
    return texts


def train_tokenizer(tokenizer_vocab: int, extra_texts: Sequence[str] = ()):
    """Train a byte-level BPE tokenizer on GSM8K text (and `extra_texts`, each repeated `_EXTRA_TEXT_REPEATS` times);
    ChatML special tokens get the last 3 ids (as in Qwen).

    Returns a `transformers.PreTrainedTokenizerFast` with eos = <|im_end|>, pad = <|endoftext|> and the
    ChatML chat template.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_bytes = 256
    if tokenizer_vocab < n_bytes + len(SPECIAL_TOKENS) + 16:
        raise ValueError(
            f"tokenizer_vocab={tokenizer_vocab} is too small for a byte-level BPE (256 byte tokens + "
            f"{len(SPECIAL_TOKENS)} special tokens + merges); use at least {n_bytes + len(SPECIAL_TOKENS) + 16}."
        )
    tok = Tokenizer(models.BPE())
    # Qwen2's normalizer and pre-tokenizer (single digits, byte-level). transformers 5 rebuilds exactly this
    # pipeline when it loads a `qwen2` directory, so the saved tokenizer.json must agree with it.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=tokenizer_vocab - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(_gsm8k_texts(_TOKENIZER_TRAIN_ROWS, extra_texts), trainer=trainer)
    # Special tokens are appended after the learned vocabulary, as in Qwen2 (151643.. for the real one).
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHATML_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )


def _build_config(arch: str, *, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int,
                  intermediate: int, head_dim: int, tie: bool, bos_id: int, eos_id: int, pad_id: int,
                  dtype: str, max_position_embeddings: int, experts: int = 4, top_k: int = 2):
    from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, hidden_act="silu",
    )
    if arch == "qwen2":
        cfg = Qwen2Config(rope_theta=1e6, use_sliding_window=False, **common)
    elif arch == "qwen3":
        cfg = Qwen3Config(rope_theta=1e6, attention_bias=False, use_sliding_window=False, **common)
    elif arch == "qwen3_moe":  # layer 0 dense through mlp_only_layers, the rest sparse; renormalised top-k
        cfg = Qwen3MoeConfig(rope_theta=1e6, attention_bias=False, use_sliding_window=False, num_experts=experts,
                             num_experts_per_tok=top_k, moe_intermediate_size=intermediate // 2,
                             mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True, **common)
    elif arch == "qwen2_moe":  # every second layer sparse (decoder_sparse_step=2); a gated shared expert
        cfg = Qwen2MoeConfig(rope_theta=1e6, use_sliding_window=False, num_experts=experts,
                             num_experts_per_tok=top_k, moe_intermediate_size=intermediate // 2,
                             shared_expert_intermediate_size=intermediate, mlp_only_layers=[],
                             decoder_sparse_step=2, norm_topk_prob=False, **common)
    else:  # llama: Llama-3 style rope scaling; a small original context so every branch of it is exercised.
        cfg = LlamaConfig(
            rope_theta=5e5, attention_bias=False, mlp_bias=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            **common,
        )
    cfg.dtype = dtype
    return cfg


def make_tiny_model(
    out_dir,
    arch: str = "qwen2",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1024,
    intermediate: int | None = None,
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    dtype: str = "float32",
    head_dim: int | None = None,
    tokenizer_vocab: int | None = None,
    max_position_embeddings: int = 4096,
    init_std: float = 0.2,
    tokenizer_texts: Sequence[str] = (),
    experts: int = 4,
    top_k: int = 2,
) -> Path:
    """Write a tiny random HF model directory (config, safetensors, tokenizer, generation config) to `out_dir`.

    arch: "qwen2" (QKV bias, tied embeddings by default), "llama" (llama3 rope scaling, untied by default) or
    "qwen3" (QK-norm, tied by default), "qwen3_moe" (Qwen3 attention, `experts` experts of width intermediate / 2,
    top-`top_k` renormalised, layer 0 dense) or "qwen2_moe" (Qwen2 attention, every second layer sparse, a gated
    shared expert of width `intermediate`; top-k not renormalised). `intermediate` defaults to 2 * hidden;
    `head_dim` to hidden // heads;
    `tokenizer_vocab` to `default_tokenizer_vocab(vocab)` (smaller than `vocab`, to exercise padding).
    Weights come from transformers' own init under `torch.manual_seed(seed)`, so a seed fixes the model.
    `init_std` (config.initializer_range) defaults to 0.2 rather than transformers' 0.02: at 0.02 a tiny model
    with tied embeddings just repeats its last input token greedily; at 0.2 the layers decide the next token,
    so generation tests exercise attention and the MLP, and top-1/top-2 logit gaps are wide enough that
    fp32 implementations agree token for token.
    `tokenizer_texts`: more text for the tokenizer to learn merges from (e.g. a task's prompt and tool-call
    layout), so that it tokenizes into few tokens as in a real model's vocabulary.
    Returns `Path(out_dir)`.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; choose one of {ARCHS}.")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r}; choose 'float32', 'bfloat16' or 'float16'.")
    if heads % kv_heads != 0:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads} (grouped-query attention).")
    if head_dim is None:
        if hidden % heads != 0:
            raise ValueError(f"hidden={hidden} is not divisible by heads={heads}; pass head_dim explicitly.")
        head_dim = hidden // heads
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings.")
    intermediate = intermediate or 2 * hidden
    tokenizer_vocab = tokenizer_vocab or default_tokenizer_vocab(vocab)
    if tokenizer_vocab > vocab:
        raise ValueError(f"tokenizer_vocab={tokenizer_vocab} exceeds the model vocab={vocab}; "
                         "the embedding must cover every token id. Raise vocab or lower tokenizer_vocab.")
    if tie_word_embeddings is None:
        tie_word_embeddings = arch != "llama"

    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(tokenizer_vocab, tokenizer_texts)
    assert len(tokenizer) == tokenizer_vocab, (len(tokenizer), tokenizer_vocab)
    eot_id, im_end_id = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])

    cfg = _build_config(
        arch, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
        intermediate=intermediate, head_dim=head_dim, tie=tie_word_embeddings, bos_id=eot_id,
        eos_id=im_end_id, pad_id=eot_id, dtype=dtype, max_position_embeddings=max_position_embeddings,
        experts=experts, top_k=top_k,
    )
    cfg.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=eot_id, eos_token_id=[im_end_id, eot_id], pad_token_id=eot_id, do_sample=False,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _set_tokenizer_class(out / "tokenizer_config.json", "PreTrainedTokenizerFast" if arch == "llama"
                         else "Qwen2Tokenizer")
    return out


def _set_tokenizer_class(path: Path, name: str) -> None:
    """Name the tokenizer class as the real checkpoints do (Qwen: `Qwen2Tokenizer`, Llama-3:
    `PreTrainedTokenizerFast`); transformers 5 otherwise writes its internal `TokenizersBackend`, unknown to 4.x."""
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = name
    path.write_text(json.dumps(cfg, indent=2) + "\n")
