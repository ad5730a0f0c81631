"""Native-engine weights: Hugging Face names in, fused and tensor-parallel-sharded tensors inside.

The engine keeps q/k/v as one fused `qkv` matrix and gate/up as one `gate_up` matrix (one GEMM each), in the
Hugging Face orientation (out_features, in_features). Under tensor parallelism (TP) every rank holds:
  - qkv, gate_up: its slice of output rows (its query heads, its kv heads, its part of the MLP width) —
    column-parallel;
  - o_proj, down_proj: its slice of input columns — row-parallel, summed with an all-reduce;
  - embeddings, norms, lm_head: replicated;
  - MoE layers: every expert on every rank, each split like a dense MLP; the router replicated (`.moe`).
`load` accepts full (unsharded) HF tensors, one at a time, and copies each rank's slice into place, so the
same call serves initial loading from safetensors and `update_weights` from the trainer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from rlhf_mcore.models.hf_config import ModelShape
from rlhf_mcore.models.weight_map import hf_layer_names
from rlhf_mcore.rollout.native.moe import moe_fields, moe_target

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Buffers some checkpoints carry that the engine recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor       # (D,)
    qkv: torch.Tensor              # ((Hq + 2 Hkv) * hd / tp, D)
    qkv_bias: torch.Tensor | None  # ((Hq + 2 Hkv) * hd / tp,)
    q_norm: torch.Tensor | None    # (hd,)
    k_norm: torch.Tensor | None    # (hd,)
    o_proj: torch.Tensor           # (D, Hq * hd / tp)
    post_norm: torch.Tensor        # (D,)
    gate_up: torch.Tensor | None   # (2 * I / tp, D); None in a MoE layer
    down: torch.Tensor | None      # (D, I / tp)
    # a MoE layer (rlhf_mcore.rollout.native.moe): every expert on every rank, its columns split over TP
    router: torch.Tensor | None = None           # (E, D)
    experts_gate_up: torch.Tensor | None = None  # (E, 2 * I_moe / tp, D)
    experts_down: torch.Tensor | None = None     # (E, D, I_moe / tp)
    shared_gate_up: torch.Tensor | None = None   # (2 * I_shared / tp, D)  Qwen2-MoE's shared expert
    shared_down: torch.Tensor | None = None      # (D, I_shared / tp)
    shared_gate: torch.Tensor | None = None      # (1, D)


class ModelWeights:
    """All weights of one TP rank, allocated on `device` in `dtype`."""

    def __init__(self, spec: ModelShape, device, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1):
        if spec.moe_ffn_hidden_size % tp_size or spec.shared_expert_ffn_hidden_size % tp_size:
            raise ValueError(
                f"tensor parallel size {tp_size} must divide moe_intermediate_size={spec.moe_ffn_hidden_size} and "
                f"shared_expert_intermediate_size={spec.shared_expert_ffn_hidden_size}; choose a rollout "
                "tensor_model_parallel_size that divides both.")
        if spec.num_attention_heads % tp_size or spec.num_kv_heads % tp_size or spec.ffn_hidden_size % tp_size:
            raise ValueError(
                f"tensor parallel size {tp_size} must divide num_attention_heads={spec.num_attention_heads}, "
                f"num_key_value_heads={spec.num_kv_heads} and intermediate_size={spec.ffn_hidden_size}; "
                "choose a rollout tensor_model_parallel_size that divides all three.")
        self.spec, self.device, self.dtype = spec, torch.device(device), dtype
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.heads = spec.num_attention_heads // tp_size
        self.kv_heads = spec.num_kv_heads // tp_size
        self.inter = spec.ffn_hidden_size // tp_size
        hd, d = spec.head_dim, spec.hidden_size
        qkv_rows = (self.heads + 2 * self.kv_heads) * hd

        def empty(*shape):
            return torch.empty(*shape, device=device, dtype=dtype)

        self.embed = empty(spec.vocab_size, d)
        self.lm_head = self.embed if spec.tie_word_embeddings else empty(spec.vocab_size, d)
        self.final_norm = empty(d)
        def mlp(i):
            if i in spec.moe_layers:
                return dict(gate_up=None, down=None, **moe_fields(spec, tp_size, empty))
            return dict(gate_up=empty(2 * self.inter, d), down=empty(d, self.inter))

        self.layers = [
            LayerWeights(
                input_norm=empty(d), qkv=empty(qkv_rows, d), qkv_bias=empty(qkv_rows) if spec.qkv_bias else None,
                q_norm=empty(hd) if spec.qk_norm else None, k_norm=empty(hd) if spec.qk_norm else None,
                o_proj=empty(d, self.heads * hd), post_norm=empty(d), **mlp(i),
            )
            for i in range(spec.num_layers)
        ]

    # ----------------------------------------------------------------------------------------------------
    def expected_names(self) -> list[str]:
        """Every HF tensor name a full load must provide."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.spec.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            if i in self.spec.moe_layers:
                names += hf_layer_names(self.spec, i)
                continue
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                      p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight",
                      p + "self_attn.o_proj.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                      p + "mlp.down_proj.weight"]
            if self.spec.qkv_bias:
                names += [p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"]
            if self.spec.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names

    def nbytes(self) -> int:
        seen, total = set(), 0
        for t in self.tensors():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from (self.embed, self.lm_head, self.final_norm)
        for layer in self.layers:
            yield from (t for t in vars(layer).values() if t is not None)

    def to(self, device, non_blocking: bool = False, pin_memory: bool = False) -> "ModelWeights":
        """A copy of all tensors on `device` (used to offload to / restore from CPU)."""
        out = object.__new__(ModelWeights)
        out.__dict__.update(self.__dict__)
        out.device = torch.device(device)

        def move(t):
            if t is None:
                return None
            if pin_memory and out.device.type == "cpu":
                c = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                c.copy_(t, non_blocking=non_blocking)
                return c
            return t.to(device, non_blocking=non_blocking)

        out.embed = move(self.embed)
        out.lm_head = out.embed if self.spec.tie_word_embeddings else move(self.lm_head)
        out.final_norm = move(self.final_norm)
        out.layers = [LayerWeights(**{k: move(v) for k, v in vars(layer).items()}) for layer in self.layers]
        return out

    # ----------------------------------------------------------------------------------------------------
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy full HF-named tensors into this rank's (fused, sharded) storage. Returns the names loaded.

        Raises KeyError for a name the model does not have and ValueError for a wrong shape.
        """
        loaded = set()
        for name, tensor in named_tensors:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            dst, src = self._target(name, tensor)
            if dst is None:  # lm_head of a tied model: the embedding already holds it
                loaded.add(name)
                continue
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"weight {name!r}: got shape {tuple(tensor.shape)}, which gives a TP shard of "
                                 f"{tuple(src.shape)}; this engine expects {tuple(dst.shape)} (rank {self.tp_rank} "
                                 f"of {self.tp_size}). Does the checkpoint match config.json?")
            with torch.no_grad():
                dst.copy_(src, non_blocking=True)
            loaded.add(name)
        return loaded

    def _shard_rows(self, t: torch.Tensor, n_per_rank: int) -> torch.Tensor:
        return t.narrow(0, self.tp_rank * n_per_rank, n_per_rank)

    def _shard_cols(self, t: torch.Tensor, n_per_rank: int) -> torch.Tensor:
        return t.narrow(1, self.tp_rank * n_per_rank, n_per_rank)

    def _target(self, name: str, t: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(destination view, source slice) for one HF tensor."""
        spec, hd = self.spec, self.spec.head_dim
        if name == "model.embed_tokens.weight":
            return self.embed, t
        if name == "lm_head.weight":
            return (None, t) if spec.tie_word_embeddings else (self.lm_head, t)
        if name == "model.norm.weight":
            return self.final_norm, t
        m = _LAYER_RE.match(name)
        if m is None or int(m.group(1)) >= spec.num_layers:
            raise KeyError(f"unexpected weight {name!r} for a {spec.num_layers}-layer {spec.architecture} model; "
                           "the native engine takes Hugging Face parameter names (see ModelWeights.expected_names).")
        layer, rest = self.layers[int(m.group(1))], m.group(2)
        q_rows, kv_rows = self.heads * hd, self.kv_heads * hd
        qkv_slices = {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}
        simple = {"input_layernorm.weight": layer.input_norm, "post_attention_layernorm.weight": layer.post_norm,
                  "self_attn.q_norm.weight": layer.q_norm, "self_attn.k_norm.weight": layer.k_norm}
        if rest in simple and simple[rest] is not None:
            return simple[rest], t
        pm = re.match(r"^self_attn\.([qkv])_proj\.(weight|bias)$", rest)
        if pm and (pm.group(2) == "weight" or layer.qkv_bias is not None):
            start, rows = qkv_slices[pm.group(1)]
            dst = (layer.qkv if pm.group(2) == "weight" else layer.qkv_bias).narrow(0, start, rows)
            return dst, self._shard_rows(t, rows)
        if rest == "self_attn.o_proj.weight":
            return layer.o_proj, self._shard_cols(t, q_rows)
        if layer.router is not None:
            target = moe_target(layer, rest, t, self._shard_rows, self._shard_cols)
            if target is not None:
                return target
            raise KeyError(f"unexpected weight {name!r} for the MoE layer {m.group(1)} of {spec.architecture}.")
        if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            start = 0 if rest.startswith("mlp.gate") else self.inter
            return layer.gate_up.narrow(0, start, self.inter), self._shard_rows(t, self.inter)
        if rest == "mlp.down_proj.weight":
            return layer.down, self._shard_cols(t, self.inter)
        raise KeyError(f"unexpected weight {name!r} for {spec.architecture} "
                       f"(qkv_bias={spec.qkv_bias}, qk_norm={spec.qk_norm}).")


def iter_safetensors(model_dir) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every *.safetensors file of an HF directory, on CPU."""
    from safetensors import safe_open

    from rlhf_mcore.models.safetensors_check import model_weight_files

    files = model_weight_files(model_dir)  # headers checked: a truncated file fails naming itself
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}; the native engine loads safetensors "
                                "checkpoints (convert .bin with transformers' save_pretrained).")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)
