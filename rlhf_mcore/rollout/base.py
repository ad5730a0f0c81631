"""The rollout-engine protocol: sampling parameters, generation outputs, and the engine interface.

Every backend (native, Hugging Face, SGLang) takes token-id prompts and returns, for each prompt, `n`
sampled responses with the log-probability of every sampled token and why the sample stopped. The trainer
only talks to this interface, so backends are interchangeable.

Log-probability convention (all backends): the log-prob of a sampled token under the distribution it was
actually sampled from — `log_softmax(logits / temperature)`, renormalised over the tokens kept by top-k /
top-p when those are active. With top-k and top-p off this equals a teacher-forced forward pass whose logits
are divided by the same temperature, which is what the actor recomputes. Greedy decoding (temperature 0)
reports `log_softmax(logits)`, the temperature-1 distribution. A backend that cannot renormalise (SGLang does
not return the kept mass) reports the full-vocabulary `log_softmax(logits / temperature)` under top-k / top-p
too, and says so with `logprobs_renormalised = False`.

Responses include the stop token that ended them (as vLLM/SGLang return it), so `finish_reason == "stop"`
means `token_ids[-1]` is one of the stop ids.

Streaming (engines with `supports_streaming`, today the native one): `open_stream(params)`, then `submit`
`Request`s at any time, call `step()` until `num_pending` is 0 and collect the `Finished` samples it returns;
`abort()` hands back everything in flight (finish reason "abort") so that it can be resubmitted later as
continuations (`Request.prefix`), e.g. after a weight update. Requests of one conversation may share a
`Request.session`, letting the engine keep its KV cache between them (`release(session)` at the end).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

import torch

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature == 0` means greedy; `top_k <= 0` and `top_p == 1` disable those filters.

    stop_token_ids: tokens that end a sample (included in the response). None -> the model's eos ids
      (generation_config.json, else config.json); an empty tuple -> never stop early.
    seed: makes sampling reproducible; sample `j` of request `r` gets its own random stream derived from
      (seed, request id, j), so results do not depend on batching. None -> drawn from torch's global RNG.
    ignore_eos: generate exactly `max_new_tokens` tokens (benchmarks).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n!r}: the number of samples per prompt must be an int >= 1.")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature!r}: must be a finite number >= 0 "
                             "(0 means greedy decoding).")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p!r}: must be in (0, 1]; use 1.0 to disable "
                             "nucleus sampling.")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise ValueError(f"SamplingParams.top_k={self.top_k!r}: must be an int >= 1, or -1 (or 0) to "
                             "disable top-k filtering.")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens!r}: must be an int >= 1.")
        if self.stop_token_ids is not None and not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids={self.stop_token_ids!r}: must be non-negative "
                             "token ids (or None for the model's eos ids).")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"SamplingParams.seed={self.seed!r}: must be a non-negative int or None.")
        if self.greedy and self.n > 1:
            raise ValueError(f"SamplingParams(temperature=0, n={self.n}): greedy decoding gives n identical "
                             "samples; use temperature > 0 for several samples, or n=1.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def top_k_active(self) -> bool:
        return self.top_k > 0 and not self.greedy

    @property
    def top_p_active(self) -> bool:
        return self.top_p < 1.0 and not self.greedy

    @classmethod
    def for_validation(cls, max_new_tokens: int, stop_token_ids: Sequence[int] | None = None) -> "SamplingParams":
        """Validation mode: greedy, one sample per prompt."""
        return cls(n=1, temperature=0.0, max_new_tokens=max_new_tokens,
                   stop_token_ids=None if stop_token_ids is None else tuple(stop_token_ids))

    def with_stop_ids(self, default_stop_ids: Sequence[int]) -> "SamplingParams":
        """Resolve `stop_token_ids=None` to the model's defaults (and `ignore_eos` to no stop ids)."""
        if self.ignore_eos:
            return replace(self, stop_token_ids=())
        if self.stop_token_ids is None:
            return replace(self, stop_token_ids=tuple(default_stop_ids))
        return self


@dataclass
class Sample:
    """One sampled response: its tokens, their log-probs (same length) and why it ended. `routes` (a MoE model in
    an engine that records them; R3 replays them): the (P + T - 1, n, k) expert ids each MoE layer routed each token
    fed to the model to -- the P prompt tokens and the T response tokens but the last, which is never fed back."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # FINISH_STOP | FINISH_LENGTH | FINISH_ABORT
    routes: Any = None  # torch.Tensor (P + T - 1, n, k), integers (models.routing_replay.route_dtype), or None


@dataclass
class Request:
    """One sample to generate, submitted to a running engine (`RolloutEngine.submit`).

    request_id: with the stream's seed and `sample`, keys this sample's random stream: token t of the
      response (prefix tokens counted) is drawn with step t of it, so a continuation whose prefix is an
      aborted sample reproduces the uninterrupted sample under unchanged weights.
    sample: the sample index j (the j-th of a prompt's n samples).
    prefix: a continuation's tokens (and their log-probs) already generated for this sample; the finished
      sample holds prefix + new tokens.
    max_new_tokens: cap on the response length, prefix included; None -> the stream's params.max_new_tokens.
    tag: the caller's handle, returned untouched in `Finished.request`.
    session: a hashable key tying the turns of one conversation together (None: none). An engine that can
      keeps a finished session's KV cache (`retained`), and the session's next request prefills only the tokens
      after the longest prefix it shares with that cache; results are the same with or without the reuse.
      The caller drops a session with `engine.release(session)` when its conversation ends.
    """

    request_id: int
    prompt_ids: list[int]
    sample: int = 0
    prefix: Sample | None = None
    max_new_tokens: int | None = None
    tag: Any = None
    session: Any = None


@dataclass
class Finished:
    """A request that left the engine: the whole response (prefix + new tokens) and why it ended
    (finish_reason "stop" | "length" | "abort")."""

    request: Request
    sample: Sample


@dataclass
class GenerationOutput:
    """All `n` samples for one prompt, in sample order."""

    prompt_ids: list[int]
    samples: list[Sample] = field(default_factory=list)


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_len: int | None = None,
                  max_new_tokens: int = 0) -> None:
    """Raise ValueError naming the prompt if one is empty, has an out-of-vocabulary id, or is too long."""
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}.")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token.")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompt {i} has token id {lo if lo < 0 else hi} outside [0, {vocab_size}); "
                             "was it tokenized with another model's tokenizer?")
        if max_len is not None and len(p) + max_new_tokens > max_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens + max_new_tokens={max_new_tokens} > the engine's "
                             f"max_model_len={max_len}; raise max_model_len or shorten the prompt.")


class RolloutEngine(abc.ABC):
    """What the trainer needs from an inference engine (colocated with training).

    Lifecycle in RL: `wake()` -> `generate(...)` -> `sleep()` -> (training) -> `update_weights(...)` -> ...
    """

    #: whether reported log-probs are renormalised over the tokens top-k / top-p keep (see the module docstring)
    logprobs_renormalised: bool = True
    #: whether the streaming methods (open_stream ... close_stream) are implemented
    supports_streaming: bool = False

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 request_ids: Sequence[int] | None = None) -> list[GenerationOutput]:
        """Sample `params.n` responses for each prompt. Output i belongs to prompts[i].

        request_ids: per-prompt ids that key the seeded random streams (default: 0..len-1), so a prompt
        generated alone with the same request id and seed reproduces its samples.
        """

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) tensors named as in the Hugging Face checkpoint; may be called in buckets."""

    def finish_weight_update(self) -> dict[str, float]:
        """Called once after the last `update_weights` bucket of a sync: work that needs the whole new model (the
        native engine's FP8 quantization). Returns metrics named without the `sync/` prefix ({} by default)."""
        return {}

    @abc.abstractmethod
    def sleep(self, level: int = 1) -> int:
        """Free GPU memory for training. Level 1: the KV cache; level 2: also the weights (offloaded or
        dropped; see the backend). Returns the number of bytes freed (best effort)."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Re-allocate what `sleep` freed."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release all resources."""

    # ------------------------------------------------------------------------------------------- streaming
    def _no_streaming(self) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} does not stream; use the native engine "
                                   "(actor_rollout_ref.rollout.name=native)")

    def open_stream(self, params: SamplingParams) -> None:
        """Start a stream sampling with `params` (params.n is ignored: each Request is one sample)."""
        raise self._no_streaming()

    def submit(self, requests: Sequence[Request]) -> None:
        """Queue requests; allowed at any time while the stream is open (continuous batching)."""
        raise self._no_streaming()

    def step(self) -> list[Finished]:
        """Admit waiting requests into free slots (prefill) and run one decode step; returns the samples
        that finished during it."""
        raise self._no_streaming()

    def abort(self) -> list[Finished]:
        """Hand back every waiting and running request with its tokens so far (finish reason "abort"); the
        stream stays open."""
        raise self._no_streaming()

    @property
    def num_pending(self) -> int:
        """Requests submitted and not yet returned (waiting + running)."""
        raise self._no_streaming()

    def close_stream(self) -> None:
        """End the stream."""
        raise self._no_streaming()

    def release(self, session) -> None:  # noqa: B027 - engines that retain no KV cache have nothing to drop
        """Drop whatever the engine keeps for `Request.session` `session` (no-op if nothing is kept)."""

    @property
    def default_stop_token_ids(self) -> tuple[int, ...]:
        return ()


def validate_sleep_level(level: int) -> None:
    if level not in (1, 2):
        raise ValueError(f"sleep(level={level!r}): level must be 1 (free the KV cache) or 2 (KV cache and weights).")


def read_eos_token_ids(model_dir) -> tuple[int, ...]:
    """The model's stop ids: generation_config.json's eos_token_id, else config.json's (int or list)."""
    import json
    from pathlib import Path

    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                ids = [eos] if isinstance(eos, int) else list(eos)
                break
    return tuple(int(i) for i in ids)
