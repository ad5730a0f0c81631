"""The native engine's mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE) with Hugging Face's routing semantics.

Routing, as transformers' `Qwen3MoeTopKRouter` / `Qwen2MoeTopKRouter`: `softmax(h @ router.T)` in fp32 over all
experts, the top k taken (ties to the lower index, `torch.topk`), renormalised to sum 1 when `norm_topk_prob`, cast
back to the activations' dtype; each token's output is the weighted sum of its k experts' SwiGLU MLPs, plus (Qwen2-MoE)
the shared expert scaled by `sigmoid(h @ shared_gate.T)`.

Layout under rollout tensor parallelism: every rank holds every expert (experts replicated across the rollout TP
ranks), each expert's [gate; up] rows and down columns split like a dense MLP's (TP over the experts' columns); the
router and the shared expert's gate are replicated. The routed and shared partial sums are added, then summed over
TP with one all-reduce (by the caller).

Two expert paths, the same numbers up to summation order:
- CPU (and any device): a loop over the experts that received tokens, as transformers does;
- CUDA, bf16: one grouped GEMM over the active experts for [gate; up] and one for down
  (`rlhf_mcore.kernels.grouped_mm`: `torch._grouped_mm` over token rows sorted by expert; the train engine's
  experts share it).
  UNVERIFIED here (no GPU in this project's CI): its test skips without CUDA.

The layer returns the routed expert ids (N, k) too: what routing replay (R3) records.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_mcore.kernels.grouped_mm import grouped_mm, use_grouped_mm

# names (below "model.layers.N.") of a sparse layer's tensors
ROUTER = "mlp.gate.weight"
SHARED_GATE = "mlp.shared_expert_gate.weight"


def moe_fields(spec, tp_size: int, empty) -> dict:
    """The MoE tensors of one sparse layer's `LayerWeights` (empty(*shape) allocates)."""
    e, d = spec.num_experts, spec.hidden_size
    inter = spec.moe_ffn_hidden_size // tp_size
    out = dict(router=empty(e, d), experts_gate_up=empty(e, 2 * inter, d), experts_down=empty(e, d, inter))
    if spec.shared_expert_ffn_hidden_size:
        shared = spec.shared_expert_ffn_hidden_size // tp_size
        out.update(shared_gate_up=empty(2 * shared, d), shared_down=empty(d, shared), shared_gate=empty(1, d))
    return out


def moe_target(layer, rest: str, t: torch.Tensor, rows, cols):
    """(destination view, source slice) of HF tensor `rest` of a sparse layer, or None when it is not a MoE tensor.
    rows(t, n) / cols(t, n): this rank's n rows / columns of t."""
    if rest == ROUTER:
        return layer.router, t
    if rest == SHARED_GATE and layer.shared_gate is not None:
        return layer.shared_gate, t
    parts = rest.split(".")
    if rest.startswith("mlp.experts.") and len(parts) == 5 and parts[2].isdigit():
        e, proj = int(parts[2]), parts[3]
        if e >= layer.experts_gate_up.shape[0]:
            return None
        gate_up, down = layer.experts_gate_up[e], layer.experts_down[e]
    elif rest.startswith("mlp.shared_expert.") and len(parts) == 4 and layer.shared_gate_up is not None:
        proj, gate_up, down = parts[2], layer.shared_gate_up, layer.shared_down
    else:
        return None
    inter = down.shape[1]
    if proj in ("gate_proj", "up_proj"):
        return gate_up.narrow(0, 0 if proj == "gate_proj" else inter, inter), rows(t, inter)
    if proj == "down_proj":
        return down, cols(t, inter)
    return None


def moe_hf_shards(layer, prefix: str, add) -> None:
    """`hf_shards.add(name, view, dim)` for every HF tensor of a sparse layer (dim 0: rows split over TP, 1: columns,
    None: replicated)."""
    add(prefix + ROUTER, layer.router)
    for e in range(layer.experts_gate_up.shape[0]):
        inter = layer.experts_down.shape[2]
        add(f"{prefix}mlp.experts.{e}.gate_proj.weight", layer.experts_gate_up[e, :inter], 0)
        add(f"{prefix}mlp.experts.{e}.up_proj.weight", layer.experts_gate_up[e, inter:], 0)
        add(f"{prefix}mlp.experts.{e}.down_proj.weight", layer.experts_down[e], 1)
    if layer.shared_gate_up is not None:
        inter = layer.shared_down.shape[1]
        add(prefix + "mlp.shared_expert.gate_proj.weight", layer.shared_gate_up[:inter], 0)
        add(prefix + "mlp.shared_expert.up_proj.weight", layer.shared_gate_up[inter:], 0)
        add(prefix + "mlp.shared_expert.down_proj.weight", layer.shared_down, 1)
        add(prefix + SHARED_GATE, layer.shared_gate)


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (N, k) in h's dtype, expert ids (N, k)) for hidden states h (N, D), as transformers routes."""
    probs = torch.softmax(F.linear(h, router), dim=-1, dtype=torch.float32)  # (N, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(h.dtype), ids


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    inter = down.shape[-1]
    gu = F.linear(x, gate_up)
    return F.linear(F.silu(gu[..., :inter]) * gu[..., inter:], down)


def looped_experts(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """sum_j weights[:, j] * expert_{ids[:, j]}(h), one expert at a time over the experts that got tokens: (N, D)."""
    out = torch.zeros_like(h)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        y = _swiglu(h[token], gate_up[e], down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def grouped_experts(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """The same as `looped_experts` with two grouped GEMMs over all experts (CUDA, bf16; `torch._grouped_mm`)."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (N k,) routed slots grouped by expert
    token = order // k
    counts = torch.bincount(flat, minlength=gate_up.shape[0])  # rows per expert
    x = h[token]  # (N k, D)
    gu = grouped_mm(x, gate_up, counts, grouped=True)  # (N k, 2 I)
    inter = down.shape[-1]
    act = F.silu(gu[:, :inter]) * gu[:, inter:]
    y = grouped_mm(act, down, counts, grouped=True)  # (N k, D)
    y = y * weights.reshape(-1)[order, None]
    return torch.zeros_like(h).index_add_(0, token, y.to(h.dtype))


def use_grouped(h: torch.Tensor) -> bool:
    return use_grouped_mm(h)


def moe_mlp(h: torch.Tensor, lw, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial sum (N, D) of the MoE MLP on normed hidden states h (N, D) (the caller all-reduces it over
    TP), and the routed expert ids (N, k)."""
    weights, ids = route(h, lw.router, spec.moe_top_k, spec.norm_topk_prob)
    experts = grouped_experts if use_grouped(h) else looped_experts
    out = experts(h, weights, ids, lw.experts_gate_up, lw.experts_down)
    if lw.shared_gate_up is not None:
        out = out + _swiglu(h, lw.shared_gate_up, lw.shared_down) * torch.sigmoid(F.linear(h, lw.shared_gate))
    return out, ids
