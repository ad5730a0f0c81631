"""Megatron shards -> full Hugging Face tensors (a streaming collective), and HF checkpoint directories.

`export_hf_weights(chunks, state)` yields `(hf_name, full_tensor)` for the whole model, in HF's order, the same
on every rank of a model replica, whatever the TP/PP/VPP layout:

1. a plan — which PP stage owns which parameter and the full shape — is agreed once over the PP group
   (`all_gather_object`; cached on the chunks, since a model's structure never changes);
2. for each parameter: the owning stage's TP ranks all-gather their shards and join them (fused QKV and the
   [gate; up] fc1 in their full layouts); a routed expert's EP rank broadcasts it over the EP group (MoE with
   expert parallelism); the owner then broadcasts the full tensor over the PP group;
3. the full tensor is split into HF tensors: QKV per query group back into q/k/v, fc1 into gate/up,
   vocabulary padding removed. The tied output layer is skipped: HF stores the embedding once.

About one full tensor (plus its TP shards) is alive at a time. Yielded tensors may alias live parameters
(TP=PP=1): copy them if you keep them past the next optimizer step. Only the ranks of one model replica talk
to each other, so each data-parallel replica can export on its own (or skip exporting).

`save_hf_checkpoint` streams the export into safetensors shards written by rank 0, with the index, config and
the source directory's tokenizer / chat-template / generation files, so `transformers` loads the result.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from rlhf_mcore.models.hf_config import (
    CAUSAL_LM_ARCHITECTURE,
    SEQUENCE_CLASSIFICATION_ARCHITECTURE,
    TOKEN_CLASSIFICATION_ARCHITECTURE,
)
from rlhf_mcore.models.hf_loader import INDEX_FILE, chunk_param_rule, layer_numbers, named_weights, unwrap_model
from rlhf_mcore.models.lora import merged_weight
from rlhf_mcore.models.moe import expert_offset
from rlhf_mcore.models.weight_map import (
    WeightRule,
    full_shape,
    join_tp_shards,
    rule_shape,
    split_to_hf,
)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")


def _ep(state) -> tuple[int, int]:
    """(expert parallel size, this rank's EP rank); (1, 0) without EP."""
    return getattr(state.dims, "ep", 1), getattr(state, "ep_rank", 0)


def _local_params(chunks, state) -> dict:
    """key -> (rule, param) for every parameter this rank holds."""
    out = {}
    ep, ep_rank = _ep(state)
    for chunk in chunks:
        layers = layer_numbers(chunk)
        first_expert = expert_offset(chunk.hf_shape, ep_rank, ep)
        for name, param in named_weights(chunk):
            if ".lora." in name:  # LoRA adapters: folded into their base weight (lora.merged_weight)
                continue
            rule = chunk_param_rule(chunk, name, layers, chunk.hf_shape, chunk.model_role, first_expert)
            out[rule.key] = (rule, param)
    return out


def _export_plan(chunks, local: dict, state) -> list:
    """[(rule, owner_pp_rank, owner_ep_rank, full_shape, dtype)] for every exported parameter, in HF order (same on
    all ranks). owner_ep_rank is None for what every EP rank holds (all but the routed experts)."""
    ep, ep_rank = _ep(state)
    layout = (state.dims.tp, state.dims.pp, ep)
    cached = getattr(chunks[0], "_hf_export_plan", None)
    if cached is not None and cached[0] == layout:
        return cached[1]
    mine = [(rule, None if ep == 1 or not rule.expert else ep_rank, tuple(full_shape(rule, p.shape, state.dims.tp)),
             str(p.dtype).removeprefix("torch.")) for rule, p in local.values() if rule.exported]
    if ep > 1:  # this stage's experts are spread over the EP group: every EP rank lists them all
        experts = [None] * ep
        dist.all_gather_object(experts, [e for e in mine if e[1] is not None], group=state.ep_group)
        mine = [e for e in mine if e[1] is None] + [e for part in experts for e in part]
    if state.dims.pp > 1:
        stages = [None] * state.dims.pp
        dist.all_gather_object(stages, mine, group=state.pp_group)
    else:
        stages = [mine]
    plan = []
    for owner, entries in enumerate(stages):
        plan += [(rule, owner, owner_ep, shp, getattr(torch, dt)) for rule, owner_ep, shp, dt in entries]
    plan.sort(key=lambda item: item[0].order)
    keys = [item[0].key for item in plan]
    if len(keys) != len(set(keys)):
        raise RuntimeError("two pipeline stages hold the same parameter; is the layout consistent on all ranks?")
    chunks[0]._hf_export_plan = (layout, plan)
    return plan


def _gather_tp(rule: WeightRule, param: torch.Tensor, state) -> torch.Tensor:
    data = merged_weight(param)  # a LoRA-adapted linear's W + (alpha / r) B @ A, else the parameter
    if state.dims.tp == 1 or rule.kind == "replicated":
        return data
    data = data.contiguous()
    parts = [torch.empty_like(data) for _ in range(state.dims.tp)]
    dist.all_gather(parts, data, group=state.tp_group)  # expert TP = TP: an expert's shards are on the TP group
    return join_tp_shards(parts, rule)


def export_hf_weights(model_chunks, state, *, dtype: Optional[torch.dtype] = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for the whole model on every rank of this model replica (a collective:
    all TP×PP ranks of the replica, and with expert parallelism the EP group's ranks, must iterate it to the end).
    dtype: cast to it (default: parameter dtype)."""
    chunks = [unwrap_model(c) for c in model_chunks]
    shape = chunks[0].hf_shape
    local = _local_params(chunks, state)
    plan = _export_plan(chunks, local, state)
    pp_ranks = dist.get_process_group_ranks(state.pp_group) if state.dims.pp > 1 else None
    ep_ranks = dist.get_process_group_ranks(state.ep_group) if _ep(state)[0] > 1 else None
    for rule, owner, owner_ep, shp, param_dtype in plan:
        held = owner == state.pp_rank and owner_ep in (None, _ep(state)[1])
        if held:
            full = _gather_tp(rule, local[rule.key][1], state)
        else:
            full = torch.empty(shp, dtype=param_dtype, device=state.device)
        if owner_ep is not None and owner == state.pp_rank:  # the expert's EP rank sends it to the others
            if held:
                full = full.contiguous()
            dist.broadcast(full, src=ep_ranks[owner_ep], group=state.ep_group)
        if pp_ranks is not None:
            if owner == state.pp_rank:
                full = full.contiguous()
            dist.broadcast(full, src=pp_ranks[owner], group=state.pp_group)
        for name, tensor in split_to_hf(full, rule, rule_shape(rule, shape)):
            yield name, tensor if dtype is None else tensor.to(dtype)
    if getattr(chunks[0], "hf_layout", None) is not None:  # a LLaVA tower's tensors that no parameter holds
        for name, tensor in _passthrough_tensors(chunks[0]):
            yield name, tensor.to(dtype or plan[0][4])  # in the parameters' dtype, as the rest


def _passthrough_tensors(chunk) -> Iterator[tuple[str, torch.Tensor]]:
    """The source checkpoint's tensors that LLaVA's forward never reads (`vision.weights.passthrough_names`), as
    they are there: no gradient reaches them, so they cannot have changed. None when the source directory holds no
    weights (a Megatron checkpoint's `hf_meta/`): the export then lacks them (transformers initialises them afresh,
    which changes no output)."""
    from rlhf_mcore.models.hf_loader import SafetensorsCheckpoint
    from rlhf_mcore.models.safetensors_check import model_weight_files
    from rlhf_mcore.models.vision.weights import passthrough_names

    if not model_weight_files(Path(chunk.hf_dir)):
        return
    ckpt = SafetensorsCheckpoint(chunk.hf_dir)
    try:
        for name in passthrough_names(chunk.hf_shape.vision, chunk.hf_layout, ckpt.weight_map):
            yield name, ckpt.read(name, (slice(None),))
    finally:
        ckpt.close()


def _hf_config_for_export(src_hf_dir, shape, role: str, dtype: torch.dtype) -> dict:
    src = Path(src_hf_dir) / "config.json"
    cfg = json.loads(src.read_text()) if src.is_file() else {}
    if role in ("critic", "reward"):
        # transformers has no LLaVA with a value head: a LLaVA critic's directory stays a LlavaForConditionalGeneration
        # (transformers loads the trunk and the LM head), its `score.*` beside the LM head, which
        # `build_model(..., role="critic")` reads back. A text model's head name there made a config neither side
        # could load (model_type "llava" with architectures Qwen2ForTokenClassification).
        if shape.vision is None:
            heads = TOKEN_CLASSIFICATION_ARCHITECTURE if role == "critic" else SEQUENCE_CLASSIFICATION_ARCHITECTURE
            cfg["architectures"] = [heads[shape.family]]
            cfg["num_labels"] = 1
            cfg["id2label"], cfg["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    elif shape.vision is None and cfg.get("architectures", [None])[0] not in CAUSAL_LM_ARCHITECTURE.values():
        cfg["architectures"] = [CAUSAL_LM_ARCHITECTURE[shape.family]]
    name = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    cfg["dtype" if "dtype" in cfg or "torch_dtype" not in cfg else "torch_dtype"] = name
    return cfg


def _copy_side_files(src: Path, out: Path) -> None:
    """Tokenizer, chat template, generation config...: every non-weight file of the source directory."""
    if not src.is_dir() or src.resolve() == out.resolve():
        return
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name in ("config.json", INDEX_FILE) or f.name.endswith(WEIGHT_SUFFIXES):
            continue
        if f.name.endswith(".index.json"):
            continue
        shutil.copy2(f, out / f.name)


def save_hf_checkpoint(model_chunks, state, out_dir, src_hf_dir, *, dtype: Optional[torch.dtype] = None,
                       max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Write an HF model directory from Megatron chunks (a collective over the model-parallel ranks of the
    first data-parallel replica; rank 0 writes). Shards `model-0000i-of-0000N.safetensors` + index, config
    (from `src_hf_dir`, dtype updated; a critic becomes `*ForTokenClassification` with num_labels=1, a reward model
    `*ForSequenceClassification` with num_labels=1; a LLaVA critic stays a LLaVA with `score.*` beside its LM head)
    and the
    source's tokenizer / chat template / generation config. dtype: default the parameters' dtype."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    chunks = [unwrap_model(c) for c in model_chunks]
    shape, role = chunks[0].hf_shape, chunks[0].model_role
    writer = state.rank == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        for stale in list(out.glob("model*.safetensors")) + [out / INDEX_FILE]:
            stale.unlink(missing_ok=True)
    shards, current, current_bytes, total_bytes, written_dtype = [], {}, 0, 0, dtype

    def flush():
        nonlocal current, current_bytes
        if current:
            path = out / f"shard-{len(shards):05d}.tmp.safetensors"
            save_file(current, str(path), metadata={"format": "pt"})
            shards.append((path, list(current)))
            current, current_bytes = {}, 0

    # other replicas hold the same weights: they need not export (with EP, the first EP group's ranks hold them)
    if state.dp_rank < _ep(state)[0]:
        for name, tensor in export_hf_weights(chunks, state, dtype=dtype):
            if not writer:
                continue
            written_dtype = tensor.dtype
            nbytes = tensor.numel() * tensor.element_size()
            if current and current_bytes + nbytes > max_shard_bytes:
                flush()
            current[name] = tensor.detach().to("cpu", copy=True).contiguous()
            current_bytes += nbytes
            total_bytes += nbytes
    if writer:
        flush()
        weight_map = {}
        for i, (path, names) in enumerate(shards):
            final = out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            path.rename(final)
            weight_map.update({n: final.name for n in names})
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total_bytes},
                                                  "weight_map": weight_map}, indent=2) + "\n")
        src = Path(src_hf_dir)
        _copy_side_files(src, out)
        cfg = _hf_config_for_export(src, shape, role, written_dtype)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier(group=state.world_group)
    return out
