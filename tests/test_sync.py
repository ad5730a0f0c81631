"""The weight-sync engine (rlhf_mcore.sync).

Single process: bucketing against a plain reference, flat-buffer packing round trips, the in-process transport's
zero-copy grouping, the memory tracker (including a consumer that leaks buckets, which it must catch), the
checksum against a naive Python loop, verification of native and HF engines, and corrupted tensors naming
themselves.

Multi-process:
- tests/scripts/sync_ipc.py: shared memory (the CPU stand-in for CUDA IPC) to a spawned "rollout server";
- tests/scripts/sync_cases.py under torchrun (4 gloo ranks): Megatron TP=2×PP=2 -> rollout TP=1 and TP=2,
  TP=4 -> rollout TP=2 (received tensors bitwise equal to the safetensors), a 3-layer model on uneven PP=2
  stages (TP=1 and TP=2) -> rollout TP=1, a PPO update of the TrainEngine actor then a sync (generations equal
  to a fresh engine built from `save_hf_checkpoint`), and the broadcast transport.
"""
import json
from pathlib import Path

import pytest
import torch
from launcher import CPU, run

from rlhf_mcore.sync import (
    BroadcastSender,
    BucketPacker,
    EngineVerifier,
    FlatBucket,
    InProcessChannel,
    MemoryTracker,
    StagedReceive,
    WeightSyncError,
    bucket_bytes_from_mb,
    checksum,
    compare_checksums,
    group_by_bytes,
    sync_actor_to_rollout,
)
from rlhf_mcore.sync.buckets import ALIGN, plan_layout
from rlhf_mcore.sync.verify import CHECKSUM_MOD, CHECKSUM_ROW, ChecksumTap, fingerprint

pytestmark = pytest.mark.cost(30)

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(arch="qwen2", vocab=1000, heads=8, kv_heads=4)  # shared with tests/test_models.py's qwen2


def synthetic(seed: int = 0) -> list:
    """Mixed dtypes and shapes, one large tensor, a 0-d and a non-contiguous one."""
    g = torch.Generator().manual_seed(seed)
    return [("a", torch.randn(40, 33, generator=g)), ("b", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
            ("c", torch.randint(-1000, 1000, (123,), generator=g)), ("d", torch.rand(17, generator=g) > 0.5),
            ("e", torch.randn(128, 128, generator=g)), ("f", torch.tensor(3.5)),
            ("g", torch.randn(30, 20, generator=g).t()), ("h", torch.randn(300, generator=g).to(torch.float16)),
            ("i", torch.randn(64, 10, generator=g))]


def nbytes(t):
    return t.numel() * t.element_size()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ buckets

def reference_groups(sizes: list[int], budget: int) -> list[list[int]]:
    """Indices per bucket: start a new bucket whenever the next tensor would overflow a non-empty one."""
    groups, current, total = [], [], 0
    for i, s in enumerate(sizes):
        if current and total + s > budget:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += s
    return groups + ([current] if current else [])


@pytest.mark.parametrize("budget", [1, 700, 4096, 70_000, 10**9])
def test_group_by_bytes_matches_reference(budget):
    named = synthetic()
    got = [[name for name, _ in g] for g in group_by_bytes(iter(named), budget)]
    want = [[named[i][0] for i in g] for g in reference_groups([nbytes(t) for _, t in named], budget)]
    assert got == want
    sizes = {n: nbytes(t) for n, t in named}
    for g in got:
        assert len(g) == 1 or sum(sizes[n] for n in g) <= budget


def test_flat_bucket_round_trip_is_bitwise_and_aligned():
    named = synthetic()
    bucket = FlatBucket.pack(named)
    metas, size = plan_layout(named)
    assert bucket.nbytes == size and bucket.buffer.dtype == torch.uint8
    assert [m.name for m in bucket.metas] == [n for n, _ in named]
    ends = 0
    for m in bucket.metas:
        assert m.offset % ALIGN == 0 and m.offset >= ends  # aligned, no overlap
        ends = m.offset + m.nbytes
    for (name, want), (got_name, got) in zip(named, bucket.unpack()):
        assert got_name == name and same(got, want.contiguous())
        assert got.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()  # views, no copy


def test_flat_bucket_wrap_shares_memory():
    t = torch.randn(5, 6)
    bucket = FlatBucket.wrap("w", t)
    (name, view), = bucket.unpack()
    assert name == "w" and same(view, t) and view.data_ptr() == t.data_ptr()
    with pytest.raises(ValueError, match="not contiguous"):
        FlatBucket.wrap("w", t.t())


class CountingTracker(MemoryTracker):
    """A MemoryTracker that also counts the buffers it is told about."""

    allocations = 0

    def track_storage(self, buffer):
        self.allocations += 1
        return super().track_storage(buffer)


def test_bucket_packer_reuses_one_buffer_and_bounds_memory():
    named = synthetic()
    budget = 8192
    tracker = CountingTracker()
    packer = BucketPacker(budget, "cpu", tracker=tracker)
    got, sizes = [], []  # the size of the buffer behind each bucket
    for bucket in packer.buckets(iter(named)):
        assert len(bucket.metas) == 1 or bucket.nbytes <= budget
        sizes.append(bucket.buffer.untyped_storage().nbytes())
        got += [(n, t.clone()) for n, t in bucket.unpack()]
        del bucket
    assert [n for n, _ in got] == [n for n, _ in named]
    assert all(same(g, w.contiguous()) for (_, g), (_, w) in zip(got, named))
    largest = max(nbytes(t) for _, t in named)
    # two allocations: the bucket-sized buffer, then one grown for the 64 KB tensor, each reused while it lasts
    # (counted by the tracker, not by address: the grown buffer may take the freed one's, the packer frees it first)
    assert tracker.allocations == 2 and len(sizes) > 2, (tracker.allocations, sizes)
    assert sizes == sorted(sizes) and sizes[0] >= budget and sizes[-1] >= largest, sizes
    assert tracker.peak <= max(budget, largest) + ALIGN, "the smaller buffer outlived its replacement"
    packer.release()
    assert tracker.live == 0


def test_bucket_packer_wraps_large_tensors_without_copy():
    big = torch.randn(100, 100)
    packer = BucketPacker(4096, "cpu", wrap_large=True)
    buckets = list((b.metas, b.buffer.data_ptr()) for b in packer.buckets([("s", torch.ones(3)), ("big", big)]))
    assert [m.name for m in buckets[1][0]] == ["big"] and buckets[1][1] == big.data_ptr()


def test_bucket_mb_validation():
    assert bucket_bytes_from_mb(512) == 512 * 1024 * 1024
    assert bucket_bytes_from_mb(0.001) % ALIGN == 0
    with pytest.raises(ValueError, match="sync_bucket_mb"):
        bucket_bytes_from_mb(0)


# ------------------------------------------------------------------------------------ in-process + memory

def test_in_process_channel_passes_references_in_groups():
    named = synthetic()
    channel = InProcessChannel(8192)
    channel.send(iter(named))
    groups = [[(n, t) for n, t in g] for g in channel.receive_buckets()]
    assert [[n for n, _ in g] for g in groups] == [[n for n, _ in g] for g in group_by_bytes(iter(named), 8192)]
    flat = [x for g in groups for x in g]
    assert all(got is want for (_, got), (_, want) in zip(flat, named))  # the very same tensors: no copy
    s = channel.stats
    assert (s.buckets, s.tensors, s.bytes) == (len(groups), len(named), sum(nbytes(t) for _, t in named))


def fresh_stream(n=20, numel=1024):
    """Tensors created on demand (like an exporter's gathered tensors), so holding them costs memory."""
    for i in range(n):
        yield f"w{i}", torch.full((numel,), float(i))  # 4 KB each


def test_peak_extra_memory_is_bounded_and_catches_a_leaking_consumer():
    budget, tensor, n = 8192, 4096, 20  # buckets of two tensors
    channel = InProcessChannel(budget)
    channel.send(fresh_stream(n))
    for group in channel.receive_buckets():
        del group
    # one full bucket plus the next bucket's first tensor, pulled before the bucket is handed over; holding
    # two buckets at once (a bucket kept alive while the next fills) would read 16 KB
    assert channel.stats.buckets == n // 2
    assert channel.stats.peak_extra_bytes == budget + tensor

    kept = []
    leaky = InProcessChannel(budget)
    leaky.send(fresh_stream(n))
    for group in leaky.receive_buckets():
        kept.append(group)  # a consumer that never lets go
    assert leaky.stats.peak_extra_bytes == n * tensor


# ------------------------------------------------------------------------------------------------ checksum

def naive_checksum(t: torch.Tensor) -> int:
    """The documented formula as a loop: words in rows of CHECKSUM_ROW, row sum of word*(column+1), rows folded."""
    flat = t.contiguous().reshape(-1)
    size = flat.element_size()
    words = flat.view(torch.int32 if size >= 4 else torch.int16 if size == 2 else torch.uint8).tolist()
    total = len(words) % CHECKSUM_MOD
    for start in range(0, len(words), CHECKSUM_ROW):
        row = sum(w * (j + 1) for j, w in enumerate(words[start:start + CHECKSUM_ROW]))
        total = (total * 1_000_003 + row) % CHECKSUM_MOD
    return total


@pytest.mark.parametrize("name", ["a", "b", "c", "d", "f", "g", "h"])
def test_checksum_matches_naive_loop(name):
    t = dict(synthetic())[name]
    assert checksum(t) == naive_checksum(t)


def test_checksum_over_several_rows_and_slabs(monkeypatch):
    import rlhf_mcore.sync.verify as verify

    monkeypatch.setattr(verify, "_SLAB_WORDS", 2 * CHECKSUM_ROW)  # force several slabs and a padded last row
    t = torch.randn(5 * CHECKSUM_ROW + 7)
    assert checksum(t) == naive_checksum(t)


def test_checksum_sees_one_bit_and_a_swap():
    t = torch.randn(1000)
    base = checksum(t)
    flipped = t.clone()
    flipped.view(torch.int32)[123] ^= 1  # lowest mantissa bit
    assert checksum(flipped) != base
    swapped = t.clone()
    swapped[[3, 700]] = swapped[[700, 3]]
    assert checksum(swapped) != base
    assert checksum(t.clone()) == base


def test_compare_checksums_names_the_tensor():
    tap = ChecksumTap()
    sent = list(tap.wrap(synthetic()))
    got = {n: fingerprint(t) for n, t in sent}
    compare_checksums(tap.sums, got)
    bad = dict(got, c=fingerprint(torch.zeros(123, dtype=torch.int64)))
    with pytest.raises(WeightSyncError, match="'c'"):
        compare_checksums(tap.sums, bad)
    with pytest.raises(WeightSyncError, match="'e'.*not received"):
        compare_checksums(tap.sums, {k: v for k, v in got.items() if k != "e"})


# --------------------------------------------------------------------------------- rollout engines, verify

@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir(**MODEL)


@pytest.fixture(scope="module")
def model3_dir(tiny_model_dir):
    """3 layers: PP=2 stages of 2 and 1 layers."""
    return tiny_model_dir(**{**MODEL, "layers": 3})


def native(model_dir, load=False):
    from rlhf_mcore.rollout import build_rollout_engine

    return build_rollout_engine("native", model_dir, max_num_seqs=2, max_model_len=16, load_weights=load)


def test_sync_into_native_engine_verified_and_bounded(model_dir):
    from rlhf_mcore.rollout.native.weights import iter_safetensors

    engine, reference = native(model_dir), native(model_dir, load=True)
    sizes = [nbytes(t) for _, t in iter_safetensors(model_dir)]
    bucket_mb = 0.05
    # streamed, as an exporter does: a list of all tensors would keep every one alive (and the tracker says so)
    metrics = sync_actor_to_rollout(iter_safetensors(model_dir), engine, None, bucket_mb=bucket_mb, verify=True)
    for got, want in zip(engine.weights.tensors(), reference.weights.tensors()):
        assert same(got, want)
    largest = max(sizes)
    assert metrics["sync/tensors"] == len(sizes) and metrics["sync/bytes"] == sum(sizes)
    assert metrics["sync/buckets"] > 1 and metrics["sync/seconds"] > 0 and metrics["sync/verify_seconds"] > 0
    assert 0 < metrics["sync/peak_extra_bytes"] <= bucket_bytes_from_mb(bucket_mb) + largest


class CorruptInTransit:
    """A rollout engine wrapper that damages one tensor on its way in (as a broken transport would)."""

    def __init__(self, engine, victim):
        self.engine, self.victim = engine, victim

    def update_weights(self, named):
        out = []
        for name, t in named:
            if name == self.victim:
                t = t.clone()
                t.view(-1)[t.numel() // 2] += 1e-3
            out.append((name, t))
        self.engine.update_weights(out)

    def hf_weight_shards(self):
        from rlhf_mcore.sync import engine_hf_shards

        return engine_hf_shards(self.engine).values()


def test_corrupted_tensor_fails_verification_with_its_name(model_dir):
    from rlhf_mcore.rollout.native.weights import iter_safetensors

    victim = "model.layers.1.self_attn.k_proj.weight"
    engine = CorruptInTransit(native(model_dir), victim)
    with pytest.raises(WeightSyncError, match=victim.replace(".", r"\.")):
        sync_actor_to_rollout(iter_safetensors(model_dir), engine, None, bucket_mb=0.05, verify=True)
    sync_actor_to_rollout(iter_safetensors(model_dir), engine.engine, None, verify=True)  # undamaged: passes


def test_verifier_reads_the_engine_back(model_dir):
    from rlhf_mcore.rollout.native.weights import iter_safetensors

    engine = native(model_dir)
    verifier = EngineVerifier(engine)
    engine.update_weights(verifier.wrap(iter_safetensors(model_dir)))
    verifier.verify()
    engine.weights.layers[0].gate_up[-1, 0] += 1.0  # the last row of the fused [gate; up]: up_proj
    with pytest.raises(WeightSyncError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        verifier.verify()

    partial = EngineVerifier(native(model_dir))
    partial.engine.update_weights(partial.wrap(
        (n, t) for n, t in iter_safetensors(model_dir) if n != "model.norm.weight"))
    with pytest.raises(WeightSyncError, match=r"model\.norm\.weight.*never sent"):
        partial.verify()


def test_sync_into_hf_engine_verified(model_dir):
    from rlhf_mcore.rollout import build_rollout_engine
    from rlhf_mcore.rollout.native.weights import iter_safetensors

    engine = build_rollout_engine("hf", model_dir, device="cpu")
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    sync_actor_to_rollout(iter_safetensors(model_dir), engine, None, bucket_mb=0.05, verify=True)
    victim = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(WeightSyncError, match=victim.replace(".", r"\.")):
        sync_actor_to_rollout(iter_safetensors(model_dir), CorruptInTransit(engine, victim), None, verify=True)


def test_verify_rejects_an_engine_it_cannot_read():
    class Opaque:
        def update_weights(self, named):
            list(named)

    with pytest.raises(TypeError, match="sync_verify=false"):
        sync_actor_to_rollout(iter(synthetic()), Opaque(), None, verify=True)


# ------------------------------------------------------------------------------------------ other processes

ENV = {**CPU, "PYTHONWARNINGS": "ignore"}  # CPU fp32, what the tolerances are calibrated on (a GPU would build bf16)


@pytest.mark.slow
def test_shared_memory_transport_to_another_process(model_dir, tmp_path):
    out = tmp_path / "ipc.json"
    run("tests/scripts/sync_ipc.py", "--model", str(model_dir), "--out", str(out), env_extra=ENV)
    r = json.loads(out.read_text())
    rx = r["receiver"]
    assert r["receiver_exitcode"] == 0
    assert rx["synthetic"] == r["sent"]  # names, order, dtypes, shapes, checksums
    assert rx["synthetic_buckets"] == r["synthetic_stats"]["buckets"] >= 3
    s = r["synthetic_stats"]
    assert s["peak_extra_bytes"] <= 16 * 1024 + s["largest_tensor_bytes"] + ALIGN
    assert rx["engine_generations"] == r["reference_generations"]
    assert rx["engine_buckets"] == r["engine_stats"]["buckets"] > 1
    assert rx["serialized"] == r["serialized_sent"]


@pytest.fixture(scope="module")
def distributed(model_dir, model3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sync_cases")
    run("tests/scripts/sync_cases.py", "--model", str(model_dir), "--model3", str(model3_dir), "--out", str(out),
        nproc=4, timeout=900, env_extra=ENV)
    return json.loads((out / "results.json").read_text())


def hf_tensor_count(model_dir) -> int:
    from safetensors import safe_open

    with safe_open(str(next(Path(model_dir).glob("*.safetensors"))), framework="pt") as f:
        return len(list(f.keys()))


def check_sync(report: dict, n_tensors: int):
    c = report["compare"]
    assert (c["missing"], c["extra"], c["differ"]) == ([], [], []) and c["count"] == n_tensors
    m = report["metrics"]
    bucket = bucket_bytes_from_mb(0.05)
    assert m["sync/tensors"] == n_tensors and m["sync/buckets"] == m["update_calls"] > 1
    assert 0 < m["sync/peak_extra_bytes"] <= bucket + m["sync/largest_tensor_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("rollout", ["rollout_tp1", "rollout_tp2"])
def test_train_2x2_to_rollout_bitwise(distributed, model_dir, rollout):
    n = hf_tensor_count(model_dir)
    for rank, r in enumerate(distributed["export@2x2"]):
        check_sync(r[rollout], n)
        assert r[rollout]["generations"] == r["reference_generations"], f"rank {rank}"


@pytest.mark.slow
def test_train_4x1_to_rollout_tp2_bitwise(distributed, model_dir):
    for r in distributed["export@4x1"]:
        check_sync(r, hf_tensor_count(model_dir))
        assert r["generations"] == r["reference_generations"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["uneven@2x2", "uneven@1x2"])
def test_uneven_pipeline_stages_to_rollout_bitwise(distributed, model3_dir, layout):
    for r in distributed[layout]:
        check_sync(r, hf_tensor_count(model3_dir))
        assert r["layers"] == ([0, 1] if r["pp_rank"] == 0 else [2])
        assert r["generations"] == r["reference_generations"]


@pytest.mark.slow
@pytest.mark.parametrize("rollout", ["rollout_tp1", "rollout_tp2"])
def test_after_ppo_update_rollout_matches_saved_checkpoint(distributed, model_dir, rollout):
    for rank, r in enumerate(distributed["update@2x2"]):
        got = r[rollout]
        check_sync(got, hf_tensor_count(model_dir))  # bitwise equal to save_hf_checkpoint's safetensors
        assert got["generations"] == r["reference_generations"], f"rank {rank}: rollout != fresh engine"
        assert got["generations"] != got["generations_before"], "the update did not change generations"


@pytest.mark.slow
def test_broadcast_transport_over_gloo(distributed):
    roles = {"world_from_0": {0}, "sub_from_3": {3}}
    members = {"world_from_0": {0, 1, 2, 3}, "sub_from_3": {1, 3}}
    for label in roles:
        for rank, r in enumerate(distributed["broadcast"]):
            if rank not in members[label]:
                assert label not in r
                continue
            got = r[label]
            if rank in roles[label]:
                assert got["role"] == "sender" and got["buckets"] >= 3
                assert got["peak_extra_bytes"] <= bucket_bytes_from_mb(0.025) + got["largest_tensor_bytes"]
            else:
                c = got["compare"]
                assert got["role"] == "receiver" and got["order"]
                assert (c["missing"], c["extra"], c["differ"]) == ([], [], []) and c["count"] == 7


class RecordingComm:
    """A source's end of a broadcast that keeps what it sent (objects, and a copy of each tensor)."""

    def __init__(self):
        self.objects, self.tensors = [], []

    def broadcast_object(self, obj, src):
        self.objects.append(obj)
        return obj

    def broadcast(self, tensor, src):
        self.tensors.append(tensor.clone())


class ReplayComm:
    """A receiver's end that gets, in order, what a RecordingComm's source sent (`tensor.copy_` on the calling
    thread's current stream: the staged receive's own on CUDA)."""

    def __init__(self, sent: RecordingComm):
        self.objects, self.tensors = iter(sent.objects), iter(sent.tensors)

    def broadcast_object(self, obj, src):
        return next(self.objects)

    def broadcast(self, tensor, src):
        tensor.copy_(next(self.tensors))


class Sink:
    def __init__(self):
        self.received = {}

    def update_weights(self, group):
        self.received.update((name, t.clone()) for name, t in group)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the receive on its own stream)"))])
def test_staged_receive_in_process_is_bitwise(device):
    """StagedReceive's thread on the device (CUDA: its own stream, while the main thread keeps the default
    stream busy with GEMMs): every tensor arrives bitwise, in order, checksums verified, and nothing is loaded
    before `load_into`. Mutation: the thread's stream not synchronized before it ends (`stream.synchronize()`
    dropped) -> on CUDA the load may read unfinished copies (not deterministic: the bitwise check is what
    catches it when it happens); mutation: `receive_buckets(keep=True)` -> `keep=False` (one buffer reused) ->
    earlier buckets are overwritten: the bitwise check fails on CPU and CUDA."""
    want = [(n, t.to(device)) for n, t in synthetic(seed=5)]
    sent = RecordingComm()
    BroadcastSender(sent, 0, bucket_bytes_from_mb(0.004), device, checksums=True).send(iter(want))
    assert sum(o[0] is not None for o in sent.objects) >= 3  # several buckets
    staged, sink = StagedReceive(ReplayComm(sent), 0, device=device, verify=True), Sink()
    if device == "cuda":
        x = torch.randn(2048, 2048, device=device)
        for _ in range(50):
            x = torch.tanh(x @ x)  # the default stream busy meanwhile
    assert sink.received == {}
    metrics = staged.load_into(sink)
    assert list(sink.received) == [n for n, _ in want]
    assert all(same(sink.received[n], t.contiguous()) for n, t in want)
    assert metrics["sync/bytes"] == sum(nbytes(t) for _, t in want) and metrics["sync/receive_seconds"] > 0


def test_staged_receive_error_reaches_load_into():
    """A failure inside the receive thread (here the link breaking after the first bucket) is raised by
    `load_into` in the caller's thread, and nothing is loaded. Mutation: the thread's `except` storing nothing
    (the error only printed by the thread) -> load_into returns having loaded one bucket of nine."""

    class Broken(ReplayComm):
        def broadcast(self, tensor, src):
            if getattr(self, "seen", False):
                raise ConnectionError("link down")
            self.seen = True
            super().broadcast(tensor, src)

    sent = RecordingComm()
    BroadcastSender(sent, 0, bucket_bytes_from_mb(0.004), "cpu").send(iter(synthetic(seed=5)))
    staged, sink = StagedReceive(Broken(sent), 0, device="cpu"), Sink()
    with pytest.raises(RuntimeError, match="staged weight receive failed: ConnectionError: link down"):
        staged.load_into(sink)
    assert sink.received == {}


@pytest.mark.slow
def test_staged_receive_completes_while_the_receiver_is_busy(distributed):
    """`StagedReceive` (one_step_off's `async_training.prefetch_weights`): ranks 1-3 take rank 0's 16 MB
    broadcast in the background while their main threads wait for the key rank 0 sets only after its send
    returned, then load it: bitwise what was sent, in order, checksums verified, the whole stream held until the
    load (its cost: a second copy). Mutation: `StagedReceive.__init__` not starting the thread (`load_into` then
    receives) -> every receiver's store.wait times out and the launch fails."""
    for rank, r in enumerate(distributed["staged"]):
        if rank == 0:
            assert r == {"role": "sender", "buckets": 4}
            continue
        c, m = r["compare"], r["metrics"]
        assert r["role"] == "receiver" and r["order"], rank
        assert (c["missing"], c["extra"], c["differ"]) == ([], [], []) and c["count"] == 4
        assert m["sync/bytes"] == 4 * 2**22 and m["sync/buckets"] == 4
        assert m["sync/peak_extra_bytes"] >= m["sync/bytes"] and m["sync/receive_seconds"] > 0


@pytest.mark.slow
def test_collectives_over_gloo(distributed):
    """rlhf_mcore.parallel.collectives at world size 4 (the trainer's DP sums, PRIME's DP max, the coordinator's
    plans): a sum over the world, a max over a subgroup (ranks {1, 3} only), rank 2's object on every rank.
    Mutation: `group_all_reduce` ignores `op` (always a sum) -> fails; mutation: `broadcast_object` returns its own
    `obj` -> fails."""
    for rank, r in enumerate(distributed["collectives"]):
        assert r["sum"] == [10.0, -6.0] and r["alone"], f"rank {rank}: {r}"
        assert r["object"] == {"from": 2, "items": [2, 2]}, f"rank {rank}: {r}"
        assert r.get("max_sub") == ([4.0, -1.0] if rank in (1, 3) else None), f"rank {rank}: {r}"


def test_sync_memory_measurement_keeps_the_step_peak(monkeypatch):
    """A sync resets the allocator's peak to measure its own; the trainer's per-step peak must still see what the
    step reached before (it logged only the post-sync peak: 7 GiB for a 30 GiB GRPO step). Fake allocator."""
    from rlhf_mcore.sync import memory

    alloc = {"now": 2 << 30, "peak": 30 << 30}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: alloc["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: alloc["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: alloc.update(peak=alloc["now"]))
    monkeypatch.setattr(memory, "_CARRIED_PEAK", {})
    tracker = MemoryTracker(torch.device("cuda", 0))
    tracker.start()  # the sync begins: allocator peak reset to 2 GiB
    alloc["peak"] = 3 << 30  # the sync's own buckets
    assert tracker.cuda_peak_delta() == 1 << 30
    assert memory.device_peak_bytes() == 30 << 30  # the step's peak survives
    memory.reset_device_peak()  # the trainer starts the next step's window
    assert memory.device_peak_bytes() == 2 << 30
