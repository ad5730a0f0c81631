"""Which HF tensors make each Megatron parameter, and how a TP rank's shard is cut from them.

A Megatron parameter is described by a `WeightRule`: the HF tensor names it is made of and its `kind`:

- "replicated": the same full tensor on every TP rank (norms; the critic's value head);
- "row" / "col": split evenly along dim 0 (ColumnParallelLinear output) / dim 1 (RowParallelLinear input);
- "vocab": split along dim 0 after padding the vocabulary to Megatron's padded size (padded rows are zero);
- "qkv": Megatron's fused QKV — for each of the num_query_groups groups, its heads_per_group query heads, then
  its key head, then its value head (head_dim rows each; the bias likewise) — split along dim 0 into TP
  contiguous chunks (with fewer groups than TP ranks a chunk is part of one group);
- "fc1": the fused SwiGLU input, rank r holding [gate_r; up_r] (its 1/TP of the gate rows, then of the up rows).

MoE layers (`rlhf_mcore.models.moe`): the router is replicated; every routed expert is a SwiGLU MLP ("fc1" / "col"
like a dense one) held whole by one expert-parallel rank, whose local expert i is global expert
`expert_offset + i` (the rule's key names the global one, so keys are layout-independent); Qwen2-MoE's shared expert
is a dense MLP plus its replicated (1, hidden) gate.

Everything here is pure index arithmetic over shapes, shared by the loader (HF -> shard) and the exporter
(gathered full Megatron tensor -> HF tensors). Parameter names are those of Megatron's local spec; the
Transformer Engine spec's fused layer-norm names are mapped onto the same rules.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

import torch

from rlhf_mcore.models.hf_config import ModelShape

KINDS = ("replicated", "row", "col", "vocab", "qkv", "fc1")

# TE spec parameter suffix -> local spec suffix with the same meaning
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}

# Per-layer parameter suffix -> (kind, HF suffixes under model.layers.N.). Order = export order.
_LAYER_RULES = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                               "self_attn.v_proj.bias")),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("col", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("col", ("mlp.down_proj.weight",)),
    "mlp.router.weight": ("replicated", ("mlp.gate.weight",)),
    "mlp.experts.{e}.linear_fc1.weight": ("fc1", ("mlp.experts.{e}.gate_proj.weight",
                                                  "mlp.experts.{e}.up_proj.weight")),
    "mlp.experts.{e}.linear_fc2.weight": ("col", ("mlp.experts.{e}.down_proj.weight",)),
    "mlp.shared_experts.linear_fc1.weight": ("fc1", ("mlp.shared_expert.gate_proj.weight",
                                                     "mlp.shared_expert.up_proj.weight")),
    "mlp.shared_experts.linear_fc2.weight": ("col", ("mlp.shared_expert.down_proj.weight",)),
    "mlp.shared_experts.gate_weight": ("replicated", ("mlp.shared_expert_gate.weight",)),
}
_LAYER_ORDER = {suffix: i for i, suffix in enumerate(_LAYER_RULES)}
_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(?:local_experts\.)?(\d+)\.(.+)$")  # Megatron's local / our global

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"
CRITIC_HEAD = ("score.weight", "score.bias")  # HF *ForTokenClassification's head, num_labels=1


@dataclass(frozen=True)
class WeightRule:
    """How one Megatron parameter (named by a layout-independent `key`) maps to HF tensors."""

    key: str  # "embedding", "layers.{g}.{suffix}", "final_norm", "output_layer.weight", "output_layer.bias"
    kind: str
    hf_names: tuple
    optional: bool = False  # may be absent from an HF checkpoint (the critic head: then it keeps its init)
    exported: bool = True  # False for the tied output layer: HF stores the embedding once
    sort: tuple = ()  # an explicit `order` (a LLaVA tower's and projector's rules: before the text model's)

    @property
    def order(self) -> tuple:
        """Sort key giving HF's tensor order: embedding, layers in order (experts in order), final norm, head."""
        if self.sort:
            return self.sort
        if self.key == "embedding":
            return (0, 0, 0, 0)
        if self.key.startswith("layers."):
            _, g, suffix = self.key.split(".", 2)
            template, expert = _expert_template(suffix)
            return (1, int(g), _LAYER_ORDER[template], expert)
        if self.key == "final_norm":
            return (2, 0, 0, 0)
        return (3, 0, 0 if self.key.endswith("weight") else 1, 0)

    @property
    def expert(self) -> bool:
        """A routed expert's weight: held by one expert-parallel rank, not by all."""
        return ".mlp.experts." in self.key


def _expert_template(suffix: str) -> tuple[str, int]:
    """("mlp.experts.{e}.linear_fc1.weight", e) for an expert's suffix, (suffix, 0) for any other."""
    m = _EXPERT_RE.match(suffix)
    if m is None:
        return suffix, 0
    return f"mlp.experts.{{e}}.{m.group(2)}", int(m.group(1))


def rule_for_param(name: str, layer_numbers: dict, shape: ModelShape, role: str, expert_offset: int = 0
                   ) -> WeightRule:
    """The rule of parameter `name` of a GPTModel chunk. `layer_numbers` maps the chunk's local layer index to
    the global (0-based) layer index; `expert_offset` is the global index of this rank's first expert
    (`moe.expert_offset`)."""
    if name == "embedding.word_embeddings.weight":
        return WeightRule("embedding", "vocab", (EMBED,))
    if name == "decoder.final_layernorm.weight":
        return WeightRule("final_norm", "replicated", (FINAL_NORM,))
    if name in ("output_layer.weight", "output_layer.bias"):
        if role == "reward":  # optional: a causal LM (reward-model training's start) has no score head yet
            if name.endswith("bias"):
                raise ValueError("a reward model's score head has no bias (*ForSequenceClassification)")
            return WeightRule(name, "replicated", (CRITIC_HEAD[0],), optional=True)
        if role == "critic":
            return WeightRule(name, "replicated", (CRITIC_HEAD[0] if name.endswith("weight") else CRITIC_HEAD[1],),
                              optional=True)
        if name.endswith("bias"):
            raise ValueError("GPTModel output layer has a bias; HF causal LMs here have none.")
        if shape.tie_word_embeddings:  # the last PP stage's copy of the embedding
            return WeightRule(name, "vocab", (EMBED,), exported=False)
        return WeightRule(name, "vocab", (LM_HEAD,))
    if name.startswith("decoder.layers."):
        _, _, local, suffix = name.split(".", 3)
        suffix = _TE_ALIASES.get(suffix, suffix)
        template, expert = _expert_template(suffix)
        if template not in _LAYER_RULES:
            raise ValueError(f"no HF mapping for Megatron parameter {name!r} (suffix {suffix!r}); known: "
                             f"{sorted(_LAYER_RULES)}")
        g = layer_numbers[int(local)]
        kind, hf_suffixes = _LAYER_RULES[template]
        e = expert + expert_offset
        return WeightRule(f"layers.{g}.{template.format(e=e)}", kind,
                          tuple(f"model.layers.{g}.{s.format(e=e)}" for s in hf_suffixes))
    raise ValueError(f"no HF mapping for Megatron parameter {name!r}")


def rule_shape(rule: WeightRule, shape: ModelShape):
    """The shape whose layout `rule` follows: the vision tower's (`shape.vision`) for its rules, else `shape`."""
    if rule.key.startswith(("vision.", "projector.")):
        return shape.vision
    return shape


# ---------------------------------------------------------------------------------------------------------
# QKV layout

def qkv_segments(shape: ModelShape, width: int = 1) -> list[tuple[int, int, int, int]]:
    """The fused QKV rows as (hf_index q=0/k=1/v=2, hf_row_start, n_rows, fused_row_start), in fused order.
    `width` scales rows (1 for weights and biases: rows are head_dim-sized blocks)."""
    hd, hpg = shape.head_dim, shape.heads_per_group
    segments, fused = [], 0
    for g in range(shape.num_kv_heads):
        for hf_index, start, n in ((0, g * hpg * hd, hpg * hd), (1, g * hd, hd), (2, g * hd, hd)):
            segments.append((hf_index, start * width, n * width, fused))
            fused += n * width
    return segments


def qkv_rows(shape: ModelShape) -> int:
    return (shape.num_attention_heads + 2 * shape.num_kv_heads) * shape.head_dim


def split_qkv(full: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full fused QKV ((nh + 2 ng) hd, ...) -> q (nh hd, ...), k (ng hd, ...), v (ng hd, ...)."""
    ng, hpg, hd = shape.num_kv_heads, shape.heads_per_group, shape.head_dim
    grouped = full.reshape(ng, hpg + 2, hd, *full.shape[1:])  # (ng, hpg + 2, hd, ...)
    q = grouped[:, :hpg].reshape(ng * hpg * hd, *full.shape[1:])
    k = grouped[:, hpg].reshape(ng * hd, *full.shape[1:])
    v = grouped[:, hpg + 1].reshape(ng * hd, *full.shape[1:])
    return q, k, v


# ---------------------------------------------------------------------------------------------------------
# HF -> one TP rank's shard

def read_shard(read, rule: WeightRule, local_shape: torch.Size, tp: int, rank: int, shape: ModelShape,
               dtype: torch.dtype) -> torch.Tensor:
    """Assemble TP rank `rank`'s shard of `rule` with the shape `local_shape`.

    `read(hf_name, index)` returns `hf_tensor[index]` reading only that slice (index: tuple of slices).
    """
    kind = rule.kind
    if kind == "replicated":
        return read(rule.hf_names[0], (slice(None),)).to(dtype)
    if kind == "row":
        n = local_shape[0]
        return read(rule.hf_names[0], (slice(rank * n, (rank + 1) * n),)).to(dtype)
    if kind == "col":
        n = local_shape[1]
        return read(rule.hf_names[0], (slice(None), slice(rank * n, (rank + 1) * n))).to(dtype)
    if kind == "vocab":
        n = local_shape[0]
        start, stop = rank * n, min((rank + 1) * n, shape.vocab_size)
        out = torch.zeros(local_shape, dtype=dtype)
        if stop > start:
            out[: stop - start] = read(rule.hf_names[0], (slice(start, stop),)).to(dtype)
        return out
    if kind == "fc1":
        n = local_shape[0] // 2
        gate = read(rule.hf_names[0], (slice(rank * n, (rank + 1) * n),))
        up = read(rule.hf_names[1], (slice(rank * n, (rank + 1) * n),))
        return torch.cat([gate, up], dim=0).to(dtype)
    if kind == "qkv":
        n = local_shape[0]
        lo, hi = rank * n, (rank + 1) * n  # this rank's rows of the fused tensor
        out = torch.empty(local_shape, dtype=dtype)
        for hf_index, hf_start, length, fused_start in qkv_segments(shape):
            a, b = max(lo, fused_start), min(hi, fused_start + length)
            if a >= b:
                continue
            src = read(rule.hf_names[hf_index], (slice(hf_start + a - fused_start, hf_start + b - fused_start),))
            out[a - lo: b - lo] = src.to(dtype)
        return out
    raise ValueError(f"unknown weight kind {kind!r}; expected one of {KINDS}")


# ---------------------------------------------------------------------------------------------------------
# TP shards -> full Megatron tensor -> HF tensors

def full_shape(rule: WeightRule, local_shape: torch.Size, tp: int) -> tuple:
    """Shape of the TP-gathered tensor (fc1 as [gate; up] over the whole width)."""
    s = list(local_shape)
    if rule.kind in ("row", "vocab", "qkv", "fc1"):
        s[0] *= tp
    elif rule.kind == "col":
        s[1] *= tp
    return tuple(s)


def join_tp_shards(parts: list, rule: WeightRule) -> torch.Tensor:
    """TP shards (in rank order) -> the full tensor in the layout `split_to_hf` expects."""
    if len(parts) == 1 or rule.kind == "replicated":
        return parts[0]
    if rule.kind == "col":
        return torch.cat(parts, dim=1)
    if rule.kind == "fc1":
        half = parts[0].size(0) // 2
        return torch.cat([p[:half] for p in parts] + [p[half:] for p in parts], dim=0)
    return torch.cat(parts, dim=0)


def split_to_hf(full: torch.Tensor, rule: WeightRule, shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors making up a full (TP-gathered) Megatron tensor."""
    if rule.kind == "vocab":
        yield rule.hf_names[0], full[: shape.vocab_size]
    elif rule.kind == "qkv":
        yield from zip(rule.hf_names, split_qkv(full, shape))
    elif rule.kind == "fc1":
        gate, up = full.chunk(2, dim=0)
        yield rule.hf_names[0], gate
        yield rule.hf_names[1], up
    else:
        yield rule.hf_names[0], full


def hf_layer_names(shape: ModelShape, layer: int) -> list[str]:
    """Every HF tensor name of one decoder layer, as the HF model has them."""
    names = []
    sparse = layer in shape.moe_layers
    for suffix, (_, hf) in _LAYER_RULES.items():
        if suffix.startswith("self_attention.linear_qkv.bias") and not shape.qkv_bias:
            continue
        if "_layernorm.weight" in suffix and suffix.startswith("self_attention.") and not shape.qk_norm:
            continue
        if suffix.startswith("mlp.") and (suffix in _DENSE_MLP) == sparse:
            continue
        if suffix.startswith("mlp.shared_experts.") and not shape.shared_expert_ffn_hidden_size:
            continue
        experts = range(shape.num_experts) if "{e}" in suffix else (0,)
        names.extend(f"model.layers.{layer}.{s.format(e=e)}" for e in experts for s in hf)
    return names


def expected_hf_names(shape: ModelShape, role: str = "actor") -> list[str]:
    """The tensor names an HF checkpoint of this model holds (tied: no lm_head; critic: score head)."""
    names = [EMBED]
    for g in range(shape.num_layers):
        names += hf_layer_names(shape, g)
    names.append(FINAL_NORM)
    if role == "critic":
        names += list(CRITIC_HEAD)
    elif role == "reward":
        names.append(CRITIC_HEAD[0])
    elif not shape.tie_word_embeddings:
        names.append(LM_HEAD)
    return names

