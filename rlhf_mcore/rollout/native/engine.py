"""The native rollout engine: continuous batching over a slot-based KV cache, CUDA-graph decode on GPU.

Scheduling (a stream: `open_stream`, `submit` at any time, `step` until nothing is pending; `generate`
submits every (prompt, sample) pair up front and steps to the end):
  - every submitted request is one sequence (one sample); sequences wait in submission order;
  - when enough cache slots are free, waiting sequences are admitted and prefilled together (an input —
    prompt + a continuation's prefix — shared by sequences of one request id is computed once and written to
    the slots of all of them), producing each sequence's next token;
  - running sequences decode one token per step as one batch (rows); a finished sequence (stop token or its
    max_new_tokens) hands its slot back and its row is compacted away; waiting ones take the slots;
  - `abort` hands back everything in flight with its tokens so far; resubmitted with those tokens as
    `prefix`, a sequence carries on where it stopped (prefill over prompt + prefix).
Sessions (`Request.session`, a conversation's turns): a session's request that finishes (stop or length) keeps
its slot, "retained" with the tokens whose keys/values it holds (prompt + response but the last sampled token,
which was never fed back). The session's next request takes that slot and prefills only the tokens after the
longest prefix it shares with them (at least its last token), attending to the cached ones; with nothing in
common it prefills everything, like any request. Retained slots count as free: an admission that finds no
free slot evicts the least recently retained one. `release(session)` drops one; abort, close_stream,
update_weights and sleep drop them all (new weights invalidate the cache). Reuse never changes results beyond
the last bits (cached keys/values were computed token by token in decode steps rather than in one prefill pass).
Admission waits until `admit_fraction` of the slots are free (or nothing runs, or all remaining sequences
fit), so prefills run in batches instead of one prompt at a time between decode steps.

Per-row state lives in persistent device buffers that the decode step (and its CUDA graph) updates in
place: the step writes the sampled token into the row's input, advances positions, records the token and
log-prob in a per-slot response buffer and flags finished rows; the host only reads the flags. A launch runs
`decode_steps_per_launch` steps (one CUDA graph; a flagged row holds still for the rest of it), and one launch stays
in flight: launch t+1 is made before the host reads launch t's flags back, so that reading (a wait, the compaction
of finished rows) overlaps the GPU's work instead of leaving it idle between launches. A row finished in launch t
runs on in t+1 without advancing (its keys/values land past its end and are never read). Finished rows' tokens are
copied to the host behind the launch in flight and returned by the next step() (`num_pending` counts them until
then), so a step where rows finish does not wait for the GPU either; abort() reads everything in flight back
first, so requests it finished come back with their own reason.

Randomness: each sequence has a key from (seed, request id, sample index) and response token t of it (prefix
tokens counted) uses noise hash(key, t, vocab id) (sampling.py), so seeded results do not depend on slots,
batch composition, `max_num_seqs` or being aborted and continued. (A continuation's prefill computes the
prefix's keys and values in one pass rather than token by token, and on GPU, GEMMs at different batch sizes
can differ in the last bits; either can very rarely flip a near-tie. On CPU, runs are exactly
batch-invariant in practice.)

Simplifications, on purpose: slot-based (not paged) cache sized max_num_seqs x max_model_len; prefixes are
reused only within a session (no prefix cache shared across requests); TP replicates the embedding and LM
head; all TP ranks run the same scheduler on the same inputs (the caller passes identical prompts, sessions
and releases), so they agree without extra communication.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from rlhf_mcore import trace
from rlhf_mcore.models.hf_config import ModelShape
from rlhf_mcore.models.safetensors_check import ModelFileError

from ..base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Finished,
    GenerationOutput,
    Request,
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
# Decode steps one launch runs (one CUDA-graph replay, or one eager call) before the host reads finished flags back:
# k steps in one graph leave out k - 1 of the host's turns and of the gaps between graphs; a row that finishes
# inside a launch stays put for the rest of it (its finished flag holds, nothing more is recorded), so the results
# are those of k = 1. The engine's `decode_steps_per_launch` (None: this).
DECODE_STEPS_PER_LAUNCH = 1


@dataclass
class _Seq:
    request: Request
    key: int              # random-stream key
    tokens: list[int]     # prefill input: prompt + prefix tokens
    prefill_key: tuple    # (request id, input tokens): sequences with equal keys share one prefill
    n_prefix: int         # response tokens already there (a continuation's prefix)
    limit: int            # cap on the response length, prefix included
    slot: int = -1
    reused: int = 0       # leading tokens whose keys/values its slot already held at admission
    src_slot: int = -1    # the slot its decode attention reads the first `shared_len` keys/values from
    shared_len: int = 0   # (SHARE_PROMPT_READS: a prompt prefilled once for several rows)


@dataclass
class _InFlight:
    """A decode step launched and not read back yet: the rows it ran on (in row order) and where its finished
    flags and step counts land on the host once `event` (CUDA) has passed."""

    rows: list[_Seq]
    flags: torch.Tensor   # (b,) bool, host
    steps: torch.Tensor   # (b,) int64, host: each row's response length after the step
    event: "torch.cuda.Event | None"


@dataclass
class _Collecting:
    """Finished rows whose tokens and log-probs are being copied to the host behind the step in flight."""

    finished: list[tuple[_Seq, int]]
    tokens: torch.Tensor    # (R, width) int64, host (page-locked on CUDA)
    logprobs: torch.Tensor  # (R, width) float32, host (page-locked on CUDA)
    event: "torch.cuda.Event | None"


@dataclass
class _Retained:
    """A finished session's slot and the tokens whose keys/values it holds (positions 0..len-1)."""

    slot: int
    tokens: list[int]


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit`."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# The rows of one prefilled prompt (a request's samples) read the prompt's keys and values from one slot in the Triton
# decode attention, not each from its own copy (the same values: the prefill wrote them to every slot), so a group's
# rows, decoded side by side, read one set of addresses (L2) instead of n. A row whose source slot was freed reads
# from another live row of its group (`retarget_sources`). Tests turn it off for the reference run.
SHARE_PROMPT_READS = True


def retarget_sources(src: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Each row's source slot after rows left: a row whose source is no longer any live row's own slot takes, with
    the rest of its group (the rows that had that source), the own slot of the group's first live row. src, own:
    (b,) int, the live rows' source and own slots."""
    live = set(own.tolist())
    out = src.copy()
    for s in set(src.tolist()) - live:
        members = np.flatnonzero(src == s)
        out[members] = own[members[0]]
    return out


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
    quantization: "fp8" runs the decoder linears as e4m3 copies refreshed after every weight sync (fp8.py): in
    `finish_weight_update` at the sync's end, else at the next generation (`last_stats["fp8_quantize_s"]`);
    fp8_layout "channel" (default) or "block" scales; None: the model's dtype. fp8_decode: how a fused (CUDA)
    decode step multiplies by the FP8 weights: "w8a8" (default; activations quantized per token, then the Triton
    decode GEMMs on FP8 x FP8 products with "channel" scales -- `model.FP8_TRITON_DECODE` -- or cuBLAS's FP8 GEMM;
    measured in BENCHMARKS.md) or "w8a16" (the Triton decode GEMMs read the FP8 codes and scale each output
    channel; activations stay bf16, no quantization kernels; QKV in FP8 too, inside the fused QKV + RoPE + cache
    kernel; "channel" scales only; slower than bf16 at 7B). Prefill is w8a8 on cuBLAS in both.
    kv_cache_dtype: "auto" (the model's dtype) or "fp8_e4m3": keys and values cached as e4m3 codes with one fp32
    scale per token and head (kv_cache.py), half the bytes each decode step's attention reads; a prompt's own
    prefill attends over its exact keys, every later step over the cached codes. Needs an FP8 GPU, like
    quantization; independent of it.
    record_routes (MoE models; routing replay R3): every sample comes back with `Sample.routes`, the top-k expert
    ids each MoE layer routed each of its tokens to (a per-slot, per-position buffer written by every prefill and
    decode step; a continuation's prefix is routed again by its prefill, under the weights of that time).
    """

    supports_streaming = True

    def __init__(self, model_dir, *, max_num_seqs: int = 256, max_model_len: int = 2048, device=None,
                 dtype: torch.dtype | str | None = None, tp_group=None, cuda_graphs: bool | None = None,
                 attention: str | None = None, sampler: str | None = None, fused_kernels: bool | None = None,
                 decode_splits: int | None = None, max_prefill_tokens: int = 32768, admit_fraction: float = 0.125,
                 weight_offload: str = "cpu", load_weights: bool = True, show_progress: bool = False,
                 quantization: str | None = None, fp8_layout: str | None = None, fp8_decode: str = "w8a8",
                 kv_cache_dtype: str = "auto", record_routes: bool = False,
                 decode_steps_per_launch: int | None = None):
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
        # a MoE model's expert groups change size with the routing: its decode steps run without graphs
        self.use_graphs = on_gpu and not self.spec.is_moe if cuda_graphs is None else bool(cuda_graphs)
        if self.use_graphs and not on_gpu:
            raise ValueError("cuda_graphs=True needs a CUDA device; leave it unset on CPU.")
        if record_routes and not self.spec.is_moe:
            raise ValueError(f"record_routes=True needs a mixture-of-experts model; {self.spec.architecture} has no "
                             "experts (actor_rollout_ref.rollout.enable_rollout_routing_replay: unset it).")
        if record_routes and self.use_graphs:
            raise ValueError("record_routes=True records routes in eager decode steps: set cuda_graphs=False.")
        self.record_routes = record_routes
        sampler = sampler or ("triton" if on_gpu else "torch")
        if sampler not in ("triton", "torch"):
            raise ValueError(f"sampler={sampler!r}: choose 'triton' (fused kernel, GPU) or 'torch'.")
        self.use_triton_sampler = sampler == "triton"
        self.fused_kernels = on_gpu if fused_kernels is None else bool(fused_kernels)
        if decode_splits is not None and (decode_splits < 1 or decode_splits & (decode_splits - 1)):
            raise ValueError(f"decode_splits={decode_splits}: must be a power of two >= 1 (or None for automatic).")
        self.decode_splits = decode_splits
        k = DECODE_STEPS_PER_LAUNCH if decode_steps_per_launch is None else decode_steps_per_launch
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"decode_steps_per_launch={decode_steps_per_launch!r}: give an int >= 1 (decode steps run "
                             "by one launch, one CUDA graph replay) or None for the default.")
        self.decode_steps_per_launch = k
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_prefill_tokens, self.admit_fraction = max_prefill_tokens, admit_fraction
        self.weight_offload, self.show_progress = weight_offload, show_progress
        self.tp_group = tp_group
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self._stop_ids_default = read_eos_token_ids(self.model_dir)

        if quantization not in (None, "fp8"):
            raise ValueError(f"actor_rollout_ref.rollout.quantization={quantization!r}: choose fp8 or null.")
        if fp8_decode not in ("w8a8", "w8a16"):
            raise ValueError(f"fp8_decode={fp8_decode!r}: choose w8a8 or w8a16.")
        if fp8_decode == "w8a16" and (fp8_layout or "channel") != "channel":
            raise ValueError(f"fp8_decode='w8a16' reads one scale per output channel; fp8_layout={fp8_layout!r} "
                             "has 128 x 128 blocks: use fp8_layout='channel' or fp8_decode='w8a8'.")
        if kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"actor_rollout_ref.rollout.kv_cache_dtype={kv_cache_dtype!r}: choose auto (the model's "
                             "dtype) or fp8_e4m3.")
        if kv_cache_dtype == "fp8_e4m3":
            from rlhf_mcore.rollout.native import fp8 as native_fp8

            native_fp8.check_fp8_device(self.device, "actor_rollout_ref.rollout.kv_cache_dtype", kv_cache_dtype)
        self.kv_fp8 = kv_cache_dtype == "fp8_e4m3"
        self.quantization, self.fp8_layout, self.fp8_decode = quantization, fp8_layout, fp8_decode
        self._fp8 = None  # fp8.Fp8Layers with quantization="fp8"
        self._fp8_stale = True  # the bf16 weights changed since the last quantization
        self._retained: OrderedDict = OrderedDict()  # session -> _Retained, least recently retained first
        self.weights: ModelWeights | None = ModelWeights(self.spec, self.device, self.dtype, tp_rank, tp_size)
        self._missing_weights: set[str] = set(self.weights.expected_names())
        if load_weights:
            self._load_checkpoint()
        self.model = NativeModel(self.spec, self.weights, max_model_len + 1, tp_group, self.fused_kernels)
        self._attach_fp8()
        self._cpu_weights: ModelWeights | None = None
        self.cache: KVCache | None = None
        self.graphs = DecodeGraphs()
        self.buckets = batch_buckets(max_num_seqs)
        self._alloc_row_buffers()
        self._allocate_cache()
        self.last_stats: dict = {}
        self._stream_open = False
        self._waiting: deque[_Seq] = deque()
        self._rows: list[_Seq] = []  # running sequences, in row order
        self._ready: list[Finished] = []  # finished at submit, returned by the next step()
        self._collecting: list[_Collecting] = []  # finished, their tokens on their way to the host

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
                                      w.kv_heads, self.spec.head_dim, self.device, self.dtype, fp8=self.kv_fp8)

    def _alloc_row_buffers(self) -> None:
        n, dev = self.max_num_seqs, self.device

        def z(dtype, size=n):
            return torch.zeros(size, dtype=dtype, device=dev)

        self.r_tokens, self.r_pos, self.r_slot = z(torch.int64), z(torch.int64), z(torch.int64)
        self.r_key, self.r_step, self.r_limit = z(torch.int64), z(torch.int64), z(torch.int64)
        self.r_inv_temp, self.r_greedy = z(torch.float32), z(torch.bool)
        self.r_done = z(torch.bool)
        self.r_src, self.r_shared = z(torch.int64), z(torch.int64)  # decode attention: (source slot, its keys)
        self.stop_ids = torch.full((_MAX_STOP_IDS,), -1, dtype=torch.int64, device=dev)
        # Per-slot responses: token and log-prob of every generated step (+1 column of slack for clamping).
        self.resp_tokens = torch.zeros(n + 1, self.max_model_len + 1, dtype=torch.int64, device=dev)
        self.resp_logprobs = torch.zeros(n + 1, self.max_model_len + 1, dtype=torch.float32, device=dev)
        # two host copies of the finished flags and step counts: the step in flight writes one while the host
        # reads the other (_launch / _read_back)
        on_cuda = dev.type == "cuda"
        self._done_host = torch.zeros(2, n, dtype=torch.bool, pin_memory=on_cuda)
        self._steps_host = torch.zeros(2, n, dtype=torch.int64, pin_memory=on_cuda)
        self._events = [torch.cuda.Event() for _ in range(2)] if on_cuda else [None, None]
        self._flip = 0
        self._inflight: _InFlight | None = None
        self.seq_routes = None  # (slots + 1, max_len + 1, moe layers, k): each slot's routes by position
        if self.record_routes:
            from rlhf_mcore.models.routing_replay import route_dtype

            spec = self.spec
            self.seq_routes = torch.zeros(n + 1, self.max_model_len + 1, len(spec.moe_layers), spec.moe_top_k,
                                          dtype=route_dtype(spec.num_experts), device=dev)
        self._splits_cache: dict[int, int] = {}
        self._row_buffers = (self.r_tokens, self.r_pos, self.r_slot, self.r_key, self.r_step, self.r_limit,
                             self.r_inv_temp, self.r_greedy, self.r_done, self.r_src, self.r_shared)

    def _load_checkpoint(self) -> None:
        """The model directory's safetensors into the weights; what does not fit config.json is the user's problem
        (a `ModelFileError` naming the directory and the tensor), unlike a bad name in a trainer's weight push."""
        try:
            self.update_weights(iter_safetensors(self.model_dir))
        except (KeyError, ValueError, FileNotFoundError) as e:
            if isinstance(e, ModelFileError):
                raise
            why = e.args[0] if isinstance(e, KeyError) else str(e)  # str() of a KeyError adds quotes
            raise ModelFileError(f"model directory {self.model_dir}: {why} Is it the model its config.json "
                                 "describes?") from e
        if self._missing_weights:
            missing = sorted(self._missing_weights)
            raise ModelFileError(f"model directory {self.model_dir}: its safetensors lack {len(missing)} tensors "
                                 f"that config.json needs (e.g. {missing[:3]}); check that the download is "
                                 "complete and that it is the right model directory.")

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
        self._drop_retained()  # keys/values computed with the old weights
        loaded = self.weights.load(named_tensors)
        self._missing_weights -= loaded
        self._fp8_stale = True
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def sleep(self, level: int = 1) -> int:
        validate_sleep_level(level)
        if self._rows:
            raise RuntimeError(f"sleep() with {len(self._rows)} requests running in the open stream would lose "
                               "their KV cache; call abort() first and resubmit them as continuations after wake().")
        freed = 0
        self._inflight = None  # a step launched after the last rows finished: nothing to read back
        self._drop_retained()
        self.graphs.clear()
        if self.cache is not None:
            freed += self.cache.nbytes()
            self.cache = None
        if level == 2 and self.weights is not None:
            if self.weight_offload == "cpu" and self.device.type != "cpu":
                self._cpu_weights = self.weights.to("cpu", pin_memory=True)
                freed += self.weights.nbytes()
                self.weights = self.model = self._fp8 = None  # the model holds the weights too
            elif self.weight_offload == "drop":
                freed += self.weights.nbytes()
                self.weights = self.model = self._fp8 = None
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
            self._attach_fp8()
        if self.cache is None:
            self._allocate_cache()

    def _attach_fp8(self) -> None:
        """With quantization="fp8": FP8 copies of the model's linears (filled by the next _refresh_fp8)."""
        if self.quantization is None:
            return
        from .fp8 import DEFAULT_LAYOUT, LINEARS, LINEARS_W8A16, Fp8Layers

        names = LINEARS_W8A16 if self.fp8_decode == "w8a16" else LINEARS
        self._fp8 = Fp8Layers(self.weights, self.fp8_layout or DEFAULT_LAYOUT, names)
        self.model.fp8, self.model.fp8_decode = self._fp8.layers, self.fp8_decode
        self._fp8_stale = True

    def finish_weight_update(self) -> dict[str, float]:
        """The end of a sync: with quantization="fp8" the FP8 copies are refreshed here, inside the sync (its
        seconds are `sync/fp8_quantize_seconds`), rather than at the next generation."""
        return {"fp8_quantize_seconds": self._refresh_fp8()} if self._fp8 is not None else {}

    def _refresh_fp8(self) -> float:
        """Quantize the weights once after a sync (however many update_weights buckets it took); the seconds."""
        if self._fp8 is None or not self._fp8_stale:
            return 0.0
        seconds = self._fp8.quantize_(self.weights)
        self._fp8_stale = False
        return seconds

    def hf_weight_shards(self) -> list:
        """The weights in HF layout, (name, tensor, dim, rank, size) per tensor (:mod:`.hf_shards`)."""
        from .hf_shards import hf_weight_shards

        return hf_weight_shards(self.weights)

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
                 request_ids: Sequence[int] | None = None,
                 max_new_tokens: Sequence[int] | None = None) -> list[GenerationOutput]:
        """Sample `params.n` responses per prompt: one stream, every (prompt, sample) submitted up front.
        max_new_tokens: a response budget per prompt (each at most `params.max_new_tokens`)."""
        self._check_ready()
        check_prompts(prompts, self.spec.vocab_size, self.max_model_len, params.max_new_tokens)
        if request_ids is None:
            request_ids = range(len(prompts))
        elif len(request_ids) != len(prompts):
            raise ValueError(f"request_ids has {len(request_ids)} entries for {len(prompts)} prompts.")
        self.open_stream(params)
        try:
            outputs = [GenerationOutput(prompt_ids=list(p), samples=[None] * params.n) for p in prompts]
            if max_new_tokens is not None and len(max_new_tokens) != len(prompts):
                raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {len(prompts)} prompts.")
            caps = [None] * len(prompts) if max_new_tokens is None else [int(c) for c in max_new_tokens]
            self.submit([Request(int(request_ids[i]), prompts[i], sample=j, tag=i, max_new_tokens=caps[i])
                         for i in range(len(prompts)) for j in range(params.n)])
            pbar = None
            if self.show_progress:
                from tqdm import tqdm

                pbar = tqdm(total=self.num_pending, desc="generate", unit="seq")
            while self.num_pending:
                finished = self.step()
                for f in finished:
                    outputs[f.request.tag].samples[f.request.sample] = f.sample
                if pbar is not None and finished:
                    pbar.update(len(finished))
            if pbar is not None:
                pbar.close()
        finally:
            self.close_stream()
        return outputs

    # ------------------------------------------------------------------------------------------- streaming
    def open_stream(self, params: SamplingParams) -> None:
        """Start a stream sampling with `params`; params.n is ignored (each Request is one sample).
        params.seed=None draws the stream's seed from torch's global RNG."""
        if self._stream_open:
            raise RuntimeError(f"open_stream(): a stream is already open ({self.num_pending} requests pending); "
                               "call close_stream() first (generate() runs a stream of its own too).")
        self._check_ready()
        quantize_s = self._refresh_fp8()
        params = params.with_stop_ids(self._stop_ids_default)
        if len(params.stop_token_ids) > _MAX_STOP_IDS:
            raise ValueError(f"{len(params.stop_token_ids)} stop_token_ids given; the native engine takes at most "
                             f"{_MAX_STOP_IDS}.")
        self._seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.stop_ids.fill_(-1)
        if params.stop_token_ids:
            self.stop_ids[:len(params.stop_token_ids)] = torch.tensor(params.stop_token_ids)
        self._stop_set = set(params.stop_token_ids)
        self._params = params
        self._sampler_key = ("fused" if self.use_triton_sampler and not (params.top_k_active or params.top_p_active)
                             else f"torch-k{params.top_k if params.top_k_active else -1}"
                                  f"-p{params.top_p if params.top_p_active else 1.0}")
        self._waiting, self._rows, self._ready = deque(), [], []
        self._retained = OrderedDict()
        self._row_pos = np.zeros(self.max_num_seqs, dtype=np.int64)  # host mirror of r_pos
        self._row_step = np.zeros(self.max_num_seqs, dtype=np.int64)  # ... of r_step after the steps launched
        self._row_limit = np.zeros(self.max_num_seqs, dtype=np.int64)  # ... of r_limit
        self._row_src = np.zeros(self.max_num_seqs, dtype=np.int64)  # ... of r_src
        self._inflight = None
        self._collecting: list[_Collecting] = []
        self._free_slots = list(range(self.max_num_seqs - 1, -1, -1))
        # prompt_tokens: tokens prefilled; reused_tokens: tokens admitted sequences found in their session's slot
        self._stats = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "prefills": 0,
                       "generated_tokens": 0, "prompt_tokens": 0, "reused_tokens": 0}
        self._captures_at_open = self.graphs.captures
        if self.quantization is not None:
            self._stats["fp8_quantize_s"] = quantize_s
        self._t_open = time.perf_counter()
        self._sampled = 0  # new tokens sampled in this stream so far (the console's progress: trace.progress)
        self._stream_open = True

    def submit(self, requests: Sequence[Request]) -> None:
        """Queue requests (all checked before any is queued). A continuation whose prefix already reached its
        cap or ends in a stop token needs no compute: it is returned by the next step()."""
        self._require_stream("submit")
        for seq in self._to_seqs(requests):
            prefix = seq.request.prefix
            if seq.n_prefix and (prefix.token_ids[-1] in self._stop_set or seq.n_prefix >= seq.limit):
                reason = FINISH_STOP if prefix.token_ids[-1] in self._stop_set else FINISH_LENGTH
                self._ready.append(Finished(seq.request, Sample(list(prefix.token_ids), list(prefix.logprobs),
                                                                reason, prefix.routes)))
            else:
                self._waiting.append(seq)

    def step(self) -> list[Finished]:
        """Admit waiting requests into free slots (one batched prefill) and make one decode launch over the
        running ones (`decode_steps_per_launch` steps, one by default); returns the requests that finished during
        it."""
        self._require_stream("step")
        self._check_ready()
        finished, self._ready = self._ready, []
        if self._waiting:  # admission may need the slots of the rows being collected (its prefill waits anyway)
            finished += self._finish_collecting()
        stats = self._stats
        if self._waiting and self._should_admit(len(self._waiting)):
            t0 = time.perf_counter()
            running = len(self._rows)
            done = self._admit()
            stats["prefill_s"] += time.perf_counter() - t0
            self._sampled += len(self._rows) - running + len(done)  # each admitted sequence's first token
            finished += self._collect(done)
        if self._rows:
            t0 = time.perf_counter()
            done = self._decode_once()
            stats["decode_s"] += time.perf_counter() - t0
            finished += self._finish_collecting()  # only now: waiting for them before the launch would idle the GPU
            finished += self._collect_later(done)
        else:
            finished += self._finish_collecting()
        trace.progress(tokens=self._sampled)
        return finished

    def abort(self) -> list[Finished]:
        """Hand back every waiting and running request with its tokens so far (prefix included), finish reason
        "abort"; requests that had already finished come back with their own reason. The stream stays open;
        retained sessions are dropped (an abort usually precedes a weight update)."""
        self._require_stream("abort")
        self._drain()
        self._drop_retained()
        out, self._ready = self._ready, []
        if self._rows:
            steps = self.r_step[:len(self._rows)].tolist()  # response length so far (prefix + new) per row
            out += self._collect(list(zip(self._rows, steps)), reason=FINISH_ABORT)
            self._rows = []
        for seq in self._waiting:
            prefix = seq.request.prefix
            tokens, logprobs = (list(prefix.token_ids), list(prefix.logprobs)) if prefix is not None else ([], [])
            out.append(Finished(seq.request, Sample(tokens, logprobs, FINISH_ABORT,
                                                    prefix.routes if prefix is not None else None)))
        self._waiting.clear()
        return out

    @property
    def num_pending(self) -> int:
        """Requests submitted and not yet returned: waiting + running (+ finished at submit or read back from a
        decode step, returned by the next step()). 0 when no stream is open."""
        return (len(self._waiting) + len(self._rows) + len(self._ready)
                + sum(len(c.finished) for c in self._collecting))

    def close_stream(self) -> None:
        """End the stream (no-op when none is open); requests still pending are dropped (abort() first to get
        them back). The stream's counters become `last_stats`."""
        if not self._stream_open:
            return
        self._stats["total_s"] = time.perf_counter() - self._t_open
        # decode CUDA graphs captured in this stream: a count above 0 at every step means they are being dropped
        # between streams (sleep clears them) or the batch buckets keep changing
        self._stats["graph_captures"] = self.graphs.captures - self._captures_at_open
        self.last_stats = self._stats
        self._waiting, self._rows, self._ready = deque(), [], []
        self._inflight, self._collecting = None, []
        self._retained = OrderedDict()
        self._stream_open = False

    def release(self, session) -> None:
        """Hand back the slot retained for `session` (no-op if none is, or no stream is open)."""
        held = self._retained.pop(session, None)
        if held is not None:
            self._free_slots.append(held.slot)

    @property
    def num_retained(self) -> int:
        """Slots held for finished sessions."""
        return len(self._retained)

    def _drop_retained(self) -> None:
        for held in self._retained.values():
            self._free_slots.append(held.slot)
        self._retained.clear()

    def _retain(self, session, slot: int, tokens: list[int]) -> None:
        old = self._retained.pop(session, None)
        if old is not None:  # the session had two requests in flight: keep the later one's cache
            self._free_slots.append(old.slot)
        self._retained[session] = _Retained(slot, tokens)

    def _take_slot(self) -> int:
        """A free slot; with none left, the least recently retained session's (admission only asks for one
        when free + retained slots suffice)."""
        if self._free_slots:
            return self._free_slots.pop()
        _, held = self._retained.popitem(last=False)
        self._stats["evicted_sessions"] = self._stats.get("evicted_sessions", 0) + 1
        return held.slot

    def _require_stream(self, method: str) -> None:
        if not self._stream_open:
            raise RuntimeError(f"{method}() before open_stream(params): open a stream first "
                               "(generate() opens and closes its own).")

    def _to_seqs(self, requests: Sequence[Request]) -> list[_Seq]:
        """Check requests and make their sequences; ValueError names the bad request."""
        if isinstance(requests, Request):
            raise ValueError("submit() takes a sequence of Requests; wrap a single one in a list.")
        default_cap = self._params.max_new_tokens
        checked: dict[int, tuple[list[int], tuple[int, ...]]] = {}  # id(prompt_ids) -> (copy, as a tuple)
        seqs = []
        for r in requests:
            if not isinstance(r, Request):
                raise ValueError(f"submit() got a {type(r).__name__}; pass rlhf_mcore.rollout.Request objects.")
            name = f"request {r.request_id!r} (sample {r.sample!r})"
            try:
                request_id, sample = operator.index(r.request_id), operator.index(r.sample)
            except TypeError:
                raise ValueError(f"{name}: request_id and sample must be ints.") from None
            if sample < 0:
                raise ValueError(f"{name}: sample={sample} must be >= 0.")
            cap = default_cap if r.max_new_tokens is None else r.max_new_tokens
            if not isinstance(cap, int) or cap < 1:
                raise ValueError(f"{name}: max_new_tokens={r.max_new_tokens!r} must be an int >= 1 (or None for the "
                                 f"stream's max_new_tokens={default_cap}).")
            entry = checked.get(id(r.prompt_ids))
            if entry is None:
                prompt = list(r.prompt_ids)
                if not prompt:
                    raise ValueError(f"{name}: prompt_ids is empty; every prompt needs at least one token.")
                self._check_vocab(name, "prompt_ids", prompt)
                entry = checked[id(r.prompt_ids)] = (prompt, tuple(prompt))
            prompt, prefill_tokens = entry
            if len(prompt) + cap > self.max_model_len:
                raise ValueError(f"{name}: prompt_ids has {len(prompt)} tokens + max_new_tokens={cap} > the engine's "
                                 f"max_model_len={self.max_model_len}; raise max_model_len, lower max_new_tokens or "
                                 "shorten the prompt.")
            tokens, n_prefix = prompt, 0
            if r.prefix is not None:
                n_prefix = len(r.prefix.token_ids)
                if len(r.prefix.logprobs) != n_prefix:
                    raise ValueError(f"{name}: prefix has {n_prefix} token_ids but {len(r.prefix.logprobs)} "
                                     "logprobs; pass the Sample the engine returned.")
                if n_prefix > cap:
                    raise ValueError(f"{name}: prefix has {n_prefix} tokens, beyond the cap max_new_tokens={cap} "
                                     "(the cap counts the prefix); raise the request's max_new_tokens.")
                if n_prefix:
                    self._check_vocab(name, "prefix", r.prefix.token_ids)
                    tokens = prompt + list(r.prefix.token_ids)
                    prefill_tokens = tuple(tokens)
            seqs.append(_Seq(r, sequence_key(self._seed, request_id, sample), tokens, (request_id, prefill_tokens),
                             n_prefix, cap))
        return seqs

    def _check_vocab(self, name: str, field: str, ids: Sequence[int]) -> None:
        lo, hi, vocab = min(ids), max(ids), self.spec.vocab_size
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{name}: {field} has token id {lo if lo < 0 else hi} outside [0, {vocab}); was it "
                             "tokenized with another model's tokenizer?")

    def _should_admit(self, n_waiting: int) -> bool:
        free = self.max_num_seqs - len(self._rows)
        if free == 0:
            return False
        return (not self._rows or n_waiting <= free
                or free >= max(1, int(self.admit_fraction * self.max_num_seqs)))

    # ---------------------------------------------------------------------------------------------- prefill
    def _admit(self) -> list[tuple[_Seq, int]]:
        """Admit waiting sequences into free slots, prefill them, sample their first new token.
        Returns the sequences that finished on that token, as (seq, response length)."""
        waiting = self._waiting
        free = self.max_num_seqs - len(self._rows)  # free + retained slots
        admitted: list[_Seq] = []
        unique: list[list[int]] = []  # this prefill's distinct fresh inputs
        prompt_order: dict[tuple, int] = {}  # prefill key -> index into unique
        cont: list[_Seq] = []  # sequences prefilling after their session's cached prefix, one input each
        tokens_in_batch = 0
        while waiting and len(admitted) < free:
            seq = waiting[0]
            session = seq.request.session
            held = self._retained.get(session) if session is not None else None
            # keep at least the last token to prefill: its logits give the first new token
            reuse = _common_prefix(held.tokens, seq.tokens, len(seq.tokens) - 1) if held is not None else 0
            shared = reuse == 0 and seq.prefill_key in prompt_order
            if not shared:
                n_new = len(seq.tokens) - reuse
                if (unique or cont) and tokens_in_batch + n_new > self.max_prefill_tokens:
                    break
                tokens_in_batch += n_new
                if reuse:
                    cont.append(seq)
                else:
                    prompt_order[seq.prefill_key] = len(unique)
                    unique.append(seq.tokens)
            waiting.popleft()
            if held is not None:  # its own slot, whatever it reuses
                del self._retained[session]
                seq.slot = held.slot
            else:
                seq.slot = self._take_slot()
            seq.reused = reuse
            admitted.append(seq)
        self._stats["prefills"] += 1
        self._stats["prompt_tokens"] += tokens_in_batch
        self._stats["reused_tokens"] += sum(s.reused for s in cont)

        # inputs: the fresh ones, then one per continuing sequence (PackedLayout wants fresh ones first)
        dev = self.device
        n_fresh = len(unique)
        cont_index = {id(seq): n_fresh + i for i, seq in enumerate(cont)}
        p_idx = [cont_index[id(s)] if s.reused else prompt_order[s.prefill_key] for s in admitted]
        inputs = unique + [s.tokens[s.reused:] for s in cont]
        lengths = [len(p) for p in inputs]
        offsets = [0] * n_fresh + [s.reused for s in cont]
        layout = PackedLayout(lengths, dev, offsets, [-1] * n_fresh + [s.slot for s in cont])
        flat = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(inputs), dtype=np.int64,
                                            count=sum(lengths))).to(dev)  # (N,)
        starts = np.cumsum([0] + lengths[:-1])
        w_tok, w_slot, w_pos = [], [], []
        for seq, p in zip(admitted, p_idx):
            n = lengths[p]
            w_tok.append(np.arange(starts[p], starts[p] + n))
            w_slot.append(np.full(n, seq.slot))
            w_pos.append(np.arange(offsets[p], offsets[p] + n))

        def t(parts):
            return torch.from_numpy(np.concatenate(parts)).to(dev)

        w_tok, w_slot, w_pos = t(w_tok), t(w_slot), t(w_pos)
        with torch.inference_mode():
            self._start_routes()
            logits = self.model.prefill(flat, layout, self.cache, w_tok, w_slot, w_pos, self.attention)  # (P, V)
            self._keep_routes(w_slot, w_pos, w_tok)
            logits = logits.index_select(0, torch.tensor(p_idx, device=dev))  # (R, V)
            R = len(admitted)
            keys = torch.tensor([s.key for s in admitted], dtype=torch.int64, device=dev)
            # the first new token is response token n_prefix: that random-stream step, that buffer column
            steps = torch.tensor([s.n_prefix for s in admitted], dtype=torch.int64, device=dev)
            inv_temp, greedy = self._temperature_rows(R)
            tok, lp = self._sample(logits, keys, steps, inv_temp, greedy)
            slots = torch.tensor([s.slot for s in admitted], dtype=torch.int64, device=dev)
            self._write_prefixes(admitted)
            self.resp_tokens[slots, steps] = tok
            self.resp_logprobs[slots, steps] = lp
            tok_host = tok.tolist()

        finished, keep = [], []
        for seq, first in zip(admitted, tok_host):
            if first in self._stop_set or seq.n_prefix + 1 >= seq.limit:
                finished.append((seq, seq.n_prefix + 1))
            else:
                keep.append((seq, first))
        # the keys/values of a fresh input are the same in every slot it was written to: its kept rows read them from
        # the first one's (SHARE_PROMPT_READS)
        p_of = {id(s): p for s, p in zip(admitted, p_idx)}
        source: dict[int, int] = {}
        for seq, _ in keep:
            p = p_of[id(seq)]
            shared = SHARE_PROMPT_READS and not seq.reused
            seq.src_slot = source.setdefault(p, seq.slot) if shared else seq.slot
            seq.shared_len = lengths[p] if shared else 0
        if keep:
            self._append_rows(keep)
        return finished

    def _start_routes(self) -> None:
        if self.record_routes:
            self.model.routing = []  # each MoE layer's (N, k) ids of the next forward

    def _keep_routes(self, slots: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """The routes of the forward just run: row `rows[j]` (default j) of its tokens to (slots[j], positions[j])."""
        if not self.record_routes:
            return
        ids = torch.stack(self.model.routing, 1)  # (N, n, k)
        self.model.routing = None
        self.seq_routes[slots, positions] = (ids if rows is None else ids.index_select(0, rows)).to(
            self.seq_routes.dtype)

    def _write_prefixes(self, admitted: list[_Seq]) -> None:
        """Copy continuations' prefix tokens and log-probs into their slots' response buffers."""
        pre = [s for s in admitted if s.n_prefix]
        if not pre:
            return
        counts = [s.n_prefix for s in pre]
        rows = torch.from_numpy(np.repeat([s.slot for s in pre], counts)).to(self.device)
        cols = torch.from_numpy(np.concatenate([np.arange(n) for n in counts])).to(self.device)
        self.resp_tokens[rows, cols] = torch.tensor(
            list(itertools.chain.from_iterable(s.request.prefix.token_ids for s in pre)), dtype=torch.int64,
            device=self.device)
        self.resp_logprobs[rows, cols] = torch.tensor(
            list(itertools.chain.from_iterable(s.request.prefix.logprobs for s in pre)), dtype=torch.float32,
            device=self.device)

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
        b0, n = len(self._rows), len(new)
        sl = slice(b0, b0 + n)
        # the first new token sits at position len(prompt + prefix); it is response token n_prefix, so the
        # next decode step samples random-stream step (and writes buffer column) n_prefix + 1
        pos = [len(s.tokens) for s, _ in new]
        ints = torch.tensor([[f for _, f in new], pos, [s.slot for s, _ in new], [s.key for s, _ in new],
                             [s.n_prefix + 1 for s, _ in new], [s.limit for s, _ in new],
                             [s.src_slot if s.src_slot >= 0 else s.slot for s, _ in new],
                             [s.shared_len for s, _ in new]],
                            dtype=torch.int64, device=self.device)  # (8, n): one host->device copy
        (self.r_tokens[sl], self.r_pos[sl], self.r_slot[sl], self.r_key[sl], self.r_step[sl],
         self.r_limit[sl], self.r_src[sl], self.r_shared[sl]) = ints
        inv, greedy = self._temperature_rows(n)
        self.r_inv_temp[sl], self.r_greedy[sl], self.r_done[sl] = inv, greedy, False
        self._row_pos[b0:b0 + n] = pos
        self._row_step[b0:b0 + n] = [s.n_prefix + 1 for s, _ in new]
        self._row_limit[b0:b0 + n] = [s.limit for s, _ in new]
        self._row_src[b0:b0 + n] = [s.src_slot if s.src_slot >= 0 else s.slot for s, _ in new]
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
            self.r_src[b:bb] = self.scratch_slot
            self.r_shared[b:bb] = 0

    def _decode_steps(self, bb: int, attn_len: int, num_splits: int, k: int) -> None:
        """k decode steps on rows [0, bb): everything here is captured into one CUDA graph."""
        for _ in range(k):
            self._decode_step(bb, attn_len, num_splits)

    def _decode_step(self, bb: int, attn_len: int, num_splits: int) -> None:
        """One decode step on rows [0, bb). A row flagged finished (r_done) stays as it is: no token recorded, no
        position or step advanced, the flag kept (its forward still runs, on its last token and position)."""
        slots, steps = self.r_slot[:bb], self.r_step[:bb]
        self._start_routes()
        shared = (self.r_src[:bb], self.r_shared[:bb]) if SHARE_PROMPT_READS else None
        logits = self.model.decode(self.r_tokens[:bb], self.r_pos[:bb], slots, self.cache, self.attention,
                                   attn_len, num_splits, shared=shared)
        self._keep_routes(slots, self.r_pos[:bb])  # the fed tokens' positions (advanced below)
        tok, lp = self._sample(logits, self.r_key[:bb], steps, self.r_inv_temp[:bb], self.r_greedy[:bb])
        if self.fused_kernels:
            from .triton_kernels import advance_rows

            advance_rows(tok, lp, slots, self.r_pos[:bb], steps, self.r_limit[:bb], self.r_tokens[:bb],
                         self.r_done[:bb], self.stop_ids, self.resp_tokens, self.resp_logprobs, self.max_model_len)
            return
        done = self.r_done[:bb]
        live = ~done
        self.resp_tokens[slots, steps] = torch.where(live, tok, self.resp_tokens[slots, steps])
        self.resp_logprobs[slots, steps] = torch.where(live, lp, self.resp_logprobs[slots, steps])
        self.r_tokens[:bb] = torch.where(live, tok, self.r_tokens[:bb])
        self.r_pos[:bb].add_(live.long()).clamp_(max=self.max_model_len)
        steps.add_(live.long()).clamp_(max=self.max_model_len)
        stop_hit = (tok[:, None] == self.stop_ids[None, :]).any(-1)
        self.r_done[:bb] = done | (live & (stop_hit | (steps >= self.r_limit[:bb])))

    def _decode_once(self) -> list[tuple[_Seq, int]]:
        """Launch the next decode steps over the running rows (`decode_steps_per_launch` of them while some row has
        that many left to its cap, else one), then read back the launch before it: one launch stays in flight, so
        the host's reading of launch t (a wait, the finished flags, compaction) overlaps the GPU's launch t+1 instead
        of leaving the GPU idle between them. A row that finished in launch t runs on in t+1 without advancing (its
        keys/values land beyond its end and are never read); no launch is made when every row is certain to have
        reached its length cap with the one in flight. Returns the rows read back as finished, as (seq, response
        length)."""
        prev, self._inflight = self._inflight, None
        b = len(self._rows)
        if prev is None or not np.all(self._row_step[:b] >= self._row_limit[:b]):
            self._inflight = self._launch(b)
        return self._read_back(prev) if prev is not None else []

    def _launch(self, b: int) -> _InFlight:
        """k decode steps over rows [0, b), and the asynchronous copy of their finished flags and step counts."""
        k = self.decode_steps_per_launch
        if k > 1 and int((self._row_limit[:b] - self._row_step[:b]).max()) < k:
            k = 1  # the last steps one at a time: none is run that no row needs
        if self.use_graphs:
            bb = bucket_for(b, self.buckets)
            self._pad_rows(b, bb)
            attn_len = 0
            if self.attention == "torch":
                need = int(self._row_pos[:b].max()) + k
                attn_len = min(_round_up(need, 256), self.max_model_len + 1)
            splits = self._num_splits(bb)
            key = (bb, attn_len, splits, self._sampler_key, k)
            with torch.inference_mode(), self._pdl_scope(bb):
                self.graphs.run(key, lambda: self._decode_steps(bb, attn_len, splits, k),
                                lambda: self._scratch_state(bb))
        else:
            with torch.inference_mode(), self._pdl_scope(b):
                self._decode_steps(b, int(self._row_pos[:b].max()) + k, self._num_splits(b), k)
        self._row_pos[:b] += k  # the host's mirrors run ahead for rows that finished inside the launch
        self._row_step[:b] += k
        i, self._flip = self._flip, self._flip ^ 1
        flags, steps, event = self._done_host[i, :b], self._steps_host[i, :b], self._events[i]
        flags.copy_(self.r_done[:b], non_blocking=event is not None)
        steps.copy_(self.r_step[:b], non_blocking=event is not None)
        if event is not None:
            event.record()
        self._stats["decode_steps"] += k
        self._sampled += b * k  # a token a step for each running sequence (less what finished rows did not sample)
        return _InFlight(list(self._rows), flags, steps, event)

    def _pdl_scope(self, rows: int):
        """The decode kernels' programmatic dependent launch for a batch of `rows` (triton_kernels.PDL_OFF_ROWS); the
        kernels are Triton's on CUDA only."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from .triton_kernels import pdl_for_batch

        return pdl_for_batch(rows)

    def _read_back(self, done_step: _InFlight) -> list[tuple[_Seq, int]]:
        """The rows `done_step` finished that still run (a row it ran after finishing earlier is skipped), taken
        out of the running rows (device buffers and host mirrors compacted, in stream order after the step in
        flight); returns them as (seq, response length at that step)."""
        if done_step.event is not None:
            done_step.event.synchronize()
        flagged = np.flatnonzero(done_step.flags.numpy())
        if not flagged.size:
            return []
        index = {id(s): i for i, s in enumerate(self._rows)}
        steps = done_step.steps.numpy()
        finished = [(done_step.rows[j], int(steps[j])) for j in flagged.tolist() if id(done_step.rows[j]) in index]
        if not finished:
            return []
        gone = {index[id(s)] for s, _ in finished}
        # steps launched after each finished row's last one sampled nothing anyone reads
        self._sampled -= sum(int(self._row_step[index[id(s)]]) - n for s, n in finished)
        b = len(self._rows)
        keep = [i for i in range(b) if i not in gone]
        if keep:
            idx = self._to_device(keep)
            for buf in self._row_buffers:
                buf[:len(keep)] = buf[:b].index_select(0, idx)
            for mirror in (self._row_pos, self._row_step, self._row_limit, self._row_src):
                mirror[:len(keep)] = mirror[keep]
        self._rows = [self._rows[i] for i in keep]
        n = len(keep)
        src = retarget_sources(self._row_src[:n], np.array([s.slot for s in self._rows], dtype=np.int64))
        if n and not np.array_equal(src, self._row_src[:n]):  # a group's source slot left: another member's
            self._row_src[:n] = src
            self.r_src[:n] = self._to_device(src.tolist())
        return finished

    def _drain(self) -> None:
        """Read back the step in flight and the rows being collected; all of them are returned by the next step()
        (or abort())."""
        prev, self._inflight = self._inflight, None
        self._ready += self._finish_collecting()
        if prev is not None:
            self._ready += self._collect(self._read_back(prev))

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
    def _to_device(self, values: list[int]) -> torch.Tensor:
        """int64 values on the engine's device; on CUDA through page-locked memory, without waiting for the stream
        (a pageable copy would wait for the decode step in flight)."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _collect_later(self, finished: list[tuple[_Seq, int]]) -> list[Finished]:
        """`_collect` without waiting for the step in flight: the rows' tokens and log-probs are gathered and copied
        to the host behind it, and the next step() returns them (`_finish_collecting`). With no step in flight
        (the last ones) or where routes are recorded, they are collected at once. The same bookkeeping runs on the
        CPU, where the copies are simply synchronous."""
        if not finished or self._inflight is None or self.record_routes:
            return self._collect(finished)
        on_cuda = self.device.type == "cuda"
        slots = self._to_device([s.slot for s, _ in finished])
        width = max(n for _, n in finished)
        toks = torch.empty(len(finished), width, dtype=torch.int64, pin_memory=on_cuda)
        lps = torch.empty(len(finished), width, dtype=torch.float32, pin_memory=on_cuda)
        toks.copy_(self.resp_tokens[slots, :width], non_blocking=on_cuda)
        lps.copy_(self.resp_logprobs[slots, :width], non_blocking=on_cuda)
        event = torch.cuda.Event() if on_cuda else None
        if event is not None:
            event.record()
        self._collecting.append(_Collecting(finished, toks, lps, event))
        return []

    def _finish_collecting(self) -> list[Finished]:
        out = []
        for c in self._collecting:
            if c.event is not None:
                c.event.synchronize()
            out += self._finished_from(c.finished, c.tokens.tolist(), c.logprobs.tolist())
        self._collecting = []
        return out

    def _collect(self, finished: list[tuple[_Seq, int]], reason: str | None = None) -> list[Finished]:
        """Read finished sequences' responses (prefix included) and free their slots (a session's is retained
        instead, unless aborted). reason: None -> "stop" if the last token is a stop id, else "length"."""
        if not finished:
            return []
        slots = torch.tensor([s.slot for s, _ in finished], dtype=torch.int64, device=self.device)
        width = max(n for _, n in finished)
        return self._finished_from(finished, self.resp_tokens[slots, :width].tolist(),
                                   self.resp_logprobs[slots, :width].tolist(), reason)

    def _finished_from(self, finished: list[tuple[_Seq, int]], toks: list[list[int]], lps: list[list[float]],
                       reason: str | None = None) -> list[Finished]:
        """The Finished results of rows whose response buffers were read (`toks`, `lps`: at least n columns each);
        their slots freed, or retained for their session."""
        out = []
        for (seq, n), tk, lp in zip(finished, toks, lps):
            tk, lp = tk[:n], lp[:n]
            why = reason or (FINISH_STOP if tk[-1] in self._stop_set else FINISH_LENGTH)
            routes = None
            if self.record_routes:  # the prompt's tokens and the response's but the last (never fed back)
                fed = len(seq.tokens) - seq.n_prefix + n - 1
                routes = self.seq_routes[seq.slot, :fed].to("cpu", copy=True)  # not a view of the buffer
            out.append(Finished(seq.request, Sample(token_ids=tk, logprobs=lp, finish_reason=why, routes=routes)))
            if seq.request.session is not None and why != FINISH_ABORT:
                # keys/values are in place for the prompt and every response token but the last (never fed back)
                self._retain(seq.request.session, seq.slot, seq.tokens[:len(seq.tokens) - seq.n_prefix] + tk[:-1])
            else:
                self._free_slots.append(seq.slot)
            self._stats["generated_tokens"] += n - seq.n_prefix
        return out
