"""The output layer over the scored tokens only.

Megatron's GPTModel applies its output layer to every token of a micro-batch: the prompt tokens, the padding and,
under CUDA graphs, the static shape's dummy tokens. The train engine's losses and forward passes read its output
only at the rows that predict response tokens (`ModelInputs.rows`), so the output layer's GEMM over every other
row, forward and backward, is wasted work. At Qwen2.5-0.5B's 151,936-token vocabulary the output layer is ~27% of a
token's forward FLOPs, and prompts are 15-40% of an RL batch's tokens.

:class:`ScoredRowsHead` wraps a chunk's output layer (the vocabulary projection, or a critic's value head): inside
:meth:`ScoredRowsHead.select` it gathers the hidden states of the given rows first, so the layer computes
`(M, 1, V)` outputs, in row order, and Megatron hands the loss `(1, M, V)`. The engine then gives the loss its
micro-batch with `rows=None` (the output *is* the rows). Gradients reach the other rows' hidden states as zeros
through the gather's backward, as they did through the full logits.

Where it does not apply (:func:`head_unsupported`, a property of the model, so every pipeline stage agrees, and
the FLOP count with it): sequence parallelism (the output layer's input is the rank's slice of the sequence),
context parallelism, multi-token prediction, and a vision-language model (its language model's output rows are not
checked against the input rows here).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

__all__ = ["ScoredRowsHead", "head_unsupported"]


def head_unsupported(chunk) -> Optional[str]:
    """Why the model of `chunk` (any pipeline stage) cannot run its output layer on the scored rows only, or None
    when it can."""
    layer = getattr(chunk, "output_layer", None)
    config = chunk.config
    if getattr(layer, "sequence_parallel", False) or getattr(config, "sequence_parallel", False):
        return "sequence parallelism: the output layer's input is this rank's slice of the sequence"
    if getattr(config, "context_parallel_size", 1) > 1:
        return "context parallelism: the sequence is split over ranks"
    if getattr(config, "mtp_num_layers", None):
        return "multi-token prediction reads every position"
    if type(chunk).__name__ != "GPTModel":
        return f"a {type(chunk).__name__}: only a plain GPTModel's output rows are the input rows"
    return None


class ScoredRowsHead:
    """Replaces `chunk.output_layer.forward` with a dispatcher: inside :meth:`select`, the layer runs on the
    selected rows of its `(S, B, H)` input (flattened in `(B, S)` order, as `ModelInputs.rows` counts them);
    outside it, on every row, unchanged."""

    def __init__(self, chunk):
        self.layer = chunk.output_layer
        self._forward = self.layer.forward
        self.layer.forward = self._dispatch
        self._rows: Optional[torch.Tensor] = None
        self.used = False  # the last selection reached the layer (this stage ran it)

    @contextmanager
    def select(self, rows: torch.Tensor):
        """The output layer computes only `rows` (M,) of the flattened `(B·S)` positions while inside."""
        self._rows, self.used = rows, False
        try:
            yield self
        finally:
            self._rows = None

    def _dispatch(self, hidden_states: torch.Tensor, *args, **kwargs):
        rows = self._rows
        if rows is None:
            return self._forward(hidden_states, *args, **kwargs)
        S, B, H = hidden_states.shape
        flat = hidden_states.reshape(S, H) if B == 1 else hidden_states.transpose(0, 1).reshape(B * S, H)
        self.used = True
        return self._forward(flat.index_select(0, rows).unsqueeze(1), *args, **kwargs)  # (M, 1, H)
