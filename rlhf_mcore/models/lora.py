"""LoRA adapters on Megatron's column- and row-parallel linears, in PEFT's layout and numerics.

Each adapted Hugging Face module (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) gets PEFT's pair
`lora_A` (r, in) and `lora_B` (out, r); the layer's output gains `(alpha / r) * x @ A^T @ B^T` (no dropout). The
Megatron layers fuse some of them, and the adapters follow the base weight's sharding:

- `linear_qkv` (column-parallel, fused q/k/v per query group) and `linear_fc1` (column-parallel, [gate; up]):
  A replicated over TP, B split along its rows as the base weight's rows are; the low-rank outputs of q, k and v
  are interleaved per query group (gate and up concatenated) exactly as the fused weight's rows are;
- `linear_proj` (o_proj) and `linear_fc2` (down_proj), row-parallel: A split along its columns as the base
  weight's input, B replicated; the rank-r partial products are summed over TP before B.

The adapters live in an :class:`LoraAdapters` child (`<linear>.lora`); the linear's `_forward_impl` becomes
`lora_linear.lora_impl`: the base GEMM plus the low-rank term as two more GEMMs (the parts' A stacked, one
block-structured B with the scale folded in, added into the base's output in place), one autograd function with
no activation-sized element-wise pass. Every other Megatron linear of the model (the LM head included) gets
`lora_linear.frozen_impl`: its input gradient is one GEMM over all tokens. Everything else is frozen
(`requires_grad=False`: Megatron's DDP gives it no gradient buffer and the optimizer no master copy or state),
except a critic's value head, which trains (PEFT's `modules_to_save`).
:func:`adapters_disabled` switches every adapter off (the reference policy is the base model).

Export: :func:`merged_weight` (`W + (alpha / r) * B @ A` of a local shard, what the weight sync sends),
:func:`adapter_tensors` (full PEFT-named tensors on every rank of a replica), :func:`save_peft_adapter` /
:func:`read_peft_adapter` (`adapter_config.json` + `adapter_model.safetensors`, written with safetensors and json:
peft is not needed at run time), :func:`trainable_sharded_state_dict` (the adapters only, as Megatron
`ShardedTensor`s, so checkpoints hold adapters and their optimizer state and reshard like the rest).
The adapter-only weight sync is `rlhf_mcore.sync.lora`.
"""
from __future__ import annotations

import hashlib
import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from rlhf_mcore.config.shared import LORA_TARGETS
from rlhf_mcore.models.hf_config import ModelShape
from rlhf_mcore.models.lora_linear import frozen_impl, lora_impl

TARGETS = LORA_TARGETS  # the HF module names LoRA may target, in export order
ALL_LINEAR = "all-linear"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

# Megatron linear (under decoder.layers.N.) -> (kind, the HF modules it fuses, each with its HF parent)
_LINEARS = {
    "self_attention.linear_qkv": ("qkv", (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"))),
    "self_attention.linear_proj": ("row", (("self_attn", "o_proj"),)),
    "mlp.linear_fc1": ("fc1", (("mlp", "gate_proj"), ("mlp", "up_proj"))),
    "mlp.linear_fc2": ("row", (("mlp", "down_proj"),)),
}


class LoraError(ValueError):
    """A LoRA setting or adapter file that cannot be used (names the key or file and the fix)."""


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt: `rank` r, `alpha` (scale alpha / r), the HF module names, and a PEFT adapter to start from."""

    rank: int
    alpha: float
    targets: tuple = TARGETS
    adapter_path: Optional[str] = None
    key: str = "actor_rollout_ref.model"  # the config section, for error messages

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @staticmethod
    def from_config(model_cfg, key: str = "actor_rollout_ref.model") -> Optional["LoraSpec"]:
        """From a model section with veRL's `lora_rank` (0: None, LoRA off), `lora_alpha`, `target_modules`,
        `lora_adapter_path`."""
        rank = int(getattr(model_cfg, "lora_rank", 0) or 0)
        if rank <= 0:
            return None
        return LoraSpec(rank, float(model_cfg.lora_alpha), resolve_targets(model_cfg.target_modules, key),
                        getattr(model_cfg, "lora_adapter_path", None) or None, key)


def resolve_targets(value, key: str = "actor_rollout_ref.model") -> tuple:
    """`all-linear`, one module name or a list of them -> the HF module names, in TARGETS order."""
    names = [value] if isinstance(value, str) else list(value)
    if names == [ALL_LINEAR]:
        return TARGETS
    bad = [n for n in names if n not in TARGETS]
    if bad or not names:
        raise LoraError(f"config key '{key}.target_modules' has value {value!r}; it must be {ALL_LINEAR!r} or a "
                        f"non-empty list of {', '.join(TARGETS)}.")
    return tuple(t for t in TARGETS if t in names)


def valid_targets(value) -> bool:
    try:
        resolve_targets(value)
    except (LoraError, TypeError):
        return False
    return True


class LoraAdapters(torch.nn.Module):
    """The adapters of one Megatron linear: `A[t]` (r, in_local or in), `B[t]` (out_t_local or out, r) for each
    adapted HF module t; `forward(x)` is the low-rank term of the linear's (local) output."""

    def __init__(self, kind: str, targets: dict, rank: int, scale: float, tp_group, tp: int, shape: ModelShape,
                 dtype: torch.dtype, device):
        super().__init__()
        self.kind, self.rank, self.scale, self.tp_group, self.tp = kind, rank, scale, tp_group, tp
        self.groups_local = shape.num_kv_heads // tp if kind == "qkv" else 0
        self.shape = shape
        self.widths = {t: w for t, (_, w, _) in targets.items()}  # local output width of each fused part
        self.A = torch.nn.ParameterDict()
        self.B = torch.nn.ParameterDict()
        for t, (in_local, out_local, adapted) in targets.items():
            if not adapted:
                continue  # a fused part that is not adapted: zero rows in the fused output
            self.A[t] = torch.nn.Parameter(torch.zeros(rank, in_local, dtype=dtype, device=device))
            self.B[t] = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=dtype, device=device))
        self.enabled = True

    @property
    def row_parallel(self) -> bool:
        return self.kind == "row"

    def stacked(self, dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, Bs) of the whole fused linear, built from the parameters (autograd flows back to them):
        `A` (R, in_local) the adapted parts' A stacked (R = the sum of their ranks) and `Bs` (out_local, R) the
        block-structured `scale * B`: part t's B in its rows of the fused weight (q/k/v interleaved per query
        group, gate then up; a part that is not adapted: zero rows) and in its A's columns, zero elsewhere. So
        `(x A^T) Bs^T` is the fused layer's low-rank term (one GEMM each side) and `Bs A` its weight change.
        Weight-sized work only, once per forward."""
        names = list(self.A)
        a = self.A[names[0]] if len(names) == 1 else torch.cat([self.A[t] for t in names])
        if self.kind == "row":
            bd = self.B[names[0]]
        else:
            like = self.B[names[0]]
            blocks = [self.B[t] if t in self.B else like.new_zeros(self.widths[t], 0) for t in self.widths]
            bd = torch.block_diag(*blocks)  # rows [part 1; part 2; ...], columns [rank 1 | rank 2 | ...]
            if self.kind == "qkv":
                g, r = self.groups_local, bd.shape[1]
                q, k, v = bd.split([self.widths[t] for t in ("q_proj", "k_proj", "v_proj")])
                bd = torch.cat([q.view(g, -1, r), k.view(g, -1, r), v.view(g, -1, r)], dim=1).view(-1, r)
        bs = bd * self.scale
        if dtype is not None and dtype != a.dtype:
            a, bs = a.to(dtype), bs.to(dtype)
        return a, bs

    def delta_weight(self) -> torch.Tensor:
        """`scale * B @ A` of every part, fused: (out_local, in_local), the shard of the merged weight's change."""
        a, bs = self.stacked()
        return bs @ a


def _part_shapes(kind: str, parts, shape: ModelShape, tp: int, targets: Sequence[str]) -> dict:
    """t -> (A's in width, B's out width, whether t is adapted) on one TP rank."""
    h, hd, ffn = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    full_out = {"q_proj": shape.num_attention_heads * hd, "k_proj": shape.num_kv_heads * hd,
                "v_proj": shape.num_kv_heads * hd, "o_proj": h, "gate_proj": ffn, "up_proj": ffn, "down_proj": h}
    full_in = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": shape.num_attention_heads * hd, "gate_proj": h,
               "up_proj": h, "down_proj": ffn}
    out = {}
    for _, t in parts:
        if kind == "row":
            out[t] = (full_in[t] // tp, full_out[t], t in targets)
        else:
            out[t] = (full_in[t], full_out[t] // tp, t in targets)
    return out


def _check_layout(shape: ModelShape, tp: int, targets: Sequence[str], key: str) -> None:
    qkv = {"q_proj", "k_proj", "v_proj"} & set(targets)
    if tp > 1 and qkv and shape.num_kv_heads % tp:
        raise LoraError(f"LoRA on {sorted(qkv)} at tensor_model_parallel_size={tp} needs the {shape.num_kv_heads} "
                        f"key/value heads to divide over the TP ranks: use a TP size dividing {shape.num_kv_heads} "
                        f"or leave q/k/v out of {key}.target_modules.")


def apply_lora(chunks: list, spec: LoraSpec, state, *, seed: int = 0) -> int:
    """Add adapters to every targeted linear of `chunks` (already holding the base weights) and freeze the rest.

    A starts as PEFT's (`kaiming_uniform_(a=sqrt(5))` of the full matrix, from a generator seeded by `seed`, the
    layer and the module, so every TP/PP layout starts alike), B at zero: the first forward is the base model's.
    `spec.adapter_path`: a PEFT adapter directory whose weights replace that start. Returns the adapters added.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        set_tensor_model_parallel_attributes,
    )

    tp = state.dims.tp
    shape = chunks[0].hf_shape
    _check_layout(shape, tp, spec.targets, spec.key)
    added = 0
    for chunk in chunks:
        if getattr(chunk.config, "sequence_parallel", False):
            raise LoraError("LoRA adapters do not support sequence_parallel=True: turn it off "
                            "(actor_rollout_ref.actor.megatron.sequence_parallel=false).")
        chunk.requires_grad_(False)
        if chunk.model_role == "critic" and getattr(chunk, "output_layer", None) is not None and chunk.post_process:
            chunk.output_layer.requires_grad_(True)  # the value head trains in full (PEFT's modules_to_save)
        for local, layer in enumerate(chunk.decoder.layers):
            g = chunk.layer_ids[local]
            for path, (kind, parts) in _LINEARS.items():
                if not any(t in spec.targets for _, t in parts):
                    continue
                linear = _submodule(layer, path)
                if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
                    raise LoraError(f"LoRA needs Megatron's local layer spec (ColumnParallelLinear / "
                                    f"RowParallelLinear); {path} is a {type(linear).__name__} (Transformer Engine's "
                                    "fused layer-norm linears and MoE experts are not supported): build without "
                                    "Transformer Engine, on a dense model.")
                weight = linear.weight
                lora = LoraAdapters(kind, _part_shapes(kind, parts, shape, tp, spec.targets), spec.rank, spec.scale,
                                    linear.tp_group, tp, shape, weight.dtype, weight.device)
                for t in lora.A:
                    split_a = kind == "row"
                    a_full = torch.empty(spec.rank, lora.A[t].shape[1] * (tp if split_a else 1))
                    gen = torch.Generator().manual_seed(_init_seed(seed, g, t))
                    _kaiming_uniform(a_full, gen)
                    lora.A[t].data.copy_(_shard(a_full, 1, state.tp_rank, tp) if split_a else a_full)
                    split = lora.A[t] if kind == "row" else lora.B[t]
                    set_tensor_model_parallel_attributes(split, True, 1 if kind == "row" else 0, 1)
                    added += 1
                linear.lora = lora
                weight.lora_owner = linear  # read by merged_weight
    for chunk in chunks:
        chunk.lora_spec = spec
        for mod in chunk.modules():  # every frozen linear's GEMMs (the LM head's included): lora_linear.py
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                mod._forward_impl = lora_impl(mod) if isinstance(getattr(mod, "lora", None), LoraAdapters) \
                    else frozen_impl(mod)
    if spec.adapter_path:
        tensors, _ = read_peft_adapter(spec.adapter_path, spec)
        load_adapter_tensors(chunks, tensors, state)
    return added


def _init_seed(seed: int, layer: int, target: str) -> int:
    return (seed * 1_000_003 + layer * 101 + TARGETS.index(target)) % (2**63)


def _kaiming_uniform(t: torch.Tensor, gen: torch.Generator) -> None:
    """torch.nn.init.kaiming_uniform_(t, a=sqrt(5)) (PEFT's init of lora_A) from `gen`: U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / math.sqrt(t.shape[1])
    t.uniform_(-bound, bound, generator=gen)


def _shard(full: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    return full.chunk(tp, dim=dim)[rank] if tp > 1 else full


# ------------------------------------------------------------------------------------------------ views
def adapter_modules(chunks) -> Iterator[tuple[int, str, LoraAdapters]]:
    """(global layer, Megatron linear path, adapters) of every adapted linear of `chunks` (DDP-wrapped or not)."""
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)
        decoder = getattr(chunk, "decoder", None)
        for local, layer in enumerate(decoder.layers if decoder is not None else []):
            for path in _LINEARS:
                lora = getattr(_submodule(layer, path), "lora", None)  # MoE layers have no linear_fc1 / fc2
                if lora is not None:
                    yield chunk.layer_ids[local], path, lora


def _submodule(module, path: str):
    for part in path.split("."):
        module = getattr(module, part, None)
    return module


def has_lora(chunks) -> bool:
    return next(adapter_modules(chunks), None) is not None


@contextmanager
def adapters_disabled(chunks):
    """Within the block every adapter is off: the model is the frozen base (the reference policy)."""
    mods = [lora for _, _, lora in adapter_modules(chunks)]
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.enabled = True


def merged_weight(param: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard for export: `W + (alpha / r) * B @ A` for an adapted linear's weight (a new
    tensor), else the parameter itself (detached)."""
    owner = getattr(param, "lora_owner", None)
    if owner is None or not owner.lora.enabled:
        return param.detach()
    with torch.no_grad():
        return param.detach() + owner.lora.delta_weight().to(param.dtype)


def peft_name(layer: int, target: str, which: str) -> str:
    """PEFT's tensor name in adapter_model.safetensors (Qwen2 / Qwen3 / Llama: model.layers.N.<parent>.<t>)."""
    parent = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"{PEFT_PREFIX}model.layers.{layer}.{parent}.{target}.lora_{which}.weight"


def _split_dim(lora: LoraAdapters, which: str) -> Optional[int]:
    """The TP-split dimension of A or B (None: replicated)."""
    if lora.tp == 1:
        return None
    if lora.row_parallel:
        return 1 if which == "A" else None
    return 0 if which == "B" else None


def _local_adapters(chunks) -> Iterator[tuple[str, torch.nn.Parameter, Optional[int]]]:
    for g, _, lora in adapter_modules(chunks):
        for t in lora.A:
            for which, store in (("A", lora.A), ("B", lora.B)):
                yield peft_name(g, t, which), store[t], _split_dim(lora, which)


def adapter_tensors(chunks, state) -> dict[str, torch.Tensor]:
    """Every adapter as a full PEFT-named tensor (CPU), on every rank of this model replica (a collective over
    its TP and PP groups)."""
    mine = {}
    for name, p, dim in _local_adapters(chunks):
        data = p.detach().contiguous()
        if dim is not None:
            parts = [torch.empty_like(data) for _ in range(state.dims.tp)]
            dist.all_gather(parts, data, group=state.tp_group)
            data = torch.cat(parts, dim=dim)
        mine[name] = data.to("cpu", copy=True)
    if state.dims.pp > 1:
        stages = [None] * state.dims.pp
        dist.all_gather_object(stages, mine, group=state.pp_group)
        mine = {k: v for stage in stages for k, v in stage.items()}
    return dict(sorted(mine.items(), key=lambda kv: _name_order(kv[0])))


def _name_order(name: str) -> tuple:
    parts = name.split(".")
    layer = int(parts[parts.index("layers") + 1])
    return layer, TARGETS.index(parts[-3]), parts[-2]


def load_adapter_tensors(chunks, tensors: dict, state) -> None:
    """Copy full PEFT-named adapter tensors into this rank's shards (every adapter of the model must be there)."""
    missing = []
    for name, p, dim in _local_adapters(chunks):
        if name not in tensors:
            missing.append(name)
            continue
        full = tensors[name]
        local = _shard(full, dim, state.tp_rank, state.dims.tp) if dim is not None else full
        if tuple(local.shape) != tuple(p.shape):
            raise LoraError(f"adapter tensor {name} has shape {tuple(full.shape)}, this model needs "
                            f"{tuple(p.shape)} per TP rank (TP={state.dims.tp}): was it made for another model or "
                            "rank?")
        with torch.no_grad():
            p.copy_(local.to(p.dtype))
    if missing:
        raise LoraError(f"the adapter lacks {len(missing)} tensors this model's LoRA needs (first: {missing[0]}): "
                        "its target_modules must match the config's.")


# ------------------------------------------------------------------------------------------------ PEFT files
def base_hash(hf_dir) -> str:
    """sha256 over the base model's config.json and safetensors file names and sizes (a cheap identity: a LoRA
    checkpoint or adapter is only meaningful on the base it was trained from)."""
    root = Path(hf_dir)
    h = hashlib.sha256()
    for f in sorted(root.glob("*.safetensors")) + [root / "config.json"]:
        if f.is_file():
            h.update(f.name.encode())
            h.update(str(f.stat().st_size).encode())
    if (root / "config.json").is_file():
        h.update((root / "config.json").read_bytes())
    return h.hexdigest()


def peft_config(spec: LoraSpec, base_path: str) -> dict:
    """adapter_config.json as peft (0.13+) writes it for a causal LM."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_path),
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": 0.0, "target_modules": list(spec.targets),
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "use_rslora": False, "use_dora": False, "rank_pattern": {},
            "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None, "revision": None}


def save_peft_adapter(chunks, state, out_dir, spec: LoraSpec, base_path: str) -> Path:
    """Write `out_dir/adapter_config.json` + `adapter_model.safetensors` (rank 0; a collective over the
    replica) that `peft.PeftModel.from_pretrained(base, out_dir)` loads."""
    from safetensors.torch import save_file

    if any(getattr(getattr(c, "module", c), "model_role", "actor") != "actor" for c in chunks):
        raise LoraError("a PEFT adapter directory is written for the actor (a causal LM); a critic's LoRA "
                        "exports merged (save_hf) only.")
    tensors = adapter_tensors(chunks, state) if state.dp_rank == 0 else {}
    out = Path(out_dir)
    if state.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        (out / ADAPTER_CONFIG).write_text(json.dumps(peft_config(spec, base_path), indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier(group=state.world_group)
    return out


def read_peft_adapter(path, spec: Optional[LoraSpec] = None) -> tuple[dict, dict]:
    """(tensors by PEFT name, adapter_config) of a PEFT LoRA directory, checked against `spec` (rank, alpha,
    targets) when given."""
    from safetensors.torch import load_file

    root = Path(path)
    key = f"{spec.key}.lora_adapter_path" if spec else "lora_adapter_path"
    if not (root / ADAPTER_CONFIG).is_file() or not (root / ADAPTER_WEIGHTS).is_file():
        raise LoraError(f"config key '{key}' has value {str(path)!r}; it must be a PEFT adapter directory holding "
                        f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (peft's save_pretrained writes them).")
    config = json.loads((root / ADAPTER_CONFIG).read_text())
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise LoraError(f"{root / ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r} (DoRA / rsLoRA: "
                        f"{config.get('use_dora')}, {config.get('use_rslora')}); only plain LoRA adapters load.")
    tensors = {k.replace(".default.", "."): v for k, v in load_file(str(root / ADAPTER_WEIGHTS)).items()}
    if spec is not None:
        named = config.get("target_modules") or []  # peft writes "all-linear" out as full module paths
        named = [named] if isinstance(named, str) else sorted({n.rsplit(".", 1)[-1] for n in named})
        targets = resolve_targets(named, key)
        got = (int(config.get("r", 0)), float(config.get("lora_alpha", 0)), targets)
        want = (spec.rank, spec.alpha, spec.targets)
        if got != want or config.get("rank_pattern") or config.get("alpha_pattern"):
            raise LoraError(f"{root / ADAPTER_CONFIG} has r={got[0]}, lora_alpha={got[1]:g}, target_modules="
                            f"{list(got[2])}; the config has lora_rank={want[0]}, lora_alpha={want[1]:g}, "
                            f"target_modules={list(want[2])}: set {spec.key}.* to the adapter's values.")
    return tensors, config


# ------------------------------------------------------------------------------------------------ checkpoints
def trainable_sharded_state_dict(chunk, prefix: str = "") -> dict:
    """What trains in a LoRA chunk as Megatron `ShardedTensor`s: the adapters keyed by PEFT name (global shapes:
    any TP/PP layout loads them) and any other trainable parameter (a critic's value head, replicated), holding the
    parameters themselves (the optimizer's state is keyed by them)."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    out = {}
    for name, p, dim in _trainable(chunk):
        key = f"{prefix}{name}"
        out[key] = (make_tp_sharded_tensor_for_checkpoint(p, key, dim) if dim is not None else
                    make_sharded_tensor_for_checkpoint(p, key))
    return out


def load_trainable_state_dict(chunk, loaded: dict, prefix: str = "") -> None:
    """Copy a loaded :func:`trainable_sharded_state_dict` (local shards) into the chunk."""
    for name, p, _ in _trainable(chunk):
        with torch.no_grad():
            p.copy_(loaded[f"{prefix}{name}"])


def _trainable(chunk) -> Iterator[tuple[str, torch.nn.Parameter, Optional[int]]]:
    yield from _local_adapters([chunk])
    for name, p in chunk.named_parameters():
        if p.requires_grad and ".lora." not in name:
            if getattr(p, "tensor_model_parallel", False):
                raise LoraError(f"{name} trains and is split over TP; a LoRA checkpoint holds adapters and "
                                "replicated heads only")
            yield name, p, None
