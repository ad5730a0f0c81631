"""The critic's scalar value head: a width-1 linear layer in place of GPTModel's vocabulary projection.

It is replicated on every TP rank (one output column cannot be split), takes the final-normed hidden states
(S, B, H) and returns values (S, B, 1); GPTModel then transposes them to (B, S, 1). Its call signature matches
`ColumnParallelLinear`'s as GPTModel uses it (`weight=`, `runtime_gather_output=`; returns (out, bias)).

Initialisation is small and deterministic — weight normal with std 1/(H+1), bias 0, from a fixed-seed generator — so
every rank starts with the same head without a broadcast, and initial values are near zero. In HF format the
head is `score.weight` (1, H) / `score.bias` (1,), as in `*ForTokenClassification` with num_labels=1. A reward
model's head (`bias=False`) is `score.weight` only, as in `*ForSequenceClassification`.
"""
from __future__ import annotations

import torch

HEAD_SEED = 20240917


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int, *, dtype: torch.dtype = torch.float32, device=None, seed: int = HEAD_SEED,
                 bias: bool = True):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=gen) / (hidden_size + 1)
        self.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype)) if bias else None
        # no sequence parallelism on this head: megatron's GPTModel reads this attribute in inference paths
        self.sequence_parallel = False

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        """hidden_states (S, B, H) -> (values (S, B, 1), None)."""
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None
