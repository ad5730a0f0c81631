"""Load a Hugging Face safetensors checkpoint into this rank's Megatron shard, reading only what it owns.

Each rank opens the checkpoint's safetensors files (one `model.safetensors`, or the shards listed in
`model.safetensors.index.json`) and, for every parameter of its model chunks, reads just the rows/columns of the HF
tensors that its TP shard is made of (`safe_open(...).get_slice(name)[...]`): at TP=2 a rank reads half of every
sharded tensor, a PP stage reads only its own layers, and an expert-parallel rank only its experts. Nothing is
materialised for the whole model. A `ReadLog` records every read, so tests (and curious users) can see what was
touched. A checkpoint tensor of the rank's layers that no parameter is made of (a q/k norm, a bias or a quantization
scale config.json does not announce) fails the load with its name. Before reading, every file's header is checked
against its size (`safetensors_check`), on every rank: a truncated or corrupt file fails everywhere with its name.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhf_mcore.models.hf_config import ModelShape
from rlhf_mcore.models.moe import expert_offset
from rlhf_mcore.models.safetensors_check import INDEX_FILE, ModelFileError, model_weight_files
from rlhf_mcore.models.weight_map import WeightRule, read_shard, rule_for_param, rule_shape

__all__ = ["INDEX_FILE", "ReadLog", "SafetensorsCheckpoint", "chunk_param_rule", "layer_numbers", "load_hf_weights",
           "named_weights", "unmapped_layer_tensors", "unwrap_model"]


@dataclass
class ReadLog:
    """Every slice read from the checkpoint: (hf_name, shape of the slice read)."""

    reads: list = field(default_factory=list)

    def add(self, name: str, shape: tuple) -> None:
        self.reads.append((name, tuple(shape)))

    def numel(self, name: str) -> int:
        """Elements of `name` read so far (0 when never read)."""
        return sum(_prod(s) for n, s in self.reads if n == name)

    def numel_by_name(self) -> dict:
        out = defaultdict(int)
        for n, s in self.reads:
            out[n] += _prod(s)
        return dict(out)


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class SafetensorsCheckpoint:
    """Lazy, slice-wise access to the tensors of an HF checkpoint directory."""

    def __init__(self, hf_dir, log: ReadLog | None = None):
        self.dir = Path(hf_dir)
        self.log = log if log is not None else ReadLog()
        self._handles: dict = {}
        files = model_weight_files(self.dir)  # every file's header checked before any tensor is read
        index = self.dir / INDEX_FILE
        if index.is_file():
            self.weight_map = dict(json.loads(index.read_text())["weight_map"])
        else:
            if not files:
                raise FileNotFoundError(
                    f"no *.safetensors in {self.dir}; this loader reads safetensors only. Re-save the model with "
                    "transformers' save_pretrained (safe_serialization is the default).")
            self.weight_map = {}
            for f in files:
                for name in self._open(f.name).keys():
                    self.weight_map[name] = f.name

    def _open(self, filename: str):
        from safetensors import safe_open

        if filename not in self._handles:
            path = self.dir / filename
            try:
                self._handles[filename] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # SafetensorError and OSError: the file, not our code
                raise ModelFileError(f"cannot open model file {path} ({type(e).__name__}: {e}): re-download the "
                                     "model, or re-save it with transformers' save_pretrained.") from None
        return self._handles[filename]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple:
        return tuple(self._slice(name).get_shape())

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise ModelFileError(f"tensor {name!r} is not in the checkpoint {self.dir} (it has "
                                 f"{len(self.weight_map)} tensors), and config.json describes a model made of it: "
                                 "is this the right model directory, and config.json the one of these weights?")
        return self._open(self.weight_map[name]).get_slice(name)

    def read(self, name: str, index: tuple) -> torch.Tensor:
        """`tensor[index]`, reading only that part of the file."""
        tensor = self._slice(name)[index]
        self.log.add(name, tensor.shape)
        return tensor

    def close(self) -> None:
        self._handles.clear()


def unwrap_model(module):
    """The GPTModel inside DDP / Float16Module-style wrappers (anything exposing `.module`)."""
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


def layer_numbers(chunk) -> dict:
    """Local layer index -> global 0-based layer index: the chunk's `layer_ids` (set and checked against Megatron
    by `build_model`, from `pipeline_layout.chunk_layers`); Megatron's own `layer_number` for other chunks."""
    ids = getattr(chunk, "layer_ids", None)
    if ids is None:
        ids = [layer.layer_number - 1 for layer in chunk.decoder.layers]
    return dict(enumerate(ids))


def named_weights(chunk):
    """`chunk.named_parameters()` as the weight map names them: a `GroupedExperts` stacked tensor as one view per
    local expert, under `SequentialMLP`'s names (`grouped_experts.per_expert_views`)."""
    from rlhf_mcore.models.grouped_experts import per_expert_views

    for name, param in chunk.named_parameters():
        yield from per_expert_views(name, param)


def chunk_param_rule(chunk, name: str, layers: dict, shape: ModelShape, role: str, expert_offset: int = 0
                     ) -> WeightRule:
    """`rule_for_param` for a parameter of `chunk`; a LLaVA chunk's (`hf_layout` set) text rules carry the
    checkpoint's text prefix, and its tower and projector have rules of their own (`vision.weights`)."""
    names = getattr(chunk, "hf_layout", None)
    if names is None:
        return rule_for_param(name, layers, shape, role, expert_offset)
    from rlhf_mcore.models.vision.weights import text_rule, vision_rule

    if name.startswith(("vision_model.", "vision_projection.")):
        return vision_rule(name, names)
    return text_rule(rule_for_param(name, layers, shape, role, expert_offset), names)


def load_hf_weights(model_chunks, hf_dir, state, *, read_log: ReadLog | None = None) -> ReadLog:
    """Fill every parameter of this rank's chunks from the HF checkpoint in `hf_dir`; returns the ReadLog.

    Raises if the checkpoint lacks a tensor a parameter needs (the critic's value head is optional: absent,
    it keeps its initialisation) or a slice's shape disagrees with the parameter.
    """
    log = read_log if read_log is not None else ReadLog()
    ckpt = SafetensorsCheckpoint(hf_dir, log)
    tp, tp_rank = state.dims.tp, state.tp_rank
    try:
        for chunk in map(unwrap_model, model_chunks):
            shape: ModelShape = getattr(chunk, "hf_shape", None) or ModelShape.from_hf_dir(hf_dir)
            role = getattr(chunk, "model_role", "actor")
            layers = layer_numbers(chunk)
            first_expert = expert_offset(shape, getattr(state, "ep_rank", 0), getattr(state.dims, "ep", 1))
            mapped: set[str] = set()  # the checkpoint tensors this chunk's parameters are made of, on any TP rank
            for name, param in named_weights(chunk):
                rule = chunk_param_rule(chunk, name, layers, shape, role, first_expert)
                mapped.update(rule.hf_names)
                if rule.optional and not all(n in ckpt for n in rule.hf_names):
                    continue
                shard = read_shard(ckpt.read, rule, param.shape, tp, tp_rank, rule_shape(rule, shape), param.dtype)
                if shard.shape != param.shape:
                    raise ModelFileError(f"{name}: assembled {tuple(shard.shape)} from {rule.hf_names} but the "
                                     f"parameter is {tuple(param.shape)}; does config.json match the weights?")
                with torch.no_grad():
                    param.copy_(shard)
            unmapped = unmapped_layer_tensors(ckpt.weight_map, mapped, chunk, layers, getattr(state.dims, "ep", 1))
            if unmapped:
                raise ModelFileError(
                    f"{hf_dir}: {len(unmapped)} tensor(s) of the layers this rank loads belong to no parameter, e.g. "
                    f"{unmapped[:3]}: config.json ({shape.architecture}) does not describe these weights, and the "
                    "model would run without them. Check config.json's architectures / model_type against the "
                    "checkpoint, or give the checkpoint of a supported architecture.")
    finally:
        ckpt.close()
    return log


# tensors a checkpoint may hold that no parameter is made of: old transformers saved RoPE's frequencies
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def unmapped_layer_tensors(checkpoint_names, mapped: set, chunk, layers: dict, ep: int = 1) -> list[str]:
    """Checkpoint tensors of the text layers `chunk` holds that no parameter's rule names (`mapped`: the rules'
    `hf_names`, whichever TP rank reads which rows): a q/k norm, a bias or a quantization scale that config.json
    does not announce would otherwise be dropped without a word. Only this rank's layers are checked (a pipeline
    stage maps no other layer), and with expert parallelism (`ep` > 1) not the experts (each rank maps its own)."""
    names = getattr(chunk, "hf_layout", None)
    prefix = (names.text if names is not None else "model.") + "layers."
    held = {str(g) for g in layers.values()}
    unmapped = []
    for name in checkpoint_names:
        if not name.startswith(prefix) or name in mapped or name.endswith(IGNORED_SUFFIXES):
            continue
        if name[len(prefix):].split(".", 1)[0] in held and not (ep > 1 and ".experts." in name):
            unmapped.append(name)
    return sorted(unmapped)
