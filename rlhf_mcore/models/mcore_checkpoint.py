"""Megatron distributed checkpoints of model chunks, reloadable under any TP/PP layout.

A checkpoint directory holds what `megatron.core.dist_checkpointing.save` writes for the chunks'
`sharded_state_dict()` (its keys are global — layer index and TP offsets are part of each ShardedTensor — so
another layout can load it; the padded vocabulary may change size with TP: Megatron allows that mismatch),
plus `hf_meta/`: the HF `config.json` and the tokenizer / chat-template / generation files of the source
model. `hf_meta/` is itself a weight-less HF directory, so `build_model(ckpt/"hf_meta", state,
load_weights=False)` rebuilds the model before loading, and `save_hf_checkpoint` copies its tokenizer.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist

from rlhf_mcore.models.hf_export import WEIGHT_SUFFIXES
from rlhf_mcore.models.hf_loader import INDEX_FILE, unwrap_model

HF_META = "hf_meta"


def _sharded_state_dict(chunks) -> dict:
    """Megatron-LM's convention: {"model": sd} for one chunk, {"model0": sd0, "model1": sd1, ...} with VPP."""
    chunks = [unwrap_model(c) for c in chunks]
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def save_mcore_checkpoint(model_chunks, state, mcore_dir, hf_dir) -> Path:
    """Save the chunks as a Megatron distributed checkpoint in `mcore_dir` (+ `hf_meta/` copied from `hf_dir`).
    A collective over all ranks."""
    from megatron.core import dist_checkpointing

    out = Path(mcore_dir)
    if state.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier(group=state.world_group)
    dist_checkpointing.save(_sharded_state_dict(model_chunks), str(out))
    if state.rank == 0:
        write_hf_meta(out, hf_dir, unwrap_model(model_chunks[0]).model_role, state)
    dist.barrier(group=state.world_group)
    return out


def write_hf_meta(mcore_dir, hf_dir, role: str, state) -> Path:
    """Copy `hf_dir`'s config.json, tokenizer, chat template and generation config (no weights) into
    `mcore_dir/hf_meta/`, with `rlhf_mcore.json` (role, saving layout). Called by one rank."""
    meta = Path(mcore_dir) / HF_META
    meta.mkdir(parents=True, exist_ok=True)
    for f in Path(hf_dir).iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name != INDEX_FILE:
            shutil.copy2(f, meta / f.name)
    (meta / "rlhf_mcore.json").write_text(json.dumps(
        {"role": role, "saved_tp": state.dims.tp, "saved_pp": state.dims.pp, "saved_vpp": state.dims.vpp},
        indent=2) + "\n")
    return meta


def saved_role(mcore_dir) -> str:
    """The role ("actor"/"ref"/"critic") the checkpoint was saved with."""
    info = Path(mcore_dir) / HF_META / "rlhf_mcore.json"
    return json.loads(info.read_text())["role"] if info.is_file() else "actor"


def load_mcore_checkpoint(model_chunks, mcore_dir) -> None:
    """Load a checkpoint written by `save_mcore_checkpoint` (any layout) into the chunks (a collective), executing
    nothing from its files (`rlhf_mcore.engine.safe_load`)."""
    from rlhf_mcore.engine.safe_load import load_distributed

    path = Path(mcore_dir)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path} is not a Megatron distributed checkpoint (no metadata.json); "
                                "write one with launch/convert_checkpoint.py --direction hf2mcore.")
    loaded = load_distributed(_sharded_state_dict(model_chunks), path)  # tensors and plain data only
    chunks = [unwrap_model(c) for c in model_chunks]
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for chunk, key in zip(chunks, keys):
        chunk.load_state_dict(loaded[key], strict=True)
