"""A FLOP model of a dense decoder-only transformer, for throughput and MFU (model FLOPs utilisation).

Per token, training (forward + backward = 3 × forward, the usual convention; activation recomputation is not
counted, so MFU stays comparable whatever is recomputed):

    dense matmuls      6 · N_matmul                      N_matmul = parameters in QKV, attention output, MLP
    attention          6 · L · (heads · head_dim) · s_eff   QKᵀ and PV: 2 · 2 · s · h_attn forward, × 3
    output projection  6 · hidden · vocab                (the critic's value head: vocab = 1), per token it runs on

Attention convention: **causal, so half of the full `12 · L · h · s`**: a token at position t attends to t
keys, `s/2` on average — only the FLOPs a causal kernel has to do count (flash-attention's convention;
counting the full square would inflate MFU by up to 2× at long contexts). `s_eff` is the token-weighted
mean sequence length, `sum(s_i²) / sum(s_i)` over the sequences of a batch: each token of a sequence of
length `s_i` attends to `s_i / 2` keys on average, and packed sequences attend within themselves only.
Embedding lookups, norms, activations and softmax are not counted (a few percent at these shapes).

Forward-only passes (log-probs of the reference or old policy, critic values) cost a third of the above.
Peak FLOP/s are dense (no sparsity) datasheet numbers for bf16 by device name.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["FlopShape", "effective_seqlen", "train_flops", "forward_flops", "peak_flops", "peak_flops_and_source",
           "mfu", "PEAK_BF16_FLOPS", "PEAK_ENV"]

# dense bf16 tensor-core peaks from the vendors' datasheets, FLOP/s (half the "with sparsity" figure). Keys are
# matched against the upper-cased device name, longest first, so a PCIe / NVL variant wins over its SXM family name.
PEAK_BF16_FLOPS = {
    "H200": 989.4e12, "H200 NVL": 835.5e12, "H100": 989.4e12, "H100 PCIE": 756.5e12, "H100 NVL": 835.5e12,
    "H800": 989.4e12, "H20": 148e12, "GH200": 989.4e12,
    "B200": 2250e12, "B100": 1750e12, "GB200": 2500e12,
    "A100": 312e12, "A800": 312e12, "A10G": 70e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12,
    "MI300X": 1307e12, "MI325X": 1307e12,
}
PEAK_ENV = "RLHF_MCORE_PEAK_FLOPS"  # FLOP/s of one device, e.g. 989.4e12: overrides the table


@dataclass(frozen=True)
class FlopShape:
    """The sizes the FLOP model needs."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int  # columns of the output projection: the vocabulary, or 1 for a critic's value head
    gated_mlp: bool = True  # SwiGLU: gate and up projections
    # mixture-of-experts: the MLP width each token goes through, summed over all layers (dense layers' width, a MoE
    # layer's top_k experts plus its shared expert), and the routers' parameters: FLOPs count active parameters
    active_mlp_width: Optional[int] = None
    router_params: int = 0

    @classmethod
    def from_transformer_config(cls, config, vocab_size: int) -> "FlopShape":
        """From a megatron `TransformerConfig` (whole-model sizes, not per-rank shards)."""
        return cls(
            num_layers=config.num_layers, hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups or config.num_attention_heads,
            head_dim=config.kv_channels or config.hidden_size // config.num_attention_heads,
            ffn_hidden_size=config.ffn_hidden_size, vocab_size=vocab_size,
            gated_mlp=bool(config.gated_linear_unit), **_moe_active(config))

    @property
    def matmul_params(self) -> int:
        """Parameters in the per-layer matmuls (QKV, attention output, MLP), all layers."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        attn = h * (q + 2 * kv) + q * h
        width = self.num_layers * self.ffn_hidden_size if self.active_mlp_width is None else self.active_mlp_width
        return self.num_layers * attn + (3 if self.gated_mlp else 2) * h * width + self.router_params


def _moe_active(config) -> dict:
    """FlopShape's MoE fields from a TransformerConfig with experts (moe_layer_freq as a 0/1 list); {} without."""
    if not getattr(config, "num_moe_experts", None):
        return {}
    freq = config.moe_layer_freq
    sparse = sum(freq) if isinstance(freq, list) else len(range(0, config.num_layers, freq))
    per_moe = config.moe_router_topk * config.moe_ffn_hidden_size + (config.moe_shared_expert_intermediate_size or 0)
    return dict(active_mlp_width=(config.num_layers - sparse) * config.ffn_hidden_size + sparse * per_moe,
                router_params=sparse * config.hidden_size * config.num_moe_experts)


def effective_seqlen(seqlens: Sequence[int]) -> float:
    """Token-weighted mean sequence length `sum(s²) / sum(s)` (see the module docstring)."""
    total = sum(int(s) for s in seqlens)
    return sum(int(s) ** 2 for s in seqlens) / total if total else 0.0


def train_flops(shape: FlopShape, seqlens: Sequence[int], head_rows: Optional[int] = None) -> float:
    """FLOPs of one forward + backward over sequences of lengths `seqlens` (causal attention, see above).
    `head_rows`: the tokens the output projection ran on, when not all of them (the train engine runs it on the
    scored response rows only, :mod:`rlhf_mcore.engine.scored_rows`): only the work done counts."""
    tokens = sum(int(s) for s in seqlens)
    h_attn = shape.num_attention_heads * shape.head_dim
    per_token = (6 * shape.matmul_params
                 + 6 * shape.num_layers * h_attn * effective_seqlen(seqlens))  # = 12·L·h·s/2
    head = 6 * shape.hidden_size * shape.vocab_size * (tokens if head_rows is None else int(head_rows))
    return per_token * tokens + head


def forward_flops(shape: FlopShape, seqlens: Sequence[int], head_rows: Optional[int] = None) -> float:
    """FLOPs of one forward pass: a third of :func:`train_flops`."""
    return train_flops(shape, seqlens, head_rows) / 3


def peak_flops(device: torch.device | str | None = None) -> Optional[float]:
    """Dense bf16 peak FLOP/s of one device, from its name; `RLHF_MCORE_PEAK_FLOPS` overrides.

    None when unknown (a CPU, an unlisted GPU): MFU is then not reported rather than made up.
    """
    return peak_flops_and_source(device)[0]


def peak_flops_and_source(device: torch.device | str | None = None) -> tuple[Optional[float], str]:
    """(:func:`peak_flops`, where it came from): "RLHF_MCORE_PEAK_FLOPS", "table: <key>" or "unknown: <why>"."""
    override = os.environ.get(PEAK_ENV)
    if override:
        try:
            value = float(override)
        except ValueError:
            value = -1.0
        if value <= 0:
            raise ValueError(f"{PEAK_ENV}={override!r}: give the device's dense bf16 peak in FLOP/s, e.g. 989.4e12")
        return value, PEAK_ENV
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None, "unknown: not a CUDA device"
    name = torch.cuda.get_device_name(device)
    upper = name.upper()
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):  # "H200 NVL" before "H200", "H200" before "H20"
        if key in upper:
            return PEAK_BF16_FLOPS[key], f"table: {key}"
    return None, f"unknown: {name!r} is not in rlhf_mcore.engine.flops.PEAK_BF16_FLOPS (set {PEAK_ENV})"


def mfu(flops: float, seconds: float, num_devices: int, peak: Optional[float]) -> Optional[float]:
    """Achieved / peak FLOP/s over `num_devices` devices, or None when the peak is unknown."""
    if peak is None or seconds <= 0 or num_devices < 1:
        return None
    return flops / seconds / (peak * num_devices)
