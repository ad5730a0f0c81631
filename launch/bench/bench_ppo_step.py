"""One RL step of the real trainer, timed phase by phase: the GSM8K PPO run, or a GRPO step of TRL's workload.

    python launch/bench/bench_ppo_step.py --workload gsm8k_ppo [--steps 1] [--profile] [--out FILE.json]
    python launch/bench/bench_ppo_step.py --workload trl_grpo  [--steps 2] [--out FILE.json]
    python launch/bench/bench_ppo_step.py --workload trl_grpo_7b --steps 1   # a whole 7B GRPO step, one H200
    python launch/bench/bench_ppo_step.py --workload trl_grpo_7b_lora --steps 2   # the same with LoRA, no offload
    python launch/bench/bench_ppo_step.py --workload gsm8k_ppo --steps 2 --replay-passes 3  # + the passes replayed
    python launch/bench/bench_ppo_step.py --workload gsm8k_ppo --tiny            # CPU smoke run on a tiny shape

What runs: `rlhf_mcore.trainer.RLTrainer`, unchanged, on one GPU, for 1 warm-up step + `--steps` timed steps
(+ one profiled step with `--profile`). Only the observation is added: the trainer's engines, rollout engine
and reward scorer are wrapped so each call is timed (with a device synchronisation on both sides), and the
trainer's own `timing_s/*` metrics are kept. Nothing else is changed; checkpointing, validation and the final
export are switched off by config (save_freq/test_freq -1, export_hf_final=false).

Model: a random-weight Qwen2.5-0.5B-shaped HF directory with a tokenizer (`bench_shapes.tokenizer_model_dir`:
the exact 0.5B shape; a byte-level BPE tokenizer of 8,192 tokens trained on GSM8K text, so prompts have GSM8K's
real length; the chat template is Qwen's ChatML). Data: the vendored GSM8K train split in veRL's schema.

Workloads:
- `gsm8k_ppo`: configs/gsm8k_ppo_qwen2.5_0.5b.yaml (256 prompts, prompt <= 512, response <= 512, actor +
  critic (GAE), mini-batch 64, micro-batch 4, log-prob micro-batch 8 / 4), vocabulary 151,936, plus a reference
  policy (`algorithm.use_kl_in_reward=true`, the config's kl_coef 0.001): the target step is actor +
  critic + reference, and the config by itself builds no reference (no KL term would read it).
  Response length: a random-weight model samples its eos token with probability ~1/151,936 a token, so every
  response runs to the 512-token cap — the worst case of the config and the "512 + 512 tokens" of the
  target (a trained Instruct model's GSM8K responses are ~200-300 tokens: the real step is shorter).
- `trl_grpo`: TRL's GRPO workload (64 prompts x 8 samples, up to 256 new tokens, no reference
  model, one optimizer step a step) on configs/gsm8k_grpo_qwen2.5_0.5b.yaml with those overrides and the same
  model with a vocabulary of 8,192 (as TRL was measured); responses run to 256 tokens for the same reason.
  launch/bench/bench_trl.py runs TRL's GRPOTrainer on the same model directory and prompts.
- `trl_grpo_7b`: the same workload at the Qwen2.5-7B shape (vocabulary 152,064) with the one-GPU memory plan
  (`rollout.sleep_level=2`, the actor's gradients and optimizer state offloaded while it generates, full
  recomputation, 4k-token micro-batches); the report's per-step `peak_mem_gib` is the trainer's own peak.
- `trl_grpo_7b_lora`: the same 7B workload with LoRA (rank 16, every linear) and no offload plan: sleep level 1,
  nothing offloaded, no recomputation, the same 4k-token micro-batches.

Phase keys (seconds, per step): `rollout/generate` (the engine's generate), `rollout/reward`, `rollout/offload`
+ `rollout/onload` (training state off/on the GPU around generation; only
when the config sets `megatron.*_offload`), `rollout/wake_sleep`; `old_log_prob`,
`ref`, `values`; `adv`; `critic_update`, `actor_update`; `sync`; `step` (the trainer's whole step).
Each step's record also keeps the rollout engine's counters of its generation (`rollout_stats`; the native
engine's `graph_captures` > 0 after the first step means its decode graphs are captured again every step) and,
per synchronised phase, how much the CUDA caching allocator's counters grew in it (`allocs`: device allocations,
frees, retries). The report's `allocator` says the allocator's mode as run: `trainer.cuda_expandable_segments`
(on by default on a GPU; compare the override `trainer.cuda_expandable_segments=false`), `PYTORCH_CUDA_ALLOC_CONF`,
and whether the allocator's segments were expandable. `--replay-passes N` puts the last timed
step's batch through its forward passes N more times (`replayed_passes_s`): a pass's own seconds against its phase's.
`--bare`: none of the wrappers above, so the device is synchronised only where the trainer itself does (each wrapper
synchronises on both sides of its call); the report keeps the trainer's own `step` and `trainer/*` phases: the step
as a user's run takes it, to set beside an observed run's phase table.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_shapes import shape as get_shape  # noqa: E402
from bench_shapes import tokenizer_model_dir, write_report  # noqa: E402

WORKLOADS = {
    # the config as is, plus the reference policy (a KL penalty in the reward at the config's kl_coef 0.001):
    # the target step is "actor + critic + reference"; the config alone builds no reference (no KL term uses it)
    "gsm8k_ppo": {"config": "configs/gsm8k_ppo_qwen2.5_0.5b.yaml", "vocab": None,
                  "overrides": ["algorithm.use_kl_in_reward=true"]},
    "trl_grpo": {"config": "configs/gsm8k_grpo_qwen2.5_0.5b.yaml", "vocab": 8192, "overrides": [
        "data.train_batch_size=64", "actor_rollout_ref.rollout.n=8", "data.max_response_length=256",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.rollout.max_num_seqs=512"]},
    # TRL's workload at the 7B shape on one H200, with the memory plan bench_memory.py --measure validated phase by
    # phase: the rollout sleeps at level 2 (weights dropped, re-sent at the next wake), the actor's gradients and
    # optimizer state leave the GPU while it generates, full activation recomputation, 4k-token micro-batches
    "trl_grpo_7b": {"config": "configs/gsm8k_grpo_qwen2.5_0.5b.yaml", "vocab": None, "shape": "qwen2.5-7b",
                    "overrides": [
        "data.train_batch_size=64", "actor_rollout_ref.rollout.n=8", "data.max_response_length=256",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.rollout.max_num_seqs=512", "actor_rollout_ref.rollout.sleep_level=2",
        "actor_rollout_ref.actor.megatron.grad_offload=true", "actor_rollout_ref.actor.megatron.optimizer_offload=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096"]},
    # the same 7B workload with LoRA (rank 16, alpha 32, every linear) and no offload: the frozen bf16 base has no
    # gradient buffer, fp32 master or Adam state, so the actor, the rollout's weights (kept: sleep level 1) and the
    # activations (no recomputation) fit together; the weight sync is the lora_sync default
    "trl_grpo_7b_lora": {"config": "configs/gsm8k_grpo_qwen2.5_0.5b.yaml", "vocab": None, "shape": "qwen2.5-7b",
                         "overrides": [
        "data.train_batch_size=64", "actor_rollout_ref.rollout.n=8", "data.max_response_length=256",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.rollout.max_num_seqs=512", "actor_rollout_ref.model.lora_rank=16",
        "actor_rollout_ref.model.lora_alpha=32", "actor_rollout_ref.model.target_modules=all-linear",
        "actor_rollout_ref.actor.optim.lr=3e-5", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096"]},
}
# the CPU smoke run: same code, tiny everything
TINY_OVERRIDES = {
    "gsm8k_ppo": ["data.train_batch_size=4", "data.max_train_samples=64", "data.max_response_length=16",
                  "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                  "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
                  # the config asks for CUDA graphs (a GPU config); the smoke run is on the CPU
                  "actor_rollout_ref.actor.megatron.cuda_graphs=null", "critic.megatron.cuda_graphs=null"],
    "trl_grpo": ["data.train_batch_size=2", "data.max_train_samples=64", "actor_rollout_ref.rollout.n=2",
                 "data.max_response_length=16", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024"],
}
TINY_OVERRIDES["trl_grpo_7b"] = TINY_OVERRIDES["trl_grpo_7b_lora"] = TINY_OVERRIDES["trl_grpo"]


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


SPANS: list[tuple[str, float, float]] = []  # every timed call: (phase, perf_counter start, end), for phase_busy
# the CUDA caching allocator's counters whose growth inside a phase is recorded per step (`allocs`): device
# allocations (cudaMalloc of a new segment, or an expandable segment's new pages), frees, and retries (an allocation
# that failed, freed the cache after a synchronisation, and tried again)
ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries")
ALLOCS: dict[str, dict[str, int]] = {}  # phase -> counter -> growth this step (cleared at each step's start)


def _alloc_counts() -> dict[str, int]:
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOC_KEYS}


def timed(obj, method: str, key: str, sink: dict, sync: bool = True):
    """Replace `obj.method` by a wrapper adding its wall time (device-synchronised unless `sync=False`) to
    `sink[key]` (and its interval to `SPANS`). `sync=False` for host-only work called inside another timed phase:
    the rule scorer, which the streaming rollout calls between decode steps while a step is in flight; a
    synchronisation there drained the engine's queue at every finished batch (~29 times a GRPO step), idling the
    GPU during the host work the in-flight step exists to hide, which the trainer without the benchmark never
    does. Returns the undo (the method put back)."""
    fn = getattr(obj, method)
    wait = _sync if sync else (lambda: None)

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        from torch.profiler import record_function

        wait()
        before = _alloc_counts() if sync else {}
        t0 = time.perf_counter()
        try:
            with record_function(PHASE_PREFIX + key):  # a profiled step's per-phase device busy (phase_busy)
                return fn(*a, **kw)
        finally:
            wait()
            t1 = time.perf_counter()
            sink[key] = sink.get(key, 0.0) + t1 - t0
            SPANS.append((key, t0, t1))
            grown = ALLOCS.setdefault(key, {}) if before else {}
            for k, v in _alloc_counts().items() if before else ():
                grown[k] = grown.get(k, 0) + v - before[k]

    setattr(obj, method, wrapper)
    return lambda: setattr(obj, method, fn)


def timed_between(obj, first: str, last: str, key: str, sink: dict) -> None:
    """Time from the start of `obj.first` to the end of `obj.last` (device-synchronised at both ends) as one
    interval of `key`: a streaming rollout (open_stream ... close_stream), whose many `step` calls would each pay
    the wrapper's two synchronisations if timed one by one."""
    begin, end = getattr(obj, first), getattr(obj, last)
    state = {}

    @functools.wraps(begin)
    def opening(*a, **kw):
        from torch.profiler import record_function

        _sync()
        state["t0"] = time.perf_counter()
        state["annotation"] = rf = record_function(PHASE_PREFIX + key)
        rf.__enter__()
        return begin(*a, **kw)

    @functools.wraps(end)
    def closing(*a, **kw):
        try:
            return end(*a, **kw)
        finally:
            _sync()
            t1 = time.perf_counter()
            rf, t0 = state.pop("annotation", None), state.pop("t0", None)
            if rf is not None:
                rf.__exit__(None, None, None)
            if t0 is not None:
                sink[key] = sink.get(key, 0.0) + t1 - t0
                SPANS.append((key, t0, t1))

    setattr(obj, first, opening)
    setattr(obj, last, closing)


PHASE_PREFIX = "bench_phase/"


def phase_busy(prof, spans=()) -> dict[str, dict[str, float]]:
    """Per timed phase of a profiled step: the seconds the device ran kernels inside it (the union of the kernels'
    intervals that start within the phase; the wrapper synchronises on both sides, so a phase's kernels run inside
    it) and the phase's own seconds. The phases are the host's `record_function` annotations when the profile has
    them (`--profile-cpu`); else `spans`, (phase, start, end) in microseconds on the profile's clock (the wrapper's
    perf_counter intervals shifted by the profiler's start: good to the profiler's start-up, about a millisecond).
    The rest of a phase is where the GPU waited for the host, split by the length of each wait (the time from the
    phase's start to its first kernel, between kernels, and from the last kernel to the phase's end): `short_idle_s`
    sums the waits under `SHORT_GAP_S` (the host launching kernels more slowly than the GPU runs them),
    `long_idle_s` the longer ones (`long_idles` of them: synchronisations, host work between kernels). Kernels under
    programmatic dependent launch (the rollout's decode kernels) start before their predecessors end and wait, so
    there the union overstates the busy time."""
    from torch.autograd import DeviceType

    events = prof.events()
    chosen = [(e.name[len(PHASE_PREFIX):], e.time_range.start, e.time_range.end) for e in events
              if e.name.startswith(PHASE_PREFIX) and e.device_type == DeviceType.CPU] or list(spans)
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                     and not e.name.startswith(PHASE_PREFIX))
    out: dict[str, dict[str, float]] = {}
    short_us = SHORT_GAP_S * 1e6
    for name, lo, hi in chosen:
        busy, end, short, long, n_long = 0.0, lo, 0.0, 0.0, 0
        for a, b in kernels:
            if a < lo or a > hi:
                continue
            gaps = [a - end] if a > end else []
            if a >= hi:
                break
            a = max(a, end)
            if b > a:
                busy, end = busy + b - a, b
            for g in gaps:
                short, long, n_long = (short + g, long, n_long) if g < short_us else (short, long + g, n_long + 1)
        if end < hi:  # the phase's tail: its last kernel ended before the host moved on
            g = hi - end
            short, long, n_long = (short + g, long, n_long) if g < short_us else (short, long + g, n_long + 1)
        d = out.setdefault(name, {"span_s": 0.0, "busy_s": 0.0, "short_idle_s": 0.0, "long_idle_s": 0.0,
                                  "long_idles": 0})
        d["span_s"] += (hi - lo) / 1e6
        d["busy_s"] += busy / 1e6
        d["short_idle_s"] += short / 1e6
        d["long_idle_s"] += long / 1e6
        d["long_idles"] += n_long
    return out


SHORT_GAP_S = 1e-3  # phase_busy: a wait for the host shorter than this counts as launch-bound


MARK_KERNEL = "spin_kernel"  # what torch.cuda._sleep launches


def profile_clock_spans(events, spans, mark: float | None, start: float) -> list[tuple[str, float, float]]:
    """`spans` (phase, perf_counter start, end) in microseconds on the profile's clock: aligned on the first
    `MARK_KERNEL` launched at perf_counter `mark` (its launch latency, microseconds, is the error), else on the
    profiler's start at perf_counter `start` (its start-up, up to ~0.1 s, is the error)."""
    from torch.autograd import DeviceType

    zero = start
    if mark is not None:
        at = min((e.time_range.start for e in events if e.device_type == DeviceType.CUDA and MARK_KERNEL in e.name),
                 default=None)
        if at is not None:
            zero = mark - at / 1e6
    return [(k, (a - zero) * 1e6, (b - zero) * 1e6) for k, a, b in spans]


def kernel_table(prof, wall_s: float, top: int = 30, spans=()) -> tuple[str, dict]:
    """Top kernels/ops by self device time, and a summary (device-busy fraction, categories)."""
    import torch

    on_gpu = torch.cuda.is_available()
    rows = []
    for e in prof.key_averages():
        if on_gpu:
            t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        else:  # CPU smoke run: op times stand in for kernel times
            t = e.self_cpu_time_total
        if t and t > 0:
            rows.append((e.key, e.count, t / 1e6))
    rows.sort(key=lambda r: -r[2])
    busy = sum(r[2] for r in rows)
    cats = {"gemm": ("gemm", "cutlass", "nvjet", "sm90_", "cublas", "wgmma"),
            "attention": ("flex", "attention", "fmha", "flash", "sdpa"),
            "triton (fused/compiled)": ("triton",), "memcpy/memset": ("memcpy", "memset"),
            "nccl": ("nccl",), "reduce/softmax": ("reduce", "softmax", "norm"),
            "elementwise": ("elementwise", "vectorized", "unrolled")}
    by_cat: dict[str, float] = {}
    for name, _, t in rows:
        low = name.lower()
        cat = next((c for c, keys in cats.items() if any(k in low for k in keys)), "other")
        by_cat[cat] = by_cat.get(cat, 0.0) + t
    lines = [f"profiled step wall {wall_s:.2f} s; device busy (sum of kernel time) {busy:.2f} s = "
             f"{busy / max(wall_s, 1e-9):.0%} of wall", ""]
    phases = phase_busy(prof, spans) if on_gpu else {}
    if phases:
        lines += [f"{'phase':<22} {'span s':>8} {'busy s':>8} {'span - busy':>12} {'waits < 1 ms':>13} "
                  f"{'waits >= 1 ms (n)':>18}"]
        lines += [f"{k:<22} {d['span_s']:8.3f} {d['busy_s']:8.3f} {d['span_s'] - d['busy_s']:12.3f} "
                  f"{d['short_idle_s']:13.3f} {d['long_idle_s']:10.3f} ({d['long_idles']})"
                  for k, d in sorted(phases.items(), key=lambda x: -x[1]["span_s"])]
        lines.append("")
    lines.append("by category:")
    for c, t in sorted(by_cat.items(), key=lambda x: -x[1]):
        lines.append(f"  {c:<26} {t:8.3f} s  {t / max(busy, 1e-9):6.1%}")
    lines += ["", f"{'self device s':>13} {'%':>6} {'calls':>8}  kernel / op"]
    for name, count, t in rows[:top]:
        lines.append(f"{t:13.3f} {t / max(busy, 1e-9):6.1%} {count:8d}  {name[:110]}")
    summary = {"wall_s": wall_s, "device_busy_s": busy, "by_category_s": by_cat, "phases": phases,
               "top": [{"name": n[:200], "calls": c, "self_device_s": t} for n, c, t in rows[:top]]}
    host = sorted(((e.key, e.count, e.self_cpu_time_total / 1e6) for e in prof.key_averages()
                   if on_gpu and e.self_cpu_time_total > 0), key=lambda r: -r[2])
    if host:  # CPU activity was recorded (--profile-cpu): where the host time goes, and the syncs
        syncs = {n: c for n, c, _ in host if any(k in n for k in ("Synchronize", "_local_scalar_dense", "aten::item"))}
        lines += ["", f"host: {sum(r[2] for r in host):.2f} s of self CPU time in ops; sync-like calls: {syncs}",
                  f"{'self host s':>13} {'calls':>8}  op"]
        lines += [f"{t:13.3f} {c:8d}  {n[:110]}" for n, c, t in host[:top]]
        summary["host_top"] = [{"name": n[:200], "calls": c, "self_cpu_s": t} for n, c, t in host[:top]]
        summary["host_syncs"] = syncs
    return "\n".join(lines), summary


class BenchHooks:
    """Per-call timings and an optional profiled step, observed through the trainer's StepHooks; the loop is the
    trainer's own. Components (engines, rollout, scorer) are wrapped per instance so each call is timed."""

    def __init__(self, parts, profile_step: int | None, profile_cuda_only: bool = True, partial_out=None,
                 replay_step: int | None = None, replay_rounds: int = 0, observe: bool = True):
        """`parts`: the trainer's parts (rlhf_mcore.trainer.hooks.StepParts: actor, critic, ref, rollout, ...).
        `replay_step`: after that step, its batch through the forward passes again (`replay_passes`,
        `replay_rounds` rounds); the seconds in `self.replayed`. `observe=False` (`--bare`): no component is
        wrapped, so nothing synchronises the device that the trainer does not; only the trainer's own timings."""
        self.sub: dict[str, float] = {}
        self.records: list[dict] = []
        self.replay_step, self.replay_rounds, self.replayed = replay_step, replay_rounds, {}
        self.profile_step, self.profile_cuda_only, self.partial_out = profile_step, profile_cuda_only, partial_out
        self.cprofile = None  # a cProfile.Profile over the timed steps' host work (--cprofile)
        self.prof, self.profile_summary, self.profile_text, self._prof_t0 = None, None, "", 0.0
        s = self.sub
        self.undo = []
        if not observe:
            return
        if getattr(parts.rollout, "supports_streaming", False):  # generate() and the trainer's loop both stream
            timed_between(parts.rollout, "open_stream", "close_stream", "rollout/generate", s)
        else:
            timed(parts.rollout, "generate", "rollout/generate", s)
        timed(parts.rollout, "wake", "rollout/wake_sleep", s)
        timed(parts.rollout, "sleep", "rollout/wake_sleep", s)
        timed(parts.scorer, "score", "rollout/reward", s, sync=False)  # host work, inside the generation
        # the synchronous trainer's generation phase around the stream (host work; module functions, put back by
        # close()): generation and scoring with the rows' gathering, the reward pipeline's composition, the batch
        from rlhf_mcore.trainer import colocated

        self.undo = [timed(colocated, "generate_and_score", "rollout/generate_and_score", s, sync=False),
                     timed(colocated, "compose", "rollout/compose", s, sync=False),
                     timed(colocated, "rows_to_batch", "rollout/to_batch", s, sync=False)]
        timed(parts.actor, "compute_log_probs", "old_log_prob", s)
        timed(parts.actor, "update_policy", "actor_update", s)
        for e in (parts.actor, parts.ref, parts.critic):
            if e is not None:
                timed(e, "offload", "rollout/offload", s)
                timed(e, "onload", "rollout/onload", s)
        if parts.ref is not None:
            timed(parts.ref, "compute_log_probs", "ref", s)
        if parts.critic is not None:
            timed(parts.critic, "compute_values", "values", s)
            timed(parts.critic, "update_critic", "critic_update", s)

    def close(self) -> None:
        """Put back the module functions the hooks wrapped."""
        while self.undo:
            self.undo.pop()()

    def step_start(self, parts, step):
        import torch

        self.sub.clear()
        ALLOCS.clear()
        if self.cprofile is not None and step >= 2:  # the timed steps, not the warm-up's captures and compiles
            self.cprofile.enable()
        if step == self.profile_step:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
            if not self.profile_cuda_only:
                acts.append(ProfilerActivity.CPU)
            self.prof = profile(activities=acts)
            self._prof_t0 = time.perf_counter()
            self.prof.__enter__()
            self._mark = None
            if torch.cuda.is_available():  # a kernel at a known host time: the profile's clock against perf_counter
                _sync()
                self._mark = time.perf_counter()
                torch.cuda._sleep(1000)
            self._spans_from = len(SPANS)

    def step_end(self, parts, step, batch, metrics, timer):
        import torch

        if self.cprofile is not None:
            self.cprofile.disable()
        if self.prof is not None:
            _sync()
            wall = time.perf_counter() - self._prof_t0
            self.prof.__exit__(None, None, None)
            t0 = time.perf_counter()
            spans = profile_clock_spans(self.prof.events(), SPANS[self._spans_from:], self._mark, self._prof_t0)
            self.profile_text, self.profile_summary = kernel_table(self.prof, wall, spans=spans)
            self.profile_summary["analysis_s"] = time.perf_counter() - t0
            self.prof = None
        on_gpu = torch.cuda.is_available()
        mask = batch["response_mask"]
        rec = {"step": step, "profiled": step == self.profile_step,
               "phases_s": dict(self.sub), "trainer_timing_s": dict(timer.seconds),
               "sequences": int(mask.shape[0]), "response_tokens": int(mask.sum()),
               "total_tokens": int(batch["attention_mask"].sum()),
               "response_length_mean": float(mask.sum(1).float().mean()),
               "response_length_max": int(mask.sum(1).max()),
               "prompt_length_mean": float((batch["attention_mask"].sum(1) - mask.sum(1)).float().mean()),
               # the trainer's own per-step peak (a weight sync's measurement does not hide what came before)
               "peak_mem_gib": metrics.get("perf/max_memory_allocated_gb/max") if on_gpu else None,
               "metrics": {k: v for k, v in metrics.items() if k.startswith(("perf/", "timing_s/", "sync/"))},
               # the rollout engine's counters of this step's generation (the native engine: decode steps,
               # prefills, graph_captures, ...)
               "rollout_stats": {k: v for k, v in (getattr(parts.rollout, "last_stats", None) or {}).items()
                                 if isinstance(v, (int, float))},
               # the caching allocator's counters grown inside each synchronised phase (CUDA only)
               "allocs": {k: dict(v) for k, v in ALLOCS.items()}}
        self.records.append(rec)
        if self.partial_out:  # steps so far survive a later crash or timeout
            Path(self.partial_out).write_text(json.dumps({"partial": True, "steps": self.records}, indent=1))
        shown = {**rec["phases_s"], "step": timer.seconds["step"], "gc": metrics.get("perf/gc_s/max", 0.0)}
        print(f"[bench] step {step}: " + json.dumps({k: round(v, 3) for k, v in shown.items()}), flush=True)
        if step == self.replay_step and self.replay_rounds > 0:
            self.replayed = replay_passes(parts, batch, self.replay_rounds)
            print("[bench] the step's batch replayed: " + json.dumps(
                {k: [round(x, 3) for x in v] for k, v in self.replayed.items()}), flush=True)


def replay_passes(parts, batch, rounds: int) -> dict[str, list[float]]:
    """The step's own batch through each forward pass the step ran (old log-probs, reference, values), `rounds`
    rounds alternating, each timed between two device synchronisations: the passes' own seconds, to set against the
    step's phases (session 49: the old-log-prob pass ran 0.03-0.15 s longer inside the step than replayed). The
    engines' own methods are called, not the timing wrappers: the replays add nothing to the step's record."""
    passes = {"old_log_prob": (parts.actor, "compute_log_probs")}
    if parts.ref is not None:
        passes["ref"] = (parts.ref, "compute_log_probs")
    if parts.critic is not None:
        passes["values"] = (parts.critic, "compute_values")
    out: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(rounds):
        for name, (engine, method) in passes.items():
            run = getattr(type(engine), method).__get__(engine)  # the class's method: past the instance's wrapper
            _sync()
            t0 = time.perf_counter()
            run(batch)
            _sync()
            out[name].append(time.perf_counter() - t0)
    return out


def segments_expandable() -> bool | None:
    """Whether the CUDA allocator's segments are expandable (None: it has none, or they are of both kinds)."""
    import torch

    kinds = {bool(seg.get("is_expandable")) for seg in torch.cuda.memory_snapshot()}
    return kinds.pop() if len(kinds) == 1 else None


def dynamo_counters() -> dict:
    try:
        from torch._dynamo.utils import counters
        return {k: {str(kk): vv for kk, vv in list(v.items())[:30]} for k, v in counters.items() if v}
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return {"error": repr(e)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="gsm8k_ppo")
    p.add_argument("--steps", type=int, default=1, help="timed steps after the warm-up step")
    p.add_argument("--profile", action="store_true", help="one more step under torch.profiler (kernel table)")
    p.add_argument("--tiny", action="store_true", help="tiny shape and batch (CPU smoke run)")
    p.add_argument("--model-dir", default=None, help="reuse/create the model directory here (default: temporary)")
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--profile-out", default=None, help="kernel table (text); default next to --out")
    p.add_argument("--profile-cpu", action="store_true", help="profile host (CPU) ops too, not only CUDA kernels")
    p.add_argument("--replay-passes", type=int, default=0, metavar="N",
                   help="after the last timed step, its batch through each forward pass N more times, alternating")
    p.add_argument("--bare", action="store_true",
                   help="no per-call wrappers (no device synchronisation around each pass): the trainer's own step "
                        "and phase timings only")
    p.add_argument("--cprofile", default=None, metavar="FILE",
                   help="Python profile (cProfile) of the steps after the warm-up: the top functions to FILE")
    p.add_argument("overrides", nargs="*", help="extra config key=value overrides")
    args = p.parse_args(argv)
    from rlhf_mcore.startup import pause_gc

    pause_gc()  # as launch/train.py: start-up frozen once the models are built (a full pass then skips it)
    import torch

    from rlhf_mcore.config import load_config, model_max_positions, validate_config
    from rlhf_mcore.data import preprocess_gsm8k

    w = WORKLOADS[args.workload]
    vocab = {"vocab_size": w["vocab"]} if w["vocab"] else {}
    s = get_shape("tiny" if args.tiny else w.get("shape", "qwen2.5-0.5b"), **({} if args.tiny else vocab))
    on_gpu = torch.cuda.is_available()
    tmp = tempfile.TemporaryDirectory(prefix="bench_step_")
    model_dir = Path(args.model_dir or Path(tmp.name) / "model")
    t0 = time.perf_counter()
    tokenizer_model_dir(s, model_dir, tokenizer_vocab=None,
                        dtype="bfloat16" if on_gpu else "float32")
    model_s = time.perf_counter() - t0
    data = preprocess_gsm8k(output_dir=Path(tmp.name) / "gsm8k")
    n_steps = 1 + args.steps + (1 if args.profile else 0)
    overrides = [f"actor_rollout_ref.model.path={model_dir}", f"critic.model.path={model_dir}",
                 f"data.train_files=[{data['train']['path']}]", "data.val_files=[]",
                 f"trainer.total_training_steps={n_steps}", "trainer.save_freq=-1", "trainer.test_freq=-1",
                 "trainer.val_before_train=false", "trainer.logger=[console]", "trainer.resume_mode=disable",
                 "trainer.export_hf_final=false",
                 f"trainer.default_local_dir={Path(tmp.name) / 'run'}", "data.max_train_samples=4096",
                 *w["overrides"], *(TINY_OVERRIDES[args.workload] if args.tiny else []), *args.overrides]
    cfg = load_config(ROOT / w["config"], overrides)
    validate_config(cfg, 1, model_max_positions(str(model_dir)))
    from rlhf_mcore.trainer import RLTrainer

    t0 = time.perf_counter()
    trainer = RLTrainer(cfg)
    init_s = time.perf_counter() - t0
    hooks = BenchHooks(trainer.parts(), profile_step=n_steps if args.profile else None,
                       profile_cuda_only=not args.profile_cpu, partial_out=args.out,
                       replay_step=1 + args.steps, replay_rounds=args.replay_passes, observe=not args.bare)
    trainer.hooks = hooks
    if args.cprofile:
        import cProfile

        hooks.cprofile = cProfile.Profile()
    t0 = time.perf_counter()
    try:
        trainer.fit()
    finally:
        fit_s = time.perf_counter() - t0
        expandable = segments_expandable() if on_gpu else None  # before close() gives the memory back
        trainer.close()
        hooks.close()
    recs = hooks.records
    timed_recs = [r for r in recs[1:] if not r["profiled"]] or recs[-1:]
    phases = sorted({k for r in timed_recs for k in r["phases_s"]})
    median = {k: statistics.median(r["phases_s"].get(k, 0.0) for r in timed_recs) for k in phases}
    median["step"] = statistics.median(r["trainer_timing_s"]["step"] for r in timed_recs)
    for k in ("plan", "adv", "sync", "gen", "old_log_prob", "update"):
        median[f"trainer/{k}"] = statistics.median(r["trainer_timing_s"].get(k, 0.0) for r in timed_recs)
    report = {
        "benchmark": f"rl_step_{args.workload}", "workload": args.workload, "config": w["config"],
        "overrides": overrides, "shape": s, "tiny": args.tiny, "bare": args.bare,
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "torch": torch.__version__,
        "model_build_s": model_s, "trainer_init_s": init_s, "fit_s": fit_s,
        "step_s": median["step"], "phases_median_s": median, "steps": recs,
        "tokens_per_step": timed_recs[-1]["total_tokens"],
        "response_tokens_per_step": timed_recs[-1]["response_tokens"],
        "dynamo_counters": dynamo_counters(),
        # the caching allocator's mode as run (trainer.cuda_expandable_segments; PYTORCH_CUDA_ALLOC_CONF)
        "allocator": {"cuda_expandable_segments": cfg.trainer.cuda_expandable_segments,
                      "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                      "expandable_segments": expandable},
    }
    if hooks.profile_summary is not None:
        report["profile"] = hooks.profile_summary
    if hooks.replayed:
        report["replayed_passes_s"] = hooks.replayed
    print(f"\n{args.workload}: {report['device']}  step {median['step']:.2f} s (median of {len(timed_recs)} timed, "
          f"after 1 warm-up); {report['tokens_per_step']} tokens, {report['response_tokens_per_step']} generated")
    for k, v in median.items():
        print(f"  {k:<22} {v:8.3f} s")
    if hooks.profile_text:
        print("\n" + hooks.profile_text)
    write_report(report, args.out)
    if hooks.cprofile is not None:
        import io
        import pstats

        text = io.StringIO()
        stats = pstats.Stats(hooks.cprofile, stream=text)
        stats.sort_stats("tottime").print_stats(60)
        stats.sort_stats("cumulative").print_stats(80)
        Path(args.cprofile).write_text(text.getvalue())
        hooks.cprofile.dump_stats(args.cprofile + ".pstats")  # raw stats: pstats print_callers finds the sync sites
    if args.out and hooks.profile_text:
        prof_out = args.profile_out or (str(Path(args.out).with_suffix("")) + "_profile.txt")
        Path(prof_out).write_text(hooks.profile_text + "\n")
    tmp.cleanup()
    return report


if __name__ == "__main__":  # the guard matters: dist_checkpointing's writer spawns processes
    main()
