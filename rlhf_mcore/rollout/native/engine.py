"""The native rollout engine: continuous batching over a slot-based KV cache, CUDA-graph decode on GPU.

Scheduling (one `generate` call):
  - every (prompt, sample) pair is a sequence; sequences wait in input order;
  - when enough cache slots are free, waiting sequences are admitted and prefilled together (a prompt's
    tokens are computed once and written to the slots of all its admitted samples), producing each
    sequence's first token;
  - running sequences decode one token per step as one batch (rows); a finished sequence (stop token or
    max_new_tokens) hands its slot back and its row is compacted away; waiting ones take the slots.
Admission waits until `admit_fraction` of the slots are free (or nothing runs, or all remaining sequences
fit), so prefills run in batches instead of one prompt at a time between decode steps.

Per-row state lives in persistent device buffers that the decode step (and its CUDA graph) updates in
place: the step writes the sampled token into the row's input, advances positions, records the token and
log-prob in a per-slot response buffer and flags finished rows; the host only reads the flags.

Randomness: each sequence has a key from (seed, request id, sample index) and step t of it uses noise
hash(key, t, vocab id) (sampling.py), so seeded results do not depend on slots, batch composition or
`max_num_seqs`. (On GPU, GEMMs at different batch sizes can differ in the last bits, which can very rarely
flip a near-tie; on CPU runs are exactly batch-invariant in practice.)

Simplifications, on purpose: slot-based (not paged) cache sized max_num_seqs x max_model_len; no prefix
caching across calls; TP replicates the embedding and LM head; all TP ranks run the same scheduler on the
same inputs (the caller passes identical prompts), so they agree without extra communication.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from rlhf_mcore.models.hf_config import ModelShape

from ..base import (
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
from .attention import PackedLayout
from .graphs import DecodeGraphs, batch_buckets, bucket_for
from .model import KVCache, NativeModel
from .sampling import sample_torch, sequence_key
from .weights import ModelWeights, iter_safetensors

_MAX_STOP_IDS = 16


@dataclass
class _Seq:
    request: int          # index into the prompts of this generate call
    sample: int           # sample index within the request
    prompt: list[int]
    key: int              # random-stream key
    slot: int = -1


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class NativeRolloutEngine(RolloutEngine):
    """This project's inference engine for Qwen2 / Llama / Qwen3 HF checkpoints.

    model_dir: HF directory (config.json, *.safetensors, generation_config.json).
    max_num_seqs: concurrent sequences (KV-cache slots). max_model_len: prompt + response tokens per sequence.
    device / dtype: default cuda + bfloat16 when CUDA is available, else cpu + float32.
    tp_group: torch.distributed group to shard over (None: no tensor parallelism).
    cuda_graphs: capture decode steps (default on for CUDA). attention: "triton" | "torch" (default triton on
    CUDA). sampler: "triton" (fused kernel; default on CUDA) | "torch"; top-k/top-p always use torch.
    fused_kernels: Triton element-wise fusions in the layers and the step's bookkeeping (default on CUDA).
    decode_splits: key splits per sequence in decode attention (power of two; default: chosen per batch).
    weight_offload: what sleep(level=2) does with weights: "cpu" keeps a pinned CPU copy and restores
    it on wake(); "drop" frees them and requires update_weights() after wake().
    load_weights: False leaves weights uninitialised until update_weights() (e.g. the trainer syncs them).
    """

    def __init__(self, model_dir, *, max_num_seqs: int = 256, max_model_len: int = 2048, device=None,
                 dtype: torch.dtype | str | None = None, tp_group=None, cuda_graphs: bool | None = None,
                 attention: str | None = None, sampler: str | None = None, fused_kernels: bool | None = None,
                 decode_splits: int | None = None, max_prefill_tokens: int = 32768, admit_fraction: float = 0.125,
                 weight_offload: str = "cpu", load_weights: bool = True, show_progress: bool = False):
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"model_dir={str(model_dir)!r} is not a directory; pass a Hugging Face model "
                                    "directory (config.json + *.safetensors).")
        if max_num_seqs < 1 or max_model_len < 2:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1 and max_model_len={max_model_len} >= 2.")
        if weight_offload not in ("cpu", "drop"):
            raise ValueError(f"weight_offload={weight_offload!r}: choose 'cpu' (keep a CPU copy across sleep) "
                             "or 'drop' (re-send weights with update_weights after wake).")
        self.spec = ModelShape.from_hf_dir(self.model_dir)
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
        self.attention = attention or ("triton" if on_gpu else "torch")
        if self.attention not in ("triton", "torch"):
            raise ValueError(f"attention={self.attention!r}: choose 'triton' or 'torch'.")
        self.use_graphs = on_gpu if cuda_graphs is None else bool(cuda_graphs)
        if self.use_graphs and not on_gpu:
            raise ValueError("cuda_graphs=True needs a CUDA device; leave it unset on CPU.")
        sampler = sampler or ("triton" if on_gpu else "torch")
        if sampler not in ("triton", "torch"):
            raise ValueError(f"sampler={sampler!r}: choose 'triton' (fused kernel, GPU) or 'torch'.")
        self.use_triton_sampler = sampler == "triton"
        self.fused_kernels = on_gpu if fused_kernels is None else bool(fused_kernels)
        if decode_splits is not None and (decode_splits < 1 or decode_splits & (decode_splits - 1)):
            raise ValueError(f"decode_splits={decode_splits}: must be a power of two >= 1 (or None for automatic).")
        self.decode_splits = decode_splits
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_prefill_tokens, self.admit_fraction = max_prefill_tokens, admit_fraction
        self.weight_offload, self.show_progress = weight_offload, show_progress
        self.tp_group = tp_group
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self._stop_ids_default = read_eos_token_ids(self.model_dir)

        self.weights: ModelWeights | None = ModelWeights(self.spec, self.device, self.dtype, tp_rank, tp_size)
        self._missing_weights: set[str] = set(self.weights.expected_names())
        if load_weights:
            self.update_weights(iter_safetensors(self.model_dir))
        self.model = NativeModel(self.spec, self.weights, max_model_len + 1, tp_group, self.fused_kernels)
        self._cpu_weights: ModelWeights | None = None
        self.cache: KVCache | None = None
        self.graphs = DecodeGraphs()
        self.buckets = batch_buckets(max_num_seqs)
        self._alloc_row_buffers()
        self._allocate_cache()
        self.last_stats: dict = {}

    # ------------------------------------------------------------------------------------------------ state
    @property
    def default_stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_ids_default

    @property
    def scratch_slot(self) -> int:
        return self.max_num_seqs

    def _allocate_cache(self) -> None:
        w = self.weights
        self.cache = KVCache.allocate(self.spec.num_layers, self.max_num_seqs + 1, self.max_model_len + 1,
                                      w.kv_heads, self.spec.head_dim, self.device, self.dtype)

    def _alloc_row_buffers(self) -> None:
        n, dev = self.max_num_seqs, self.device

        def z(dtype, size=n):
            return torch.zeros(size, dtype=dtype, device=dev)

        self.r_tokens, self.r_pos, self.r_slot = z(torch.int64), z(torch.int64), z(torch.int64)
        self.r_key, self.r_step, self.r_limit = z(torch.int64), z(torch.int64), z(torch.int64)
        self.r_inv_temp, self.r_greedy = z(torch.float32), z(torch.bool)
        self.r_done = z(torch.bool)
        self.stop_ids = torch.full((_MAX_STOP_IDS,), -1, dtype=torch.int64, device=dev)
        # Per-slot responses: token and log-prob of every generated step (+1 column of slack for clamping).
        self.resp_tokens = torch.zeros(n + 1, self.max_model_len + 1, dtype=torch.int64, device=dev)
        self.resp_logprobs = torch.zeros(n + 1, self.max_model_len + 1, dtype=torch.float32, device=dev)
        self._done_host = torch.zeros(n, dtype=torch.bool, pin_memory=dev.type == "cuda")
        self._splits_cache: dict[int, int] = {}
        self._row_buffers = (self.r_tokens, self.r_pos, self.r_slot, self.r_key, self.r_step, self.r_limit,
                             self.r_inv_temp, self.r_greedy, self.r_done)

    def _check_ready(self) -> None:
        if self.weights is None or self.cache is None:
            raise RuntimeError("the native rollout engine is asleep; call wake() before generate().")
        if self._missing_weights:
            missing = sorted(self._missing_weights)
            raise RuntimeError(f"the native rollout engine has no values for {len(missing)} weights (e.g. "
                               f"{missing[:3]}); call update_weights() with the full model first "
                               "(needed after load_weights=False or sleep(level=2) with weight_offload='drop').")

    # ------------------------------------------------------------------------------------------ protocol
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.weights is None:
            raise RuntimeError("update_weights() while asleep at level 2: call wake() first, then update_weights().")
        loaded = self.weights.load(named_tensors)
        self._missing_weights -= loaded
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def sleep(self, level: int = 1) -> int:
        validate_sleep_level(level)
        freed = 0
        self.graphs.clear()
        if self.cache is not None:
            freed += self.cache.nbytes()
            self.cache = None
        if level == 2 and self.weights is not None:
            if self.weight_offload == "cpu" and self.device.type != "cpu":
                self._cpu_weights = self.weights.to("cpu", pin_memory=True)
                freed += self.weights.nbytes()
                self.weights = self.model = None  # the model holds the weights too
            elif self.weight_offload == "drop":
                freed += self.weights.nbytes()
                self.weights = self.model = None
            # weight_offload="cpu" on a CPU device: the weights already live in host memory; nothing to free.
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return freed

    def wake(self) -> None:
        if self.weights is None:
            if self._cpu_weights is not None:
                self.weights = self._cpu_weights.to(self.device, non_blocking=True)
                self._cpu_weights = None
            else:
                w = ModelWeights(self.spec, self.device, self.dtype, self.weights_tp_rank, self.weights_tp_size)
                self.weights = w
                self._missing_weights = set(w.expected_names())
            self.model = NativeModel(self.spec, self.weights, self.max_model_len + 1, self.tp_group,
                                     self.fused_kernels)
        if self.cache is None:
            self._allocate_cache()

    @property
    def weights_tp_rank(self) -> int:
        return dist.get_rank(self.tp_group) if self.tp_group is not None else 0

    @property
    def weights_tp_size(self) -> int:
        return dist.get_world_size(self.tp_group) if self.tp_group is not None else 1

    def shutdown(self) -> None:
        self.graphs.clear()
        self.cache = self.weights = self._cpu_weights = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------------ generate
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 request_ids: Sequence[int] | None = None) -> list[GenerationOutput]:
        self._check_ready()
        params = params.with_stop_ids(self._stop_ids_default)
        check_prompts(prompts, self.spec.vocab_size, self.max_model_len, params.max_new_tokens)
        if len(params.stop_token_ids) > _MAX_STOP_IDS:
            raise ValueError(f"{len(params.stop_token_ids)} stop_token_ids given; the native engine takes at most "
                             f"{_MAX_STOP_IDS}.")
        if request_ids is None:
            request_ids = range(len(prompts))
        elif len(request_ids) != len(prompts):
            raise ValueError(f"request_ids has {len(request_ids)} entries for {len(prompts)} prompts.")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        outputs = [GenerationOutput(prompt_ids=list(p), samples=[None] * params.n) for p in prompts]
        waiting = deque(_Seq(i, j, list(prompts[i]), sequence_key(seed, int(request_ids[i]), j))
                        for i in range(len(prompts)) for j in range(params.n))
        self.stop_ids.fill_(-1)
        if params.stop_token_ids:
            self.stop_ids[:len(params.stop_token_ids)] = torch.tensor(params.stop_token_ids)
        self._stop_set = set(params.stop_token_ids)
        self._params = params
        self._sampler_key = ("fused" if self.use_triton_sampler and not (params.top_k_active or params.top_p_active)
                             else f"torch-k{params.top_k if params.top_k_active else -1}"
                                  f"-p{params.top_p if params.top_p_active else 1.0}")
        self._rows: list[_Seq] = []
        self._row_pos = np.zeros(self.max_num_seqs, dtype=np.int64)  # host mirror of r_pos
        self._free_slots = list(range(self.max_num_seqs - 1, -1, -1))
        stats = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "prefills": 0,
                 "generated_tokens": 0, "prompt_tokens": 0}
        pbar = None
        if self.show_progress:
            from tqdm import tqdm

            pbar = tqdm(total=len(waiting), desc="generate", unit="seq")
        t_start = time.perf_counter()
        while waiting or self._rows:
            if waiting and self._should_admit(len(waiting)):
                t0 = time.perf_counter()
                finished = self._admit(waiting, stats)
                stats["prefill_s"] += time.perf_counter() - t0
                self._collect(finished, outputs, pbar)
            if self._rows:
                t0 = time.perf_counter()
                finished = self._decode_once()
                stats["decode_s"] += time.perf_counter() - t0
                stats["decode_steps"] += 1
                self._collect(finished, outputs, pbar)
        if pbar is not None:
            pbar.close()
        stats["total_s"] = time.perf_counter() - t_start
        stats["generated_tokens"] = sum(len(s.token_ids) for o in outputs for s in o.samples)
        self.last_stats = stats
        return outputs

    def _should_admit(self, n_waiting: int) -> bool:
        free = self.max_num_seqs - len(self._rows)
        if free == 0:
            return False
        return (not self._rows or n_waiting <= free
                or free >= max(1, int(self.admit_fraction * self.max_num_seqs)))

    # ---------------------------------------------------------------------------------------------- prefill
    def _admit(self, waiting: deque, stats: dict) -> list[tuple[_Seq, int]]:
        """Admit waiting sequences into free slots, prefill them, sample their first token.
        Returns the sequences that finished on that first token, as (seq, number of tokens = 1)."""
        free = self.max_num_seqs - len(self._rows)
        admitted: list[_Seq] = []
        prompt_order: dict[int, int] = {}  # request -> index among this prefill's unique prompts
        tokens_in_batch = 0
        while waiting and len(admitted) < free:
            seq = waiting[0]
            if seq.request not in prompt_order:
                if prompt_order and tokens_in_batch + len(seq.prompt) > self.max_prefill_tokens:
                    break
                prompt_order[seq.request] = len(prompt_order)
                tokens_in_batch += len(seq.prompt)
            waiting.popleft()
            seq.slot = self._free_slots.pop()
            admitted.append(seq)
        stats["prefills"] += 1
        stats["prompt_tokens"] += tokens_in_batch

        dev = self.device
        prompts = {}
        for seq in admitted:
            prompts.setdefault(seq.request, seq.prompt)
        unique = list(prompts.values())  # in prompt_order
        lengths = [len(p) for p in unique]
        layout = PackedLayout(lengths, dev)
        flat = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(unique), dtype=np.int64,
                                            count=sum(lengths))).to(dev)  # (N,)
        starts = np.cumsum([0] + lengths[:-1])
        w_tok, w_slot, w_pos = [], [], []
        for seq in admitted:
            p_idx = prompt_order[seq.request]
            n = lengths[p_idx]
            w_tok.append(np.arange(starts[p_idx], starts[p_idx] + n))
            w_slot.append(np.full(n, seq.slot))
            w_pos.append(np.arange(n))

        def t(parts):
            return torch.from_numpy(np.concatenate(parts)).to(dev)

        with torch.inference_mode():
            logits = self.model.prefill(flat, layout, self.cache, t(w_tok), t(w_slot), t(w_pos))  # (P, V)
            rows = torch.tensor([prompt_order[s.request] for s in admitted], device=dev)
            logits = logits.index_select(0, rows)  # (R, V)
            R = len(admitted)
            keys = torch.tensor([s.key for s in admitted], dtype=torch.int64, device=dev)
            steps = torch.zeros(R, dtype=torch.int64, device=dev)
            inv_temp, greedy = self._temperature_rows(R)
            tok, lp = self._sample(logits, keys, steps, inv_temp, greedy)
            slots = torch.tensor([s.slot for s in admitted], dtype=torch.int64, device=dev)
            self.resp_tokens[slots, 0] = tok
            self.resp_logprobs[slots, 0] = lp
            tok_host = tok.tolist()

        finished, keep = [], []
        for seq, first in zip(admitted, tok_host):
            if first in self._stop_set or self._params.max_new_tokens == 1:
                finished.append((seq, 1))
            else:
                keep.append((seq, first))
        if keep:
            self._append_rows(keep)
        return finished

    def _temperature_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self._params
        inv = 1.0 if p.greedy else 1.0 / p.temperature
        return (torch.full((n,), inv, dtype=torch.float32, device=self.device),
                torch.full((n,), p.greedy, dtype=torch.bool, device=self.device))

    def _sample(self, logits, keys, steps, inv_temp, greedy):
        p = self._params
        if self.use_triton_sampler and not (p.top_k_active or p.top_p_active):
            from .triton_kernels import sample_fused

            return sample_fused(logits, keys, steps, inv_temp, greedy)
        return sample_torch(logits, keys, steps, inv_temp, greedy,
                            top_k=p.top_k if p.top_k_active else -1, top_p=p.top_p if p.top_p_active else 1.0)

    def _append_rows(self, new: list[tuple[_Seq, int]]) -> None:
        b0, n, dev = len(self._rows), len(new), self.device
        sl = slice(b0, b0 + n)
        self.r_tokens[sl] = torch.tensor([f for _, f in new], dtype=torch.int64, device=dev)
        pos = [len(s.prompt) for s, _ in new]  # the first generated token is written at position len(prompt)
        self.r_pos[sl] = torch.tensor(pos, dtype=torch.int64, device=dev)
        self.r_slot[sl] = torch.tensor([s.slot for s, _ in new], dtype=torch.int64, device=dev)
        self.r_key[sl] = torch.tensor([s.key for s, _ in new], dtype=torch.int64, device=dev)
        self.r_step[sl] = 1
        self.r_limit[sl] = self._params.max_new_tokens
        inv, greedy = self._temperature_rows(n)
        self.r_inv_temp[sl], self.r_greedy[sl], self.r_done[sl] = inv, greedy, False
        self._row_pos[b0:b0 + n] = pos
        self._rows.extend(s for s, _ in new)

    # ----------------------------------------------------------------------------------------------- decode
    def _pad_rows(self, b: int, bb: int) -> None:
        """Point rows [b, bb) at the scratch slot so a padded batch computes harmlessly."""
        if bb > b:
            self.r_slot[b:bb] = self.scratch_slot
            self.r_pos[b:bb] = 0
            self.r_step[b:bb] = 0
            self.r_tokens[b:bb] = 0
            self.r_limit[b:bb] = 1 << 30

    def _decode_step(self, bb: int, attn_len: int, num_splits: int) -> None:
        """One decode step on rows [0, bb): everything here is captured into the CUDA graph."""
        slots, steps = self.r_slot[:bb], self.r_step[:bb]
        logits = self.model.decode(self.r_tokens[:bb], self.r_pos[:bb], slots, self.cache, self.attention,
                                   attn_len, num_splits)
        tok, lp = self._sample(logits, self.r_key[:bb], steps, self.r_inv_temp[:bb], self.r_greedy[:bb])
        if self.fused_kernels:
            from .triton_kernels import advance_rows

            advance_rows(tok, lp, slots, self.r_pos[:bb], steps, self.r_limit[:bb], self.r_tokens[:bb],
                         self.r_done[:bb], self.stop_ids, self.resp_tokens, self.resp_logprobs, self.max_model_len)
            return
        self.resp_tokens[slots, steps] = tok
        self.resp_logprobs[slots, steps] = lp
        self.r_tokens[:bb] = tok
        self.r_pos[:bb].add_(1).clamp_(max=self.max_model_len)
        steps.add_(1).clamp_(max=self.max_model_len)
        stop_hit = (tok[:, None] == self.stop_ids[None, :]).any(-1)
        self.r_done[:bb] = stop_hit | (steps >= self.r_limit[:bb])

    def _decode_once(self) -> list[tuple[_Seq, int]]:
        b = len(self._rows)
        if self.use_graphs:
            bb = bucket_for(b, self.buckets)
            self._pad_rows(b, bb)
            attn_len = 0
            if self.attention == "torch":
                need = int(self._row_pos[:b].max()) + 1
                attn_len = min(_round_up(need, 256), self.max_model_len + 1)
            splits = self._num_splits(bb)
            key = (bb, attn_len, splits, self._sampler_key)
            with torch.inference_mode():
                self.graphs.run(key, lambda: self._decode_step(bb, attn_len, splits),
                                lambda: self._scratch_state(bb))
        else:
            with torch.inference_mode():
                self._decode_step(b, int(self._row_pos[:b].max()) + 1, self._num_splits(b))
        self._row_pos[:b] += 1
        if self.device.type == "cuda":  # one small device->pinned copy and a sync per step
            flags = self._done_host[:b]
            flags.copy_(self.r_done[:b], non_blocking=True)
            torch.cuda.current_stream().synchronize()
            done = np.flatnonzero(flags.numpy()).tolist()
        else:
            done = self.r_done[:b].nonzero().flatten().tolist()
        if not done:
            return []
        done_set = set(done)
        steps_host = self.r_step[:b].tolist()
        finished = [(self._rows[i], steps_host[i]) for i in done]
        keep = [i for i in range(b) if i not in done_set]
        if keep:
            idx = torch.tensor(keep, dtype=torch.int64, device=self.device)
            for buf in self._row_buffers:
                buf[:len(keep)] = buf[:b].index_select(0, idx)
        self._rows = [self._rows[i] for i in keep]
        self._row_pos[:len(keep)] = self._row_pos[keep] if keep else self._row_pos[:0]
        return finished

    def _num_splits(self, bb: int) -> int:
        if self.attention != "triton":
            return 1
        if bb not in self._splits_cache:
            from .triton_kernels import num_splits_for

            self._splits_cache[bb] = self.decode_splits or num_splits_for(bb, self.weights.kv_heads,
                                                                          self.max_model_len, self.spec.head_dim)
        return self._splits_cache[bb]

    def _scratch_state(self, bb: int):
        """Before capture: save rows [0, bb) and point them at the scratch slot; returns the restorer."""
        saved = [buf[:bb].clone() for buf in self._row_buffers]
        self._pad_rows(0, bb)

        def restore():
            for buf, s in zip(self._row_buffers, saved):
                buf[:bb] = s

        return restore

    # ---------------------------------------------------------------------------------------------- results
    def _collect(self, finished: list[tuple[_Seq, int]], outputs: list[GenerationOutput], pbar) -> None:
        if not finished:
            return
        slots = torch.tensor([s.slot for s, _ in finished], dtype=torch.int64, device=self.device)
        width = max(n for _, n in finished)
        toks = self.resp_tokens[slots, :width].tolist()
        lps = self.resp_logprobs[slots, :width].tolist()
        for (seq, n), tk, lp in zip(finished, toks, lps):
            tk, lp = tk[:n], lp[:n]
            reason = FINISH_STOP if tk[-1] in self._stop_set else FINISH_LENGTH
            outputs[seq.request].samples[seq.sample] = Sample(token_ids=tk, logprobs=lp, finish_reason=reason)
            self._free_slots.append(seq.slot)
        if pbar is not None:
            pbar.update(len(finished))
