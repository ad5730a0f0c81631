"""A reward model on the train engine: one scalar per sequence, read at its last real token, and the
Bradley-Terry objective that trains it.

The model is a GPTModel with a width-1 head without bias (`build_model(..., role="reward")`: a Hugging Face
`*ForSequenceClassification` with `num_labels=1`). Like transformers' sequence classifiers it returns the head's
output at the last non-padding token of each sequence; every other position is ignored.

Scoring (:meth:`RewardEngine.compute_scores`) is a forward-only pass through the same micro-batching, packing and
pipeline schedule as the actor's log-probs, so TP / PP / DP layouts work unchanged. Training
(:meth:`TrainEngine.update`) uses :func:`bradley_terry_loss`: the batch holds preference pairs as adjacent rows
(chosen at an even row `2k`, its rejected response at `2k + 1`), micro-batches are a fixed even number of rows, so
no pair is split, and the loss `-log sigmoid(s_chosen - s_rejected)` is averaged over all pairs of the
mini-batch (all DP ranks), exactly as the actor's loss is normalised (:mod:`rlhf_mcore.engine.losses`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_mcore.engine.losses import LossContext
from rlhf_mcore.engine.micro_batches import MicroBatch, batch_size_of
from rlhf_mcore.engine.packing import ModelInputs
from rlhf_mcore.engine.train_engine import TrainEngine

__all__ = ["RewardEngine", "last_token_scores", "bradley_terry_loss"]


def last_token_scores(output: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """The head's output (`(B', S, 1)` padded or `(1, total, 1)` packed) at each sequence's last real token: (B,)."""
    lengths = torch.tensor(inputs.seqlens, device=output.device)  # (B,)
    if inputs.packed:
        rows = torch.cumsum(lengths, 0) - 1  # (B,) sequences are concatenated in order
    else:
        seq = inputs.input_ids.shape[1]
        rows = torch.arange(len(inputs.seqlens), device=output.device) * seq + lengths - 1  # (B,)
    return output.reshape(-1).index_select(0, rows).float()  # (B,)


def bradley_terry_loss(output: torch.Tensor, mb: MicroBatch, ctx: LossContext) -> tuple[torch.Tensor, dict]:
    """`-log sigmoid(s_chosen - s_rejected)` of this micro-batch's pairs, as its share of the mean over the
    mini-batch's pairs (`ctx.global_seqs / 2`); metrics `bt_loss`, `accuracy` (s_chosen > s_rejected) and
    `margin` (mean s_chosen - s_rejected) are shares too, summing to mini-batch means."""
    index = mb.index
    if index.numel() % 2 or not bool(((index[0::2] % 2 == 0) & (index[1::2] == index[0::2] + 1)).all()):
        raise ValueError("Bradley-Terry micro-batches must hold whole pairs (chosen at row 2k, rejected at 2k + 1): "
                         "use an even fixed micro-batch size, no dynamic batching and no shuffling of rows")
    scores = last_token_scores(output, mb.inputs).view(-1, 2)  # (pairs, 2): chosen, rejected
    margin = scores[:, 0] - scores[:, 1]  # (pairs,)
    pairs = ctx.global_seqs / 2
    loss = -F.logsigmoid(margin).sum() / pairs
    metrics = {"bt_loss": loss.detach(), "accuracy": (margin > 0).float().sum() / pairs,
               "margin": margin.detach().sum() / pairs, "loss": loss.detach()}
    return loss * ctx.scale, metrics


class RewardEngine(TrainEngine):
    """A :class:`TrainEngine` of role "reward": built without an optimizer it is frozen (scoring only)."""

    SCORES_RESPONSE_ROWS = False  # its scores are the head's output at each sequence's last token

    def __init__(self, chunks, state, cfg, optim=None, **kwargs):
        if cfg.role != "reward":
            raise ValueError(f"RewardEngine needs an EngineConfig with role='reward', got {cfg.role!r}")
        super().__init__(chunks, state, cfg, optim, **kwargs)

    @torch.no_grad()
    def compute_scores(self, batch: dict) -> torch.Tensor:
        """The score of each sequence (prompt + response of the batch's rows), fp32 `(B,)`, on every rank of the
        model replica, on the device of `batch["input_ids"]`."""
        B = batch_size_of(batch)

        def collect(output, mb: MicroBatch):
            s = last_token_scores(output, mb.inputs)  # (b,)
            return {"score": s[:, None].expand(-1, mb.inputs.response_length).contiguous()}  # (b, R): repeated

        grid = self._forward_only(batch, collect, ("score",))["score"]  # (B, R)
        return grid[:B, 0]

    def loss_inputs(self, batch: dict):
        return ("response_mask",), bradley_terry_loss
