"""The colocated rollout of a vision-language policy: the training chunks themselves decode the action tokens.

Why not the native rollout engine (README, "VLA (in progress)"): an action chunk is a few dozen tokens after a prompt
of image tokens, so the engine's KV cache and CUDA-graph decode buy little, while the Megatron chunks already run the
tower at any TP/PP, need no weight sync, and give log-probs that are the trainer's own.

`decode(chunks, state, input_ids, pixel_values, new_tokens=..., token_range=(lo, hi))` runs one forward pass per new
token through Megatron's pipeline schedule (no KV cache: every step re-reads the whole row; the tower runs once, its
projected features are reused), samples each token from the last position's logits restricted to ids
`lo <= id < hi` (an action vocabulary on the last K ids; None: the whole vocabulary) at `temperature` (0: greedy),
and returns the tokens (B, n) and their log-probabilities under that restricted, tempered distribution (B, n;
greedy: untempered) — the trainer must score actions the same way. A collective over the replica's TP x PP ranks
(every rank passes the same rows and a generator in the same state); rows may be left-padded (`prompt_mask` False on
the padding). Virtual pipeline stages are refused.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _last_logits(chunks, state, ids, mask, features) -> Optional[torch.Tensor]:
    """(B, V) logits at the last position of `ids`, TP-gathered, on the last pipeline stage (None elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pos = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
    attention = None
    if mask is not None:  # causal, and no key on the left padding (True = masked out, Megatron's convention)
        causal = torch.tril(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device))
        attention = ~(causal[None] & mask[:, None, :])[:, None]

    def step(data_iter, model):
        next(data_iter)
        out = model(ids, pos, attention, image_features=features)
        return out, lambda output: (output.sum() * 0.0, {"last": output[:, -1].detach().clone()})

    with torch.no_grad():
        res = get_forward_backward_func()(forward_step_func=step, data_iterator=iter(range(1)), model=chunks[0],
                                          num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
                                          forward_only=True)
    if not state.is_last_stage:
        return None
    last = res[0]["last"]  # (B, V / TP)
    if state.dims.tp > 1:
        parts = [torch.empty_like(last) for _ in range(state.dims.tp)]
        dist.all_gather(parts, last.contiguous(), group=state.tp_group)
        last = torch.cat(parts, dim=-1)
    return last


def decode(chunks, state, input_ids: torch.Tensor, pixel_values: torch.Tensor, *, new_tokens: int,
           token_range: Optional[tuple[int, int]] = None, temperature: float = 1.0,
           generator: Optional[torch.Generator] = None, prompt_mask: Optional[torch.Tensor] = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `new_tokens` tokens after each row of `input_ids` (B, S) with its images `pixel_values` (N, C, H, W);
    returns (tokens (B, new_tokens) int64, log-probs (B, new_tokens) float32). See the module docstring."""
    from rlhf_mcore.models.hf_loader import unwrap_model

    if len(chunks) != 1:
        raise ValueError(f"decode runs one model chunk per rank; got {len(chunks)} (virtual pipeline stages): "
                         "build the policy without virtual_pipeline_model_parallel_size for the rollout.")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: use 0 (greedy) or a positive value.")
    model = unwrap_model(chunks[0])
    vocab = model.hf_shape.vocab_size
    lo, hi = token_range if token_range is not None else (0, vocab)
    if not 0 <= lo < hi <= vocab:
        raise ValueError(f"token_range={token_range}: need 0 <= lo < hi <= vocab_size={vocab}.")
    features = None
    if model.pre_process:
        with torch.no_grad():
            features = model.image_embeddings(pixel_values)
    ids, mask = input_ids, prompt_mask
    b = ids.shape[0]
    tokens = torch.empty(b, new_tokens, dtype=torch.long, device=ids.device)
    logprobs = torch.empty(b, new_tokens, dtype=torch.float32, device=ids.device)
    for t in range(new_tokens):
        last = _last_logits(chunks, state, ids, mask, features)
        step = torch.empty(b, 2, dtype=torch.float32, device=ids.device)  # (token, log-prob), sent over PP
        if last is not None:
            logits = last[:, lo:hi].float()  # (B, K): the allowed ids only
            if temperature == 0:
                choice = logits.argmax(-1)
                logp = torch.log_softmax(logits, -1)
            else:
                logp = torch.log_softmax(logits / temperature, -1)
                choice = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            step[:, 0] = (choice + lo).float()
            step[:, 1] = logp.gather(-1, choice[:, None]).squeeze(-1)
        if state.dims.pp > 1:
            dist.broadcast(step, src=dist.get_process_group_ranks(state.pp_group)[-1], group=state.pp_group)
        tokens[:, t], logprobs[:, t] = step[:, 0].long(), step[:, 1]
        ids = torch.cat([ids, tokens[:, t:t + 1]], dim=1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.bool, device=mask.device)], dim=1)
    return tokens, logprobs
