"""Shared-prompt packing: a group's prompt runs once, and each of its responses attends to it.

GRPO and its relatives sample `n` responses per prompt, and the update, the old-log-prob and the reference passes
run the prompt `n` times, once per row. The prompt's hidden states do not depend on the response that follows it
(attention is causal), so computing them once and letting every response attend to them gives the same log-probs
and the same gradients up to floating-point summation order, with `(n - 1) * P` fewer tokens per group: on TRL's
GRPO workload (8 samples, ~94-token prompts, 256-token responses) 23% fewer tokens per update.

The packed layout of one micro-batch (`actor_rollout_ref.model.share_prompt_prefix=true`, packed sequences only):

    tokens    [ p_g | r_1 | r_2 | ... | r_k | p_h | s_1 | ... ]   p: a prompt once, r_i / s_i: its rows' responses
    positions   0..P_g-1, then P_g.. for every response of g (a response sits right after its prompt)

Attention is described by documents of queries and documents of keys/values that differ:

- the prompt document: queries p_g, keys p_g, causal;
- response i: queries r_i, keys `p_g ++ r_i` (gathered by `kv_index`), causal aligned at the bottom right (query j
  of r_i sees the prompt and r_i's first j+1 tokens): Flash Attention's causal mask when the key document is
  longer than the query document.

Rows sharing a prompt are found by their prompt tokens inside each micro-batch, so the rows of a group need not
be adjacent; the token-budget planner (:func:`plan_groups`) keeps a group in one micro-batch when it can.

The response token j of row b is predicted by the output of the token before it: the prompt's last token for
j = 0 (one output row read by all k responses: its log-softmax gathers k labels, and the backward sums their
gradients), response token j-1 otherwise.
"""
from __future__ import annotations

import numpy as np
import torch

from rlhf_mcore.models.attention_ops import SHARED_PREFIX_ATTR, SharedPrefixLayout
from rlhf_mcore.models.rope import POSITIONS_ATTR

__all__ = ["prompt_groups", "group_costs", "plan_groups", "build_shared_prefix_inputs"]

def prompt_groups(input_ids, attention_mask, response_length: int) -> list[list[int]]:
    """Rows with the same prompt tokens (the real tokens of the first `L - R` columns), in first-seen order; each
    group lists its rows in order. input_ids, attention_mask: (B, L) tensors (read back once if on a GPU) or
    numpy arrays."""
    ids, valid = _host(input_ids), _host(attention_mask) != 0
    cut = ids.shape[1] - response_length
    ids, valid = ids[:, :cut], valid[:, :cut]
    groups: dict[bytes, list[int]] = {}
    for b in range(ids.shape[0]):
        groups.setdefault(ids[b][valid[b]].tobytes(), []).append(b)
    return list(groups.values())


def _host(t) -> np.ndarray:
    """A tensor's values as a numpy array on the host (one device read-back if it is on a GPU)."""
    return t if isinstance(t, np.ndarray) else t.detach().cpu().numpy()


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """concat(arange(s, s + n) for s, n in zip(starts, lengths)) without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    firsts = np.cumsum(lengths) - lengths  # where each range begins in the output
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - firsts, lengths)


def group_costs(attention_mask: torch.Tensor, response_length: int, groups: list[list[int]]) -> list[int]:
    """Tokens each group packs to: its prompt once plus every response."""
    L = attention_mask.shape[1]
    prompt = attention_mask[:, :L - response_length].sum(-1).tolist()
    resp = attention_mask[:, L - response_length:].sum(-1).tolist()
    return [int(prompt[g[0]]) + sum(int(resp[b]) for b in g) for g in groups]


def plan_groups(attention_mask: torch.Tensor, response_length: int, groups: list[list[int]], max_tokens: int
                ) -> tuple[list[list[int]], list[int]]:
    """Groups cut to fit a token budget: a group whose packed tokens exceed `max_tokens` is split into sub-groups
    that each pay for the prompt once. Returns (units: rows of each unit, their packed token counts)."""
    L = attention_mask.shape[1]
    prompt = attention_mask[:, :L - response_length].sum(-1).tolist()
    resp = attention_mask[:, L - response_length:].sum(-1).tolist()
    units, costs = [], []
    for g in groups:
        cur, cost = [], int(prompt[g[0]])
        for b in g:
            if cur and cost + int(resp[b]) > max_tokens:
                units.append(cur)
                costs.append(cost)
                cur, cost = [], int(prompt[g[0]])
            cur.append(b)
            cost += int(resp[b])
        units.append(cur)
        costs.append(cost)
    return units, costs


def build_shared_prefix_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int, *,
                               pad_to_multiple_of: int = 1, device=None):
    """The packed :class:`~rlhf_mcore.engine.packing.ModelInputs` of one micro-batch with each prompt once.

    input_ids, attention_mask: (B, L), the prompt left-padded in the first `L - R` columns, the response in the
    last `R`. `pad_to_multiple_of` rounds the packed length up with one trailing dummy document (sequence
    parallelism). `ModelInputs.seqlens` lists the query documents' lengths: the tokens actually computed.
    `device`: where the inputs go (default: input_ids'); CPU inputs for a GPU device avoid reading them back.

    The layout is computed on the host with whole-array numpy operations (no per-row tensor ops: 3 ms for the 7
    micro-batches of TRL's 512-row GRPO batch, where a loop over rows took 17) and reaches the device in one pinned,
    non-blocking copy.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    from rlhf_mcore.engine.packing import ModelInputs

    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must "
                         "both be (batch, prompt_len + response_len)")
    B, L = input_ids.shape
    R = int(response_length)
    if not 0 < R < L:
        raise ValueError(f"response length {R} must be in (0, {L}) (the width of input_ids, with a prompt)")
    device = input_ids.device if device is None else torch.device(device)
    ids, valid = _host(input_ids), _host(attention_mask) != 0
    C = L - R  # prompt columns
    groups = prompt_groups(ids, valid, R)
    leaders = np.array([g[0] for g in groups], dtype=np.int64)
    plen = valid[:, :C].sum(1)  # (B,)
    rlen = valid[:, C:].sum(1)  # (B,)
    if (plen[leaders] < 1).any():
        raise ValueError("a response token has no token before it (empty prompt): every sequence needs at least "
                         "one prompt token to score its response")
    # the documents in packed order: each group's prompt, then its non-empty responses
    members = [np.array([b for b in g if rlen[b]], dtype=np.int64) for g in groups]
    doc_group = np.concatenate([np.full(1 + len(m), gi) for gi, m in enumerate(members)])
    doc_row = np.concatenate([np.concatenate([[-1], m]) for m in members])  # -1: the group's prompt
    is_resp = doc_row >= 0
    P = plen[leaders][doc_group]  # (D,) the prompt length of each document's group
    q_docs = np.where(is_resp, rlen[np.maximum(doc_row, 0)], P)
    starts = np.cumsum(q_docs) - q_docs  # each document's first packed token
    prompt_at = starts[~is_resp][doc_group]  # (D,) where the document's prompt sits
    num_tokens = int(q_docs.sum())
    total = -(-max(num_tokens, 1) // pad_to_multiple_of) * pad_to_multiple_of
    pad = total - num_tokens

    tokens = np.zeros(total, dtype=ids.dtype)
    positions = np.zeros(total, dtype=np.int64)
    pr, pc = np.nonzero(valid[leaders, :C])  # every prompt's tokens, group after group
    tokens[_ranges(starts[~is_resp], P[~is_resp])] = ids[leaders[pr], pc]
    positions[:num_tokens] = _ranges(np.where(is_resp, P, 0), q_docs)  # a response continues its prompt's positions
    resp_rows = doc_row[is_resp]
    rr, rc = np.nonzero(valid[resp_rows, C:])  # every response's tokens, in packed order
    resp_at = _ranges(starts[is_resp], q_docs[is_resp])
    labels = ids[resp_rows[rr], C + rc]
    tokens[resp_at] = labels
    # token j of a response is predicted by the prompt's last output (j = 0) or by response token j - 1
    rows = resp_at - 1
    rows[np.cumsum(q_docs[is_resp]) - q_docs[is_resp]] = (prompt_at + P - 1)[is_resp]
    grid = resp_rows[rr] * R + rc
    # keys: a prompt document its own tokens; a response its prompt, then itself
    piece_start = np.stack([prompt_at, starts], 1)[:, :, None]  # (D, 2, 1)
    piece_len = np.stack([P, np.where(is_resp, q_docs, 0)], 1)[:, :, None]
    kv_docs = P + np.where(is_resp, q_docs, 0)
    kv_index = _ranges(piece_start.reshape(-1), piece_len.reshape(-1))
    if pad:  # one dummy document of its own; its outputs are never read
        positions[num_tokens:] = np.arange(pad)
        q_docs, kv_docs = np.append(q_docs, pad), np.append(kv_docs, pad)
        kv_index = np.concatenate([kv_index, np.arange(num_tokens, total)])
    cu_q = np.concatenate([[0], np.cumsum(q_docs)])
    cu_kv = np.concatenate([[0], np.cumsum(kv_docs)])
    # one host buffer, one pinned non-blocking copy: nothing here waits for the GPU's queue to drain
    parts = [tokens.astype(np.int64), positions, rows, labels.astype(np.int64), grid, kv_index, cu_q, cu_kv]
    host = torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    tok_t, pos_t, rows_t, lab_t, grid_t, kv_t, cu_q_t, cu_kv_t = torch.split(flat, [len(x) for x in parts])
    tok_t, lab_t = tok_t.to(input_ids.dtype), lab_t.to(input_ids.dtype)
    layout = SharedPrefixLayout(cu_q=cu_q_t.to(torch.int32), cu_kv=cu_kv_t.to(torch.int32), kv_index=kv_t,
                                max_q=int(q_docs.max()), max_kv=int(kv_docs.max()), positions=pos_t)
    cu_rope = layout.cu_q.clone()  # RoPE reads the positions from it (rope.POSITIONS_ATTR)
    setattr(cu_rope, POSITIONS_ATTR, pos_t)
    # max_seqlen sizes Megatron's RoPE table: the farthest position, a response's last token
    max_pos = int(positions.max()) + 1
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_rope, cu_seqlens_kv=cu_rope, max_seqlen_q=max_pos,
                             max_seqlen_kv=max_pos)
    setattr(params, SHARED_PREFIX_ATTR, layout)
    return ModelInputs(
        input_ids=tok_t[None], position_ids=pos_t[None], attention_mask=None, packed_seq_params=params, rows=rows_t,
        labels=lab_t, grid_index=grid_t, batch_size=B, response_length=R, num_tokens=num_tokens,
        seqlens=[int(n) for n in q_docs[:len(q_docs) - bool(pad)]], router_index=None)
