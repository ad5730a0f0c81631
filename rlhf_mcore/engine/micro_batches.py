"""Splitting one DP rank's batch into mini-batches and micro-batches.

A batch is a dict of tensors whose first dimension is the sequence (veRL's layout, see
:mod:`rlhf_mcore.engine.packing`). Micro-batches are either a fixed number of sequences
(`micro_batch_size`) or formed by a token budget (`use_dynamic_bsz`, `max_token_len`), balanced with
Karmarkar-Karp so they hold similar token counts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from rlhf_mcore.engine.balance import split_by_token_budget
from rlhf_mcore.engine.packing import ModelInputs, build_model_inputs, natural_length
from rlhf_mcore.engine.shared_prefix import build_shared_prefix_inputs, plan_groups, prompt_groups

__all__ = ["MicroBatch", "select_rows", "plan_micro_batches", "make_micro_batches", "batch_size_of",
           "response_length_of"]


@dataclass
class MicroBatch:
    inputs: ModelInputs  # what the model reads
    data: dict[str, torch.Tensor]  # (b, R) per-row loss inputs: response_mask, old_log_probs, advantages, ...
    index: torch.Tensor  # (b,) row of each sequence in the batch it came from
    routes: Optional[torch.Tensor] = None  # (T, n, k) expert ids to replay, in the routers' order (engine.routes)
    recorded: dict = field(default_factory=dict)  # MoE layer index -> (T, k) ids its router picked (recording)
    pixel_values: Optional[torch.Tensor] = None  # (b, C, H, W): each row's own image (a vision-language policy)


def batch_size_of(batch: dict) -> int:
    return int(batch["input_ids"].shape[0])


def response_length_of(batch: dict) -> int:
    if "responses" in batch:
        return int(batch["responses"].shape[1])
    if "response_mask" in batch:
        return int(batch["response_mask"].shape[1])
    raise KeyError("the batch needs `responses` [B, R] (or `response_mask` [B, R]) to know the response length")


def select_rows(batch: dict, index: torch.Tensor) -> dict:
    """The rows `index` of every tensor in `batch` with a batch dimension; other entries are dropped."""
    n = batch_size_of(batch)
    return {k: v.index_select(0, index) for k, v in batch.items()
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n}


def plan_micro_batches(seqlens: list[int], *, micro_batch_size: int, use_dynamic_bsz: bool, max_token_len: int,
                       multiple_of: int = 1, dp_group: Optional[dist.ProcessGroup] = None,
                       keys: tuple[str, str] = ("ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu"),
                       shared_prefix_of: Optional[dict] = None) -> list[list[int]]:
    """Row indices of each micro-batch. `multiple_of`: the count must be a multiple (interleaved PP).
    `keys`: the config keys of the micro-batch size and token budget, for error messages.
    `shared_prefix_of` (a batch; with `use_dynamic_bsz`): the budget counts each prompt once per micro-batch, and
    the rows sharing a prompt stay together where the budget allows (:func:`shared_prefix.plan_groups`)."""
    n = len(seqlens)
    if use_dynamic_bsz and shared_prefix_of is not None:
        R = response_length_of(shared_prefix_of)
        mask = shared_prefix_of["attention_mask"]
        units, costs = plan_groups(mask, R, prompt_groups(shared_prefix_of["input_ids"], mask, R), max_token_len)
        parts = split_by_token_budget(costs, max_token_len, min_parts=multiple_of, multiple_of=multiple_of,
                                      group=dp_group, budget_key=keys[1])
        return [sorted(b for u in part for b in units[u]) for part in parts]
    if use_dynamic_bsz:
        return split_by_token_budget(seqlens, max_token_len, min_parts=multiple_of, multiple_of=multiple_of,
                                     group=dp_group, budget_key=keys[1])
    if n % micro_batch_size:
        raise ValueError(f"{n} sequences per rank are not divisible by {keys[0]}={micro_batch_size}: choose a "
                         "divisor, or turn on dynamic (token-budget) batching")
    count = n // micro_batch_size
    if count % multiple_of:
        raise ValueError(f"{count} micro-batches per mini-batch; the interleaved pipeline schedule needs a multiple "
                         f"of the pipeline size {multiple_of}: lower {keys[0]}")
    return [list(range(i, i + micro_batch_size)) for i in range(0, n, micro_batch_size)]


def make_micro_batches(batch: dict, plan: list[list[int]], *, keys: tuple[str, ...], packed: bool,
                       pad_to_multiple_of: int = 1, explicit_mask: bool = True,
                       uniform_shape: bool = False, static_shape: Optional[tuple[int, int, int]] = None,
                       routes_key: Optional[str] = None, share_prompt_prefix: bool = False) -> list[MicroBatch]:
    """Cut `batch` along `plan` and build each part's model inputs; `keys` are the (B, R) loss inputs.

    `uniform_shape`: pad every micro-batch to the largest one's shape. Pipeline parallelism needs it:
    stages exchange activations of a fixed shape (megatron-core's `variable_seq_lengths` shape exchange
    mismatches messages under the interleaved schedule at PP=2, so it is not used). With balanced
    micro-batches the padding is small.
    `static_shape` (packed): `(tokens, documents, max_seqlen)` every micro-batch is padded to (CUDA graphs, see
    :func:`rlhf_mcore.engine.cuda_graphs.static_shape`).
    `routes_key`: the batch's (B, L, n, k) routes each micro-batch replays, in its routers' order (`MicroBatch.routes`).
    A batch with `pixel_values` (B, C, H, W) (one image per row, read by a vision-language policy at the row's image
    tokens) gives each micro-batch its rows' images, in row order: the order the packed or padded layout keeps the
    rows in, so the model scatters each image into its own row.
    `share_prompt_prefix` (packed): each micro-batch packs a prompt once for all its rows that have it
    (:mod:`rlhf_mcore.engine.shared_prefix`); no static or uniform shape, routes or images.
    """
    missing = [k for k in ("input_ids", "attention_mask", *keys, *([routes_key] if routes_key else []))
               if k not in batch]
    if missing:
        raise KeyError(f"the batch lacks {missing}; it has {sorted(k for k in batch)}")
    R = response_length_of(batch)
    if "pixel_values" in batch and batch["pixel_values"].shape[0] != batch_size_of(batch):
        raise ValueError(f"pixel_values holds {batch['pixel_values'].shape[0]} images for {batch_size_of(batch)} "
                         "rows: the engine takes one image per row")
    if share_prompt_prefix:
        why = ("padded sequences" if not packed else "a static shape (CUDA graphs)" if static_shape is not None
               else "a uniform shape (pipeline parallelism)" if uniform_shape else "routing replay" if routes_key
               else "images" if "pixel_values" in batch else None)
        if why:
            raise ValueError(f"shared-prompt packing (model.share_prompt_prefix) does not run with {why}")
    device = batch["input_ids"].device
    lengths = batch["attention_mask"].sum(-1).tolist()
    pad_length = pad_rows = pad_docs = max_seqlen = 0
    if static_shape is not None:
        if not packed:
            raise ValueError("a static micro-batch shape (CUDA graphs) needs packed sequences")
        pad_length, pad_docs, max_seqlen = static_shape
    elif uniform_shape:
        pad_length = max(natural_length([int(lengths[i]) for i in rows], packed, pad_to_multiple_of) for rows in plan)
        pad_rows = 0 if packed else max(len(rows) for rows in plan)
    if share_prompt_prefix:  # the layout is computed on the host: read the batch back once, not per micro-batch
        ids_h, mask_h = batch["input_ids"].cpu().numpy(), batch["attention_mask"].cpu().numpy()
    out = []
    for rows in plan:
        index = torch.as_tensor(rows, dtype=torch.long, device=device)
        mask = batch["attention_mask"].index_select(0, index)
        if share_prompt_prefix:
            inputs = build_shared_prefix_inputs(torch.from_numpy(ids_h[rows]), torch.from_numpy(mask_h[rows]), R,
                                                pad_to_multiple_of=pad_to_multiple_of, device=device)
        else:
            ids = batch["input_ids"].index_select(0, index)
            inputs = build_model_inputs(ids, mask, R, packed=packed, pad_to_multiple_of=pad_to_multiple_of,
                                        explicit_mask=explicit_mask, pad_to_length=pad_length, pad_to_rows=pad_rows,
                                        pad_docs_to=pad_docs, static_max_seqlen=max_seqlen)
        data = {k: batch[k].index_select(0, index) for k in keys}
        routes = None
        if routes_key is not None:
            from rlhf_mcore.engine.routes import to_router_order

            routes = to_router_order(batch[routes_key].index_select(0, index), mask, inputs)
        images = batch["pixel_values"].index_select(0, index) if "pixel_values" in batch else None
        out.append(MicroBatch(inputs, data, index, routes, pixel_values=images))
    return out
