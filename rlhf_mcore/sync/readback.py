"""A rollout engine's weights read back in Hugging Face layout, for verifying a sync.

`engine_hf_shards(engine)` returns, for every HF tensor name the engine holds, a `HeldShard`: the tensor the
engine actually holds for it (a view into its storage, e.g. the q rows of a fused QKV matrix) and which slice
of the full HF tensor that should be (`dim`, `rank`, `size`: an even split along `dim`; `dim=None` for a
replicated tensor).

Supported engines:
  - any engine with a method `hf_weight_shards() -> Iterable[HeldShard-like (name, tensor, dim, rank, size)]`
    (the protocol extension proposed for `RolloutEngine`);
  - the native engine: read from its `ModelWeights`, with the slicing rules written out here independently
    of its loader (column-parallel q/k/v and gate/up rows, row-parallel o_proj/down columns, everything
    else replicated), so a slicing bug in the loader shows up as a verification failure;
  - the Hugging Face engine: its model's parameters (full tensors).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeldShard:
    """The engine's copy of one HF tensor: `tensor` should equal `expected_from(full)`."""

    name: str
    tensor: torch.Tensor
    dim: int | None = None  # None: replicated (the whole tensor)
    rank: int = 0
    size: int = 1

    def expected_from(self, full: torch.Tensor) -> torch.Tensor:
        """This engine's slice of the full HF tensor `full`."""
        if self.dim is None or self.size == 1:
            return full
        n = full.shape[self.dim]
        if n % self.size:
            raise ValueError(f"{self.name!r}: dim {self.dim} of size {n} does not split evenly over {self.size} "
                             "rollout TP ranks.")
        part = n // self.size
        return full.narrow(self.dim, self.rank * part, part)


def _native_shards(engine) -> dict[str, HeldShard]:
    w = engine.weights
    if w is None:
        raise RuntimeError("cannot read back the native engine's weights while it sleeps at level 2; wake() it "
                           "before verifying a weight sync.")
    spec, rank, size = w.spec, w.tp_rank, w.tp_size
    hd = spec.head_dim
    q_rows, kv_rows = w.heads * hd, w.kv_heads * hd
    out = {"model.embed_tokens.weight": HeldShard("model.embed_tokens.weight", w.embed),
           "model.norm.weight": HeldShard("model.norm.weight", w.final_norm)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = HeldShard("lm_head.weight", w.lm_head)

    def add(name, tensor, dim=None):
        out[name] = HeldShard(name, tensor, dim, rank, size) if dim is not None else HeldShard(name, tensor)

    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", layer.input_norm)
        add(p + "post_attention_layernorm.weight", layer.post_norm)
        # fused qkv rows: [q of this rank's heads; k of its kv heads; v of its kv heads]
        add(p + "self_attn.q_proj.weight", layer.qkv[:q_rows], 0)
        add(p + "self_attn.k_proj.weight", layer.qkv[q_rows:q_rows + kv_rows], 0)
        add(p + "self_attn.v_proj.weight", layer.qkv[q_rows + kv_rows:q_rows + 2 * kv_rows], 0)
        if layer.qkv_bias is not None:
            add(p + "self_attn.q_proj.bias", layer.qkv_bias[:q_rows], 0)
            add(p + "self_attn.k_proj.bias", layer.qkv_bias[q_rows:q_rows + kv_rows], 0)
            add(p + "self_attn.v_proj.bias", layer.qkv_bias[q_rows + kv_rows:q_rows + 2 * kv_rows], 0)
        if layer.q_norm is not None:
            add(p + "self_attn.q_norm.weight", layer.q_norm)
            add(p + "self_attn.k_norm.weight", layer.k_norm)
        add(p + "self_attn.o_proj.weight", layer.o_proj, 1)
        # fused [gate; up] rows, each this rank's 1/size of the MLP width
        add(p + "mlp.gate_proj.weight", layer.gate_up[:w.inter], 0)
        add(p + "mlp.up_proj.weight", layer.gate_up[w.inter:2 * w.inter], 0)
        add(p + "mlp.down_proj.weight", layer.down, 1)
    return out


def _hf_model_shards(engine) -> dict[str, HeldShard]:
    # named_parameters() lists a tied lm_head once, under the embedding's name, as the export does
    return {name: HeldShard(name, p.detach()) for name, p in engine.model.named_parameters()}


def engine_hf_shards(engine) -> dict[str, HeldShard]:
    """name -> HeldShard for every HF tensor `engine` holds; TypeError for an engine we cannot read."""
    if hasattr(engine, "hf_weight_shards"):
        return {s[0] if isinstance(s, tuple) else s.name: s if isinstance(s, HeldShard) else HeldShard(*s)
                for s in engine.hf_weight_shards()}
    from rlhf_mcore.rollout.hf_backend import HFRolloutEngine
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    if isinstance(engine, NativeRolloutEngine):
        return _native_shards(engine)
    if isinstance(engine, HFRolloutEngine):
        return _hf_model_shards(engine)
    raise TypeError(f"weight-sync verification cannot read the weights of {type(engine).__name__}: give it a "
                    "`hf_weight_shards()` method, or turn verification off "
                    "(actor_rollout_ref.rollout.sync_verify=false).")
