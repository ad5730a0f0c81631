"""The VLA policy around a LLaVA train engine: observations -> prompts, action chunks <-> tokens, training rows.

A prompt is the image's `tokens_per_image` image tokens (images as prefix embeddings), then the instruction's
tokens left-filled with the tokenizer's pad id to the longest instruction the env can give (real tokens, attended:
every prompt has the same length, so no row needs a mask and the rollout's and the trainer's positions agree).
The response is the chunk's C*A action tokens, on the `num_bins` ids just below the tokenizer's special tokens
(`action_range`; the image token is the last id of a tiny LLaVA), de-tokenized with the demonstrations' q01/q99.

`act(obs, generator, temperature)` decodes one chunk for a batch of observations through
:func:`rlhf_mcore.models.vision.decode.decode` (the engine's own chunks; log-probs under the softmax over the
action ids at `temperature`); `batch(images, instructions, tokens, response_mask)` builds the engine's padded
batch (input_ids = prompt + response, `pixel_values` one image per row) for `compute_log_probs` / `update`, whose
`token_range` is the same action range, so the trainer scores the tokens as the rollout drew them.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from rlhf_mcore.vla.actions import ActionStats, ActionTokenizer


def action_range(tokenizer, vocab_size: int, num_bins: int) -> tuple[int, int]:
    """(lo, hi): the `num_bins` ids below the special tokens at the end of the vocabulary."""
    special = set(tokenizer.all_special_ids)
    hi = min(vocab_size, len(tokenizer))
    while hi - 1 in special:
        hi -= 1
    if hi - num_bins < 1:
        raise ValueError(f"vla.num_bins={num_bins} does not fit the vocabulary of {hi} ids below its special tokens")
    return hi - num_bins, hi


def all_instructions(tasks, colors, directions=("left", "right", "top", "bottom")) -> list[str]:
    """Every instruction ReachPush can give for this task mix (the prompt is padded to the longest)."""
    out = []
    if "reach" in tasks:
        out += [f"reach the {c} block" for c in colors]
    if "push" in tasks:
        out += [f"push the {c} block to the {d}" for c, d in itertools.product(colors, directions)]
    return out


def pixel_values(images: np.ndarray) -> torch.Tensor:
    """(N, H, W, 3) uint8 -> (N, 3, H, W) float32 in [-1, 1] (SigLIP's mean 0.5, std 0.5)."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float()
    return (x / 255.0 - 0.5) / 0.5


class VLAPolicy:
    def __init__(self, engine, tokenizer, *, chunk: int, action_dim: int, num_bins: int, stats: ActionStats,
                 instructions: list[str]):
        model = engine.chunks[0]
        vocab = model.hf_shape.vocab_size
        self.engine, self.tokenizer = engine, tokenizer
        self.lo, self.hi = action_range(tokenizer, vocab, num_bins)
        self.actions = ActionTokenizer(vocab_size=self.hi, num_bins=num_bins, chunk=chunk, action_dim=action_dim,
                                       stats=stats)
        self.image_token_id = model.vision.image_token_id
        self.tokens_per_image = model.vision.tokens_per_image
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._ids = {s: tokenizer(s, add_special_tokens=False)["input_ids"] for s in instructions}
        self.text_len = max(len(v) for v in self._ids.values())

    @property
    def token_range(self) -> tuple[int, int]:
        return self.lo, self.hi

    def prompts(self, instructions: list[str]) -> torch.Tensor:
        """(B, P + L) int64: image tokens, then each instruction left-filled with the pad id."""
        rows = []
        for s in instructions:
            ids = self._ids.get(s)
            if ids is None:
                raise ValueError(f"instruction {s!r} is not one the policy was built for (vla.tasks / vla.colors)")
            rows.append([self.image_token_id] * self.tokens_per_image + [self.pad_id] * (self.text_len - len(ids))
                        + list(ids))
        return torch.tensor(rows, dtype=torch.long)

    def act(self, obs: dict, generator, temperature: float) -> dict:
        """One action chunk per observation: `actions` (b, C, A), `tokens` (b, C*A), `log_probs` (b, C*A)."""
        from rlhf_mcore.models.vision.decode import decode

        ids = self.prompts(list(obs["instruction"])).to(self.engine.state.device)
        images = pixel_values(obs["image"]).to(self.engine.state.device)
        for m in self.engine.modules:
            m.eval()
        tokens, logps = decode(self.engine.chunks, self.engine.state, ids, images,
                               new_tokens=self.actions.tokens_per_chunk, token_range=self.token_range,
                               temperature=temperature, generator=generator)
        tokens, logps = tokens.cpu().numpy(), logps.cpu().numpy()
        return {"actions": self.actions.detokenize(tokens), "tokens": tokens, "log_probs": logps}

    def batch(self, images: np.ndarray, instructions: list[str], tokens: np.ndarray,
              response_mask: np.ndarray) -> dict:
        """The engine's batch for rows of (image, instruction, action tokens): prompt + response, no padding."""
        prompt = self.prompts(instructions)
        responses = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
        ids = torch.cat([prompt, responses], dim=1)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": responses,
                "response_mask": torch.as_tensor(np.asarray(response_mask), dtype=torch.float32),
                "pixel_values": pixel_values(images)}
