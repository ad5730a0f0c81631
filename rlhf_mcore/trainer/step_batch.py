"""A step's rows as the padded training batch, the same for every mode."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from rlhf_mcore.data.batch import build_batch, last_response_token
from rlhf_mcore.data.rows import Row


def rows_to_batch(rows: Sequence[Row], prompt_ids: Sequence[int], train_set, pad_token_id: int,
                  greedy_baseline: bool = False) -> dict[str, Any]:
    """This DP rank's rows as the padded batch; `prompt_ids[r.prompt_pos]` is row r's dataset index.
    The reward sits on the last model token (`token_level_scores`); `greedy_baseline` (ReMax): the baselines'
    rewards as `reward_baselines` (B,)."""
    by_prompt = {pos: train_set[prompt_ids[pos]] for pos in {r.prompt_pos for r in rows}}  # one lookup a group
    items = [by_prompt[r.prompt_pos] for r in rows]
    meta = {key: [it[key] for it in items] for key in ("data_source", "ground_truth")}
    batch = build_batch([r.prompt_ids for r in rows], [r.response_ids for r in rows], [r.logprobs for r in rows],
                        [r.finish_reason for r in rows], [r.prompt_pos for r in rows], meta,
                        pad_token_id=pad_token_id, response_masks=[r.response_mask for r in rows],
                        routes=[r.routes for r in rows])
    last = last_response_token(batch["response_mask"])  # (B,) the reward sits on the last model token
    scores = torch.tensor([r.score for r in rows])
    batch["token_level_scores"] = torch.zeros_like(batch["rollout_log_probs"]).scatter(
        1, last[:, None], scores[:, None])  # (B, R)
    if greedy_baseline:
        batch["reward_baselines"] = torch.tensor([r.baseline_score for r in rows])  # (B,)
    return batch
