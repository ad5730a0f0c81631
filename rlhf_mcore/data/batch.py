"""From prompts and generated responses to the padded batch every phase works on (veRL's layout).

    prompts         (B, P)    left-padded prompt ids
    responses       (B, R)    right-padded response ids
    input_ids       (B, P+R)  prompts ++ responses
    attention_mask  (B, P+R)  1 on real tokens
    position_ids    (B, P+R)  0.. over real tokens
    response_mask   (B, R)    1 on generated tokens (multi-turn: on the model's tokens, 0 on tool / environment ones)
    rollout_log_probs (B, R)  the rollout engine's log-probs of the sampled tokens
    index           (B,)      group id: rows sampled from the same prompt share it
    routed_experts  (B, P+R, n, k)  MoE, when the rollout recorded them: each token's top-k expert ids per MoE
                              layer, aligned with input_ids (tokens without routes: experts 0..k-1; routing replay)

Non-tensor fields (``data_source``, ``ground_truth``, ``extra_info``, ``uid``) are lists of length ``B``.

:func:`sequence_batch` lays whole token sequences out the same way, for a reward model's forward.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["build_batch", "last_response_token", "sequence_batch"]


def _pad_to(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def build_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                logprobs: Sequence[Sequence[float]], finish_reasons: Sequence[str], group_ids: Sequence[int],
                meta: dict[str, list[Any]], pad_token_id: int, pad_multiple: int = 8,
                response_masks: Sequence[Sequence[int] | None] | None = None,
                routes: Sequence[Any] | None = None) -> dict[str, Any]:
    """Rows are (prompt, response) pairs; ``meta`` holds per-row lists (data_source, ground_truth, ...).
    ``response_masks`` (multi-turn): per row, 1 on the model's tokens and 0 on the tool / environment tokens of
    its response (None: all 1); those tokens stay in ``attention_mask``. ``routes``: per row, the rollout's
    (len(prompt) + len(response) - 1, n, k) expert ids (`Sample.routes`), or None for every row."""
    B = len(prompts)
    P = _pad_to(max(len(p) for p in prompts), pad_multiple)
    R = _pad_to(max((len(r) for r in responses), default=1), pad_multiple)
    # filled row by row in numpy (a slice assignment there costs ~1 us, a torch one ~10: 512 rows x 6 of them)
    prompt_t = np.full((B, P), pad_token_id, dtype=np.int64)
    prompt_m = np.zeros((B, P), dtype=np.int64)
    resp_t = np.full((B, R), pad_token_id, dtype=np.int64)
    resp_m = np.zeros((B, R), dtype=np.int64)
    lp = np.zeros((B, R), dtype=np.float32)
    resp_valid = np.zeros((B, R), dtype=np.int64)
    for i, (p, r, lps) in enumerate(zip(prompts, responses, logprobs)):
        prompt_t[i, P - len(p):] = p
        prompt_m[i, P - len(p):] = 1
        if len(r):
            resp_t[i, :len(r)] = r
            resp_valid[i, :len(r)] = 1
            mask = response_masks[i] if response_masks is not None else None
            resp_m[i, :len(r)] = 1 if mask is None else np.asarray(mask, dtype=np.int64)
            lp[i, :len(r)] = lps
    prompt_t, prompt_m, resp_t, resp_m, lp, resp_valid = map(
        torch.from_numpy, (prompt_t, prompt_m, resp_t, resp_m, lp, resp_valid))
    attention_mask = torch.cat([prompt_m, resp_valid], dim=1)  # (B, P+R)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # (B, P+R)
    batch = {
        "prompts": prompt_t, "responses": resp_t, "input_ids": torch.cat([prompt_t, resp_t], dim=1),
        "attention_mask": attention_mask, "position_ids": position_ids, "response_mask": resp_m,
        "rollout_log_probs": lp, "index": torch.as_tensor(list(group_ids), dtype=torch.long),
        "truncated": torch.as_tensor([f == "length" for f in finish_reasons], dtype=torch.bool),
    }
    if routes is not None and any(r is not None for r in routes):
        batch["routed_experts"] = _routes_grid(prompts, responses, routes, P, R)
    batch.update(meta)
    return batch


def _routes_grid(prompts, responses, routes, P: int, R: int) -> torch.Tensor:
    """The rows' routes as (B, P+R, n, k), aligned with input_ids; the tokens a row has no routes for (padding, its
    last response token) get experts 0..k-1."""
    from rlhf_mcore.models.routing_replay import filler

    if any(r is None for r in routes):
        raise ValueError("some rows carry the rollout's expert routes and some do not: every row of a batch comes "
                         "from an engine that records them (rollout.enable_rollout_routing_replay), or none")
    n, k = routes[0].shape[1:]
    out = filler((len(prompts), P + R, n), k, dtype=routes[0].dtype)
    for i, (p, r, t) in enumerate(zip(prompts, responses, routes)):
        if t.shape[0] != len(p) + len(r) - 1:
            raise ValueError(f"row {i}: routes for {t.shape[0]} tokens, but its prompt ({len(p)}) and response "
                             f"({len(r)}) feed {len(p) + len(r) - 1} tokens to the model")
        out[i, P - len(p):P - len(p) + t.shape[0]] = t
    return out


def last_response_token(response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) the position of each row's last 1 in `response_mask` (B, R), where the sequence reward sits (0 for a
    row without one)."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)  # (R,)
    return (positions * response_mask.bool()).max(dim=1).values  # (B,)


def sequence_batch(sequences: list[list[int]], pad_token_id: int) -> dict:
    """The engine's batch layout for whole token sequences (each needs >= 2 tokens): all but the last token as the
    "prompt", the last as a one-token "response"; the score is read at that last token either way."""
    short = [i for i, s in enumerate(sequences) if len(s) < 2]
    if short:
        raise ValueError(f"sequence {short[0]} has {len(sequences[short[0]])} token(s); a reward model needs >= 2")
    n = len(sequences)
    return build_batch([s[:-1] for s in sequences], [s[-1:] for s in sequences], [[0.0]] * n, ["stop"] * n,
                       list(range(n)), {}, pad_token_id=pad_token_id)
