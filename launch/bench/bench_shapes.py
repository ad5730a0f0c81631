"""Model shapes and random-weight model directories shared by every benchmark script (one place, not one copy each).

    from bench_shapes import SHAPES, TINY, shape, write_config, random_model_dir, tokenizer_model_dir

Shapes are `transformers.Qwen2Config` keyword arguments (Qwen2.5 family: QKV bias, RMSNorm, SwiGLU, RoPE theta
1e6), copied from the published config.json files of Qwen/Qwen2.5-{0.5B,1.5B,7B}-Instruct. `TINY` is the CPU smoke
shape every script runs under `--tiny`.

`MOE_SHAPES` are `transformers.Qwen3MoeConfig` keyword arguments (`moe_shape(name)`): Qwen/Qwen3-30B-A3B's config.json
with 4 of its 48 layers (`qwen3_30b_a3b_4l`: 128 experts, top-8 renormalised, every layer sparse), and a CPU-sized
`tiny` of the same kind. `write_config` / `random_model_dir` take either kind (a shape with `num_experts` is a
Qwen3-MoE); `moe_param_counts` gives a MoE shape's total and active parameters.

- `write_config`: config.json only (Megatron builds with random init; nothing loads weights);
- `random_model_dir`: config + safetensors (transformers' random init, seeded), no tokenizer (rollout, sync);
- `tokenizer_model_dir`: a full HF directory with a tokenizer (the trainer and TRL need one), through
  `rlhf_mcore.models.tiny.make_tiny_model` at the requested shape: a byte-level BPE trained on GSM8K text
  (vocabulary `tokenizer_vocab`, smaller than the model's, as in Qwen) and a ChatML template.

`git_commit()` is the commit stamp every report carries ("abc1234 + working tree" when tracked files differ).

Scripts import this module as `bench_shapes` (they run as `python launch/bench/bench_x.py`, so launch/ is on the path).
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

_COMMON = dict(rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu",
               use_sliding_window=False)

SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, **_COMMON),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, **_COMMON),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, **_COMMON),
}
TINY: dict = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=1024, tie_word_embeddings=True,
                  **{**_COMMON, "max_position_embeddings": 4096})
SHAPES["tiny"] = TINY
QWEN25_05B = SHAPES["qwen2.5-0.5b"]
ALIASES = {"0.5b": "qwen2.5-0.5b", "1.5b": "qwen2.5-1.5b", "7b": "qwen2.5-7b"}

# Qwen/Qwen3-30B-A3B's config.json (48 layers there): no QKV bias, QK-norm, no shared expert, untied embeddings
_QWEN3_MOE = dict(rope_theta=1e6, rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, use_sliding_window=False,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
MOE_SHAPES: dict[str, dict] = {
    "qwen3_30b_a3b_4l": dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                             head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                             num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960, **_QWEN3_MOE),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                 vocab_size=1024, max_position_embeddings=4096, **_QWEN3_MOE),
}


def shape(name: str, **overrides) -> dict:
    """The shape called `name` (or an alias: 0.5b, 1.5b, 7b, tiny), with `overrides` (e.g. vocab_size=8192)."""
    key = ALIASES.get(name, name)
    if key not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; choose one of {sorted(SHAPES) + sorted(ALIASES)}")
    return {**SHAPES[key], **overrides}


def num_params(s: dict) -> int:
    """Parameters of a Qwen2-style model of shape `s` (embeddings counted once when tied)."""
    h, L, V, f = s["hidden_size"], s["num_hidden_layers"], s["vocab_size"], s["intermediate_size"]
    d = h // s["num_attention_heads"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    attn = h * (q + 2 * kv) + (q + 2 * kv) + q * h  # QKV (+ bias) and the output projection
    layer = attn + 3 * h * f + 2 * h  # SwiGLU MLP and two RMSNorm weights
    return L * layer + V * h * (1 if s["tie_word_embeddings"] else 2) + h


def moe_shape(name: str, **overrides) -> dict:
    """The MoE shape called `name` (`MOE_SHAPES`), with `overrides`."""
    if name not in MOE_SHAPES:
        raise SystemExit(f"unknown MoE shape {name!r}; choose one of {sorted(MOE_SHAPES)}")
    return {**MOE_SHAPES[name], **overrides}


def moe_param_counts(s: dict) -> dict[str, int]:
    """Parameters of a Qwen3-MoE shape `s` (every layer sparse, untied): `total`, and `active` -- those one token
    goes through (attention, norms, the router, its top-k experts, the embedding row and the output projection),
    the "A3B" of Qwen3-30B-A3B."""
    h, L, V = s["hidden_size"], s["num_hidden_layers"], s["vocab_size"]
    d, E, k, f = s["head_dim"], s["num_experts"], s["num_experts_per_tok"], s["moe_intermediate_size"]
    if s.get("mlp_only_layers") or s.get("decoder_sparse_step", 1) != 1 or s["tie_word_embeddings"]:
        raise ValueError("moe_param_counts counts Qwen3-MoE shapes with every layer sparse and untied embeddings")
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    common = h * (q + 2 * kv) + q * h + 2 * d + 2 * h + E * h  # QKV, output, QK-norms, two RMSNorms, the router
    embed = 2 * V * h + h  # embedding, output projection, final norm
    return {"total": L * (common + E * 3 * h * f) + embed, "active": L * (common + k * 3 * h * f) + embed}


def hf_config(s: dict, **kwargs):
    """The transformers config of shape `s`: Qwen3MoeConfig when `s` has experts, else Qwen2Config."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    return (Qwen3MoeConfig if "num_experts" in s else Qwen2Config)(**s, bos_token_id=0, eos_token_id=1,
                                                                   pad_token_id=0, **kwargs)


def write_config(s: dict, out: Path, dtype: str = "bfloat16") -> Path:
    """config.json of a Qwen2 (or, with experts, Qwen3-MoE) model of shape `s` (no weights)."""
    out = Path(out)
    moe = "num_experts" in s
    cfg = hf_config(s, architectures=["Qwen3MoeForCausalLM" if moe else "Qwen2ForCausalLM"])
    cfg.dtype = dtype
    cfg.save_pretrained(out)
    return out


def random_model_dir(s: dict, out: Path, device, dtype, seed: int = 0) -> Path:
    """Random-weight Qwen2 (or, with experts, Qwen3-MoE) model (transformers init, seed `seed`; `initializer_range`
    in `s` sets its std) saved as an HF directory (no tokenizer)."""
    import torch
    from transformers import Qwen2ForCausalLM, Qwen3MoeForCausalLM

    cfg = hf_config(s)
    torch.manual_seed(seed)
    with torch.device(device):  # built on `device`: transformers' init of billions of parameters runs there
        model = (Qwen3MoeForCausalLM if "num_experts" in s else Qwen2ForCausalLM)(cfg).to(dtype)
    model.save_pretrained(out)
    del model
    return Path(out)


def tokenizer_model_dir(s: dict, out: Path, *, tokenizer_vocab: int | None = None, dtype: str = "bfloat16",
                        seed: int = 0, init_std: float = 0.02) -> Path:
    """A complete HF directory (weights, tokenizer, chat template) of shape `s`; reused when `out` holds one
    with the same shape (a marker file records it)."""
    from rlhf_mcore.models.tiny import make_tiny_model

    out = Path(out)
    marker = out / "bench_shape.json"
    want = {"shape": s, "tokenizer_vocab": tokenizer_vocab, "dtype": dtype, "seed": seed, "init_std": init_std}
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return out
    tok_vocab = tokenizer_vocab or min(8192, s["vocab_size"] - max(1, s["vocab_size"] // 16))
    make_tiny_model(out, arch="qwen2", layers=s["num_hidden_layers"], hidden=s["hidden_size"],
                    heads=s["num_attention_heads"], kv_heads=s["num_key_value_heads"], vocab=s["vocab_size"],
                    intermediate=s["intermediate_size"], seed=seed, tie_word_embeddings=s["tie_word_embeddings"],
                    dtype=dtype, tokenizer_vocab=tok_vocab, max_position_embeddings=s["max_position_embeddings"],
                    init_std=init_std)
    marker.write_text(json.dumps(want))
    return out


def git_commit() -> str:
    """The short commit of the checkout, with " + working tree" when tracked files differ from it."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return out + (" + working tree" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_report(report: dict, out) -> None:
    """A benchmark's JSON report to `out` (`--out`); nothing when `out` is empty. Non-JSON values become strings."""
    if out:
        Path(out).write_text(json.dumps(report, indent=1, default=str) + "\n")


def cell(row: dict, key: str, spec: str) -> str:
    """`row[key]` formatted with `spec` (e.g. ">8.3f"), or "n/a" right-aligned to the same width when missing or
    None: benchmark tables print rows whose measurement failed or does not apply."""
    value = row.get(key)
    if value is None:
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit()) or "0"
        return format("n/a", f">{width}")
    return format(value, spec)
