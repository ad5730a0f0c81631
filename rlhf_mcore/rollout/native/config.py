"""The slice of a Hugging Face `config.json` the native engine needs, for the Qwen2, Llama and Qwen3 families.

Reads both the transformers-4 layout (`rope_theta` + `rope_scaling`) and the transformers-5 layout
(`rope_parameters`), so checkpoints from either generation load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3")


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    rope: RopeSpec = field(default_factory=RopeSpec)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope_from_config(cfg: dict) -> RopeSpec:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope type {rope_type!r} (config.json rope_scaling/rope_parameters) is not supported "
                         "by the native rollout engine; supported: 'default', 'llama3'. Use engine 'hf'.")
    if rope_type == "default":
        return RopeSpec(theta=float(theta))
    return RopeSpec(
        theta=float(theta), rope_type="llama3", factor=float(merged["factor"]),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


def model_spec_from_dict(cfg: dict) -> ModelSpec:
    """Build a ModelSpec from a parsed config.json; raises ValueError for unsupported architectures."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json model_type={model_type!r} is not supported by the native rollout engine "
                         f"(supported: {SUPPORTED_MODEL_TYPES}); use the 'hf' or 'sglang' engine.")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if model_type == "qwen2" and cfg.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true is not supported by the native engine.")
    return ModelSpec(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope=_rope_from_config(cfg),
    )


def load_model_spec(model_dir) -> ModelSpec:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: model_dir must be a Hugging Face model directory "
                                "(config.json + *.safetensors).")
    return model_spec_from_dict(json.loads(path.read_text()))
