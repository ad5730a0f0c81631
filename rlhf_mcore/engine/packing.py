"""From the trainer's padded batch to model inputs, and from per-token model outputs back to `[B, R]`.

The batch layout (veRL's): `input_ids [B, P+R]` = left-padded prompt followed by the right-padded response,
`attention_mask [B, P+R]` (1 on real tokens), `responses [B, R]` = the last `R` columns.

Two layouts go into the model, both with each sequence's real tokens moved to the front, so that token `t` of
a sequence sits at position `t` and attends to tokens `0..t` only:

- packed (`use_remove_padding`, THD): all real tokens concatenated into `[1, total]`, position ids restarting
  at 0 per sequence, `PackedSeqParams(qkv_format="thd", cu_seqlens...)`, no attention mask. No compute is
  spent on padding.
- padded: `[B, S]` with `S` the longest sequence of the micro-batch, padding at the end, and plain causal
  attention. Moving the left padding to the end makes a causal mask exact: a real token never sees a pad,
  and no query row is fully masked (fully masked rows turn softmax into NaN in some attention kernels). The
  mask is passed explicitly (bool `[B, 1, S, S]`, True = masked out) when `explicit_mask` — needed on CPU,
  where Megatron's default causal mask is built on CUDA — and left to the kernel (`None`, is_causal) on GPU.

Positions are always `0..len-1` per sequence (what the rollout used for a left-padded prompt), whatever the
batch's `position_ids` say.

A response token at column `P+j` is predicted by the model output one position earlier; :class:`ModelInputs`
records, for every valid response token, that output row (`rows`, into the flattened `[B·S]` or `[total]`
outputs), its token id (`labels`) and where it goes in the `[B, R]` grid (`grid_index`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rlhf_mcore.engine.cuda_graphs import STATIC_FLAG

__all__ = ["ModelInputs", "build_model_inputs", "natural_length"]


@dataclass
class ModelInputs:
    """One micro-batch ready for `GPTModel.forward`, plus the map from outputs to the `[B, R]` grid."""

    input_ids: torch.Tensor  # (B', S) padded (B' >= B: dummy rows at the end) or (1, total) packed
    position_ids: torch.Tensor  # same shape as input_ids
    attention_mask: Optional[torch.Tensor]  # (B, 1, S, S) bool, True = masked; None: causal (or packed)
    packed_seq_params: Optional[object]  # megatron PackedSeqParams (THD) or None
    rows: torch.Tensor  # (M,) row of the flattened outputs that predicts each valid response token
    labels: torch.Tensor  # (M,) the response token ids
    grid_index: torch.Tensor  # (M,) flat index into the (B, R) response grid
    batch_size: int  # B
    response_length: int  # R
    num_tokens: int  # real (non-pad) tokens in the micro-batch
    seqlens: list[int]  # real tokens per sequence
    # (num_tokens,) where each real token (row-major over the (B, L) input's real tokens) sits in the order the MoE
    # routers see the model's tokens: Megatron's (S, B') activations flattened sequence-major (packed: the packed
    # order); routing replay's map (rlhf_mcore.engine.routes)
    router_index: Optional[torch.Tensor] = None

    @property
    def packed(self) -> bool:
        return self.packed_seq_params is not None

    def to_grid(self, values: torch.Tensor) -> torch.Tensor:
        """Scatter per-token `values` (M,) into a zero-filled `(B, R)` grid; differentiable w.r.t. `values`."""
        flat = torch.zeros(self.batch_size * self.response_length, dtype=values.dtype, device=values.device)
        return flat.scatter(0, self.grid_index, values).view(self.batch_size, self.response_length)  # (B, R)


def natural_length(seqlens: list[int], packed: bool, pad_to_multiple_of: int = 1) -> int:
    """The sequence dimension a micro-batch of these lengths gets: `total` packed, the longest padded."""
    n = sum(seqlens) if packed else max(seqlens, default=1)
    return -(-max(n, 1) // pad_to_multiple_of) * pad_to_multiple_of


def build_model_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int, *,
                       packed: bool, pad_to_multiple_of: int = 1, explicit_mask: bool = True,
                       pad_to_length: int = 0, pad_to_rows: int = 0, pad_docs_to: int = 0,
                       static_max_seqlen: int = 0) -> ModelInputs:
    """Build the model inputs of one micro-batch from its padded rows (see the module docstring).

    input_ids, attention_mask: `(B, L)` with the response in the last `response_length` columns.
    pad_to_multiple_of: round `S` (padded) or `total` (packed, as one trailing dummy sequence) up to a
    multiple, e.g. the TP size under sequence parallelism.
    pad_to_length, pad_to_rows: pad the sequence dimension (`total` or `S`) and, padded, the rows to at
    least these sizes, so that every micro-batch of a pipeline schedule has the same shape (dummy tokens and
    rows; their outputs are never read).
    pad_docs_to (packed): a static shape for CUDA graphs: `cu_seqlens` gets `pad_docs_to + 1` entries (zero-length
    documents at the end), `max_seqlen` is `static_max_seqlen` (default: the packed length) whatever the documents
    are, and the padding tokens form dummy documents of at most that many tokens each
    (:func:`rlhf_mcore.engine.cuda_graphs.static_shape` sizes these). The PackedSeqParams carries
    `cuda_graphs.STATIC_FLAG`: the graphs' dispatcher takes only such calls.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must "
                         "both be (batch, prompt_len + response_len)")
    B, L = input_ids.shape
    R = int(response_length)
    if not 0 < R <= L:
        raise ValueError(f"response length {R} must be in (0, {L}] (the width of input_ids)")
    device = input_ids.device
    valid = attention_mask.bool()  # (B, L)
    lengths = valid.sum(dim=1)  # (B,)
    rank = valid.long().cumsum(dim=1) - 1  # (B, L) position of each real token in its compacted sequence
    resp_valid = valid[:, L - R:]  # (B, R)
    resp_rank = rank[:, L - R:]  # (B, R)
    if bool((resp_valid & (resp_rank < 1)).any()):
        raise ValueError("a response token has no token before it (empty prompt): every sequence needs at least "
                         "one prompt token to score its response")
    b_idx, j_idx = resp_valid.nonzero(as_tuple=True)  # (M,), (M,)
    labels = input_ids[:, L - R:][b_idx, j_idx]  # (M,)
    grid_index = b_idx * R + j_idx  # (M,)
    pred_pos = resp_rank[b_idx, j_idx] - 1  # (M,) position of the predicting output within its sequence
    seqlens = [int(x) for x in lengths.tolist()]
    num_tokens = int(lengths.sum())

    if packed:
        from megatron.core.packed_seq_params import PackedSeqParams

        offsets = torch.cumsum(lengths, 0) - lengths  # (B,)
        tokens = input_ids[valid]  # (total,) row-major: sequence 0's tokens, then sequence 1's, ...
        positions = rank[valid]  # (total,)
        cu = torch.zeros(B + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(lengths, 0).to(torch.int32)
        pad = max(natural_length(seqlens, True, pad_to_multiple_of), pad_to_length) - num_tokens
        # the padding: dummy trailing sequences (one, or for a static shape none longer than its max_seqlen)
        static_len = (static_max_seqlen or num_tokens + pad) if pad_docs_to else 0
        if static_len and max(seqlens, default=0) > static_len:
            raise ValueError(f"a document of {max(seqlens)} tokens exceeds the static max_seqlen {static_len}")
        chunk = static_len or pad
        if pad:  # their outputs are never read
            dummies = [min(chunk, pad - start) for start in range(0, pad, chunk)]
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])
            positions = torch.cat([positions, *(torch.arange(n, device=device) for n in dummies)])
            ends = torch.tensor(dummies, dtype=torch.int32, device=device).cumsum(0).to(torch.int32)
            cu = torch.cat([cu, cu[-1:] + ends])
        max_len = int(max(max(seqlens, default=1), pad, 1))
        if pad_docs_to:
            extra = pad_docs_to + 1 - cu.numel()
            if extra < 0:
                raise ValueError(f"{cu.numel() - 1} packed documents (with the padding's dummies) do not fit a static "
                                 f"shape of {pad_docs_to}")
            cu = torch.cat([cu, cu[-1:].expand(extra)])
            max_len = static_len
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                                 max_seqlen_kv=max_len)
        if pad_docs_to:
            setattr(params, STATIC_FLAG, True)
        rows = offsets[b_idx] + pred_pos  # (M,)
        return ModelInputs(tokens[None], positions[None], None, params, rows, labels, grid_index, B, R,
                           num_tokens, seqlens, router_index=torch.arange(num_tokens, device=device))

    S = max(natural_length(seqlens, False, pad_to_multiple_of), pad_to_length)
    rows_model = max(B, pad_to_rows)
    tokens = torch.zeros(rows_model, S, dtype=input_ids.dtype, device=device)  # (B', S); rows past B are dummies
    vb, vc = valid.nonzero(as_tuple=True)
    tokens[vb, rank[vb, vc]] = input_ids[vb, vc]
    positions = torch.arange(S, device=device).expand(rows_model, S).contiguous()  # (B', S)
    mask = None
    if explicit_mask:
        causal = torch.triu(torch.ones(S, S, dtype=torch.bool, device=device), diagonal=1)  # (S, S) True: future
        mask = causal[None, None].expand(rows_model, 1, S, S)  # (B', 1, S, S)
    rows = b_idx * S + pred_pos  # (M,)
    router_index = rank[vb, vc] * rows_model + vb  # (num_tokens,) the (S, B') layout, sequence-major
    return ModelInputs(tokens, positions, mask, None, rows, labels, grid_index, B, R, num_tokens, seqlens,
                       router_index=router_index)
