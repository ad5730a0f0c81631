"""Hugging Face `generate` as a rollout engine: the correctness and speed reference for the native engine.

Sampling uses transformers' own warpers (temperature, top-k, top-p), but passed as explicit logits
processors followed by a recorder, because transformers applies its built-in warpers after any custom
processor: the recorder must see the distribution the token is actually drawn from. Log-probs are
`log_softmax` of those processed scores at the sampled token; the recorder keeps one step of scores at a
time (not all (B, V) steps), so memory stays flat in the response length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import torch

from rlhf_mcore import trace

from .base import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    RolloutEngine,
    Sample,
    SamplingParams,
    check_prompts,
    read_eos_token_ids,
    validate_sleep_level,
)


class _LogprobRecorder:
    """Logits processor that records the log-prob of each sampled token under the processed scores.

    Called with step t's scores; the token sampled from them appears as input_ids[:, -1] at step t + 1's call
    (or in the final sequences, see `finish`)."""

    def __init__(self):
        self.prev: torch.Tensor | None = None  # (B, V) log-probs of the previous step
        self.steps: list[torch.Tensor] = []  # each (B,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(B, T) log-probs of all generated tokens."""
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, sequences[:, -1:]).squeeze(-1))
            self.prev = None
        return torch.stack(self.steps, dim=1)


def check_loading_info(model_dir, info: dict) -> None:
    """transformers initialises a parameter the checkpoint lacks at random and drops a tensor no parameter takes,
    with a printed table only: either means the directory is not the model its config.json describes."""
    from rlhf_mcore.models.safetensors_check import ModelFileError

    for key, what in (("missing_keys", "lacks tensors that config.json needs"),
                      ("unexpected_keys", "holds tensors that belong to no parameter of the model config.json "
                                          "describes")):
        names = sorted(info.get(key) or ())
        if names:
            raise ModelFileError(f"model directory {model_dir}: its checkpoint {what} (e.g. {names[:3]}, "
                                 f"{len(names)} in all); check that the download is complete, that it is the "
                                 "right model directory, and its config.json's architectures.")


class HFRolloutEngine(RolloutEngine):
    """Rollouts through `AutoModelForCausalLM.generate` (left-padded batches of `batch_size` prompts).

    device / dtype: default cuda + bfloat16 when CUDA is available, else cpu + float32.
    """

    def __init__(self, model_dir, *, device=None, dtype: torch.dtype | str | None = None, batch_size: int = 64,
                 attn_implementation: str = "sdpa", show_progress: bool = False):
        from transformers import AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").exists():
            raise FileNotFoundError(f"model_dir={str(model_dir)!r} has no config.json; pass a Hugging Face model "
                                    "directory.")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        model, info = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=self.dtype, attn_implementation=attn_implementation, output_loading_info=True)
        check_loading_info(self.model_dir, info)
        self.model = model.to(self.device).eval()
        self.batch_size, self.show_progress = batch_size, show_progress
        self._stop_ids_default = read_eos_token_ids(self.model_dir)
        gen_pad = getattr(self.model.generation_config, "pad_token_id", None)
        self.pad_id = gen_pad if gen_pad is not None else (self._stop_ids_default or (0,))[0]
        self._asleep = 0

    @property
    def default_stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_ids_default

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 request_ids: Sequence[int] | None = None) -> list[GenerationOutput]:
        """Generate with transformers. `request_ids` is accepted for API parity; HF sampling uses torch's global
        RNG (seeded from params.seed per call), so seeded results depend on batching here."""
        if self._asleep == 2:
            raise RuntimeError("the HF rollout engine is asleep at level 2; call wake() before generate().")
        params = params.with_stop_ids(self._stop_ids_default)
        check_prompts(prompts, self.model.config.vocab_size)
        outputs = []
        chunks = range(0, len(prompts), self.batch_size)
        if self.show_progress:
            from tqdm import tqdm

            chunks = tqdm(chunks, desc="generate (hf)", unit="batch")
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            tokens = 0
            for start in chunks:
                batch = self._generate_batch(prompts[start:start + self.batch_size], params)
                outputs += batch
                tokens += sum(len(s.token_ids) for out in batch for s in out.samples)
                trace.progress(tokens=tokens)  # the console's phase indicator: tokens so far
        return outputs

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        from transformers import (
            GenerationConfig,
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        processors = []
        if not params.greedy:
            if params.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k_active:
                processors.append(TopKLogitsWarper(top_k=params.top_k))
            if params.top_p_active:
                processors.append(TopPLogitsWarper(top_p=params.top_p))
        recorder = _LogprobRecorder()
        processors.append(recorder)
        stop = list(params.stop_token_ids)
        gen_cfg = GenerationConfig(
            do_sample=not params.greedy, temperature=1.0, top_k=None, top_p=1.0, max_new_tokens=params.max_new_tokens,
            num_return_sequences=params.n, eos_token_id=stop or None, pad_token_id=self.pad_id,
            bos_token_id=None,
        )
        with torch.inference_mode():
            seqs = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                       generation_config=gen_cfg, logits_processor=LogitsProcessorList(processors))
            logprobs = recorder.finish(seqs).cpu()
        responses = seqs[:, width:].cpu()
        stop_set = set(stop)
        outputs = []
        for i, p in enumerate(prompts):
            out = GenerationOutput(prompt_ids=list(p))
            for j in range(params.n):
                row = i * params.n + j
                toks = responses[row].tolist()
                n_tok, reason = len(toks), FINISH_LENGTH
                for t_idx, tok in enumerate(toks):
                    if tok in stop_set:
                        n_tok, reason = t_idx + 1, FINISH_STOP
                        break
                out.samples.append(Sample(token_ids=toks[:n_tok], logprobs=logprobs[row, :n_tok].tolist(),
                                          finish_reason=reason))
            outputs.append(out)
        return outputs

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name == "lm_head.weight" and tied:
                    continue
                if name not in params:
                    raise KeyError(f"update_weights: {name!r} is not a parameter of {type(self.model).__name__}.")
                if params[name].shape != tensor.shape:
                    raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(params[name].shape)}.")
                params[name].copy_(tensor)

    def hf_weight_shards(self) -> list:
        """The model's parameters, full tensors: (name, tensor, None, 0, 1) each (the sync verifier's readback)."""
        # named_parameters() lists a tied lm_head once, under the embedding's name, as the export does
        return [(name, p.detach(), None, 0, 1) for name, p in self.model.named_parameters()]

    def sleep(self, level: int = 1) -> int:
        """Level 1 frees nothing (transformers builds its KV cache per call); level 2 moves weights to CPU."""
        validate_sleep_level(level)
        freed = 0
        if level == 2 and self.device.type == "cuda":
            freed = sum(p.numel() * p.element_size() for p in self.model.parameters())
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = level
        return freed

    def wake(self) -> None:
        if self._asleep == 2 and self.device.type == "cuda":
            self.model.to(self.device)
        self._asleep = 0
