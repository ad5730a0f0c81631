"""Facts read from a Hugging Face model directory's config.json (no model code, no torch)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def _config(model_path: str) -> Optional[dict]:
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _read(model_path: str, key: str) -> Optional[int]:
    """`key` of the config, or of its `text_config` (a vision-language model's text model)."""
    cfg = _config(model_path) or {}
    if key not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    try:
        return int(cfg[key])
    except (KeyError, ValueError, TypeError):
        return None


def model_architecture(model_path: str) -> Optional[str]:
    """The first of config.json's `architectures`, or None where it cannot be read."""
    archs = (_config(model_path) or {}).get("architectures")
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def model_max_positions(model_path: str) -> Optional[int]:
    """max_position_embeddings from an HF config.json, or None where it cannot be read."""
    return _read(model_path, "max_position_embeddings")


def model_num_layers(model_path: str) -> Optional[int]:
    """num_hidden_layers from an HF config.json, or None where it cannot be read."""
    return _read(model_path, "num_hidden_layers")


def model_is_moe(model_path: str) -> Optional[bool]:
    """Whether an HF config.json's architecture is a mixture-of-experts one (Qwen3MoeForCausalLM, ...), or None where
    it cannot be read."""
    try:
        archs = json.loads((Path(model_path) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    return any("Moe" in a for a in archs) if archs else None
