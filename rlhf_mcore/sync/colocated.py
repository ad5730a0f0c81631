"""The trainer's entry point: push the actor's exported weights into the colocated rollout engine.

    metrics = sync_actor_to_rollout(actor.export_hf_weights(), rollout_engine, state, bucket_mb=512)

Every rank calls it with its own stream of full HF tensors (the export is a collective that gives every rank
of a model replica identical tensors, whatever the training TP/PP) and its own engine. An engine without
tensor parallelism loads everything; an engine sharded over a rollout TP group takes its rank's slice of
each full tensor in `update_weights` — so rollout TP is independent of training TP×PP.

The in-process transport passes references (no copy) in groups of `bucket_mb`; with `verify=True` the engine
is read back after the sync and compared with the exported tensors by checksum (`verify.EngineVerifier`),
raising `WeightSyncError` with the name of the first tensor that differs.
"""
from __future__ import annotations

from typing import Iterable

from .buckets import NamedTensor, bucket_bytes_from_mb
from .memory import MemoryTracker
from .transport import InProcessChannel, Stopwatch, load_buckets_into
from .verify import EngineVerifier


def sync_actor_to_rollout(named_tensors: Iterable[NamedTensor], rollout_engine, state=None, *,
                          bucket_mb: float = 512, verify: bool = False) -> dict[str, float]:
    """Load `named_tensors` (hf_name, full tensor) into `rollout_engine`; returns `sync/*` metrics.

    state: the rank's `ParallelState` (its device is where time and GPU memory are measured); None: the
      engine's `device` attribute, if any.
    bucket_mb: tensors per `update_weights` call, in MiB (fractions allowed).
    verify: after the sync, compare checksums of the engine's weights with the exported ones.
    Metrics: sync/seconds (excluding verification), sync/bytes, sync/buckets, sync/tensors,
    sync/largest_tensor_bytes, sync/peak_extra_bytes, sync/gbytes_per_s, sync/verify_seconds (verify only),
    the engine's `finish_weight_update` metrics (FP8 rollout: sync/fp8_quantize_seconds, inside sync/seconds),
    and on GPU sync/cuda_peak_delta_bytes — for which the device's peak memory statistics are reset when the
    sync starts (`rlhf_mcore.sync.memory.device_peak_bytes` keeps the peak from before the reset).
    Raises `WeightSyncError` (verify) naming the first tensor that differs.
    """
    bucket_bytes = bucket_bytes_from_mb(bucket_mb)
    device = state.device if state is not None else getattr(rollout_engine, "device", None)
    tracker = MemoryTracker(device)
    tracker.start()
    channel = InProcessChannel(bucket_bytes, tracker)
    verifier = EngineVerifier(rollout_engine) if verify else None
    stream = verifier.wrap(named_tensors) if verifier else named_tensors
    with Stopwatch(device) as watch:
        channel.send(stream)
        finished = load_buckets_into(rollout_engine, channel.receive_buckets())
    stats = channel.stats
    stats.cuda_peak_delta_bytes = tracker.cuda_peak_delta()
    if verifier is not None:
        with Stopwatch(device) as check:
            verifier.verify()
        stats.verify_seconds = verifier.seconds + check.seconds
        stats.seconds = max(0.0, watch.seconds - verifier.seconds)
    else:
        stats.seconds = watch.seconds
    return {**stats.as_metrics(), **{f"sync/{k}": v for k, v in finished.items()}}
