"""The train engine (rlhf_mcore.engine).

Single-process unit tests: the chunked log-prob/entropy function against a full softmax, sequence balancing
against brute force, the packing maps against a plain loop, the FLOP model by hand, config conversion,
storage offload.

Distributed tests (marked slow): three torchrun launches of tests/scripts/engine_cases.py on a 4-layer tiny
Qwen2 model — 1 process (the reference: transformers' log-probs, TP=PP=DP=1 updates, gradient accumulation,
offload, critic), 2 processes (TP=2, DP=2, PP=2 with virtual stages, checkpoint TP=2 -> TP=1, vocab-parallel
log-probs at TP=2) and 4 processes (TP=2 × PP=2). They run concurrently (the 1-process launch uses the core
the others leave idle at start-up); every comparison is against the single-process run or transformers.
"""
from __future__ import annotations

import itertools
import json
import math
import subprocess
from pathlib import Path

import launcher
import pytest
import torch

from rlhf_mcore.engine.balance import (
    greedy_partition,
    karmarkar_karp,
    partition_balanced,
    partition_spread,
    split_by_token_budget,
)
from rlhf_mcore.engine.config import EngineConfig
from rlhf_mcore.engine.flops import (
    FlopShape,
    effective_seqlen,
    forward_flops,
    mfu,
    peak_flops,
    peak_flops_and_source,
    train_flops,
)
from rlhf_mcore.engine.logprobs import get_logprob_backend, register_logprob_backend
from rlhf_mcore.engine.micro_batches import plan_micro_batches
from rlhf_mcore.engine.offload import StorageOffloader
from rlhf_mcore.engine.packing import build_model_inputs
from rlhf_mcore.kernels.logprob_reference import vocab_parallel_logprobs

pytestmark = pytest.mark.cost(85)

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "engine_cases.py"

# ============================================================================ log-probs (single process)


def naive_logprobs(logits, labels, vocab, temperature):
    """log_softmax over the real vocabulary (fp64), gathered at labels; and the entropy."""
    z = logits[..., :vocab].double() / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, labels[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature,vocab,padded,chunk,subset", [
    (1.0, 50, 50, 1000, False), (0.6, 37, 48, 5, False), (1.7, 64, 128, 3, True), (1.0, 10, 16, 1, True)])
def test_logprobs_match_full_softmax(temperature, vocab, padded, chunk, subset):
    g = torch.Generator().manual_seed(vocab)
    logits = (4 * torch.randn(3, 7, padded, generator=g)).requires_grad_(True)  # (B, S, Vp)
    flat = logits.reshape(-1, padded)
    if subset:
        rows = torch.randperm(21, generator=g)[:9]
        labels = torch.randint(0, vocab, (9,), generator=g)
        lp, ent = vocab_parallel_logprobs(logits, labels, rows=rows, temperature=temperature, vocab_size=vocab,
                                          chunk_size=chunk)
        ref_lp, ref_ent = naive_logprobs(flat[rows], labels, vocab, temperature)
    else:
        labels = torch.randint(0, vocab, (3, 7), generator=g)
        lp, ent = vocab_parallel_logprobs(logits, labels, temperature=temperature, vocab_size=vocab, chunk_size=chunk)
        ref_lp, ref_ent = naive_logprobs(logits, labels, vocab, temperature)
    assert lp.dtype == torch.float32 and lp.shape == ref_lp.shape
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5, rtol=0)
    assert torch.allclose(ent.double(), ref_ent, atol=1e-5, rtol=0)
    # gradients of an arbitrary combination of both outputs
    w1, w2 = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    grad, = torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(), logits)
    ref_grad, = torch.autograd.grad((ref_lp * w1.double()).sum() + (ref_ent * w2.double()).sum(), logits)
    assert torch.allclose(grad.double(), ref_grad.double(), atol=1e-5, rtol=0)
    assert not grad[..., vocab:].any()  # padding columns get no gradient
    if subset:  # rows never scored get no gradient either
        untouched = torch.ones(21, dtype=torch.bool)
        untouched[rows] = False
        assert not grad.reshape(-1, padded)[untouched].any()


def test_logprobs_bf16_logits_are_scored_in_fp32():
    g = torch.Generator().manual_seed(0)
    logits = (8 * torch.randn(5, 300, generator=g)).to(torch.bfloat16)
    labels = torch.randint(0, 300, (5,), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, labels, chunk_size=2)
    ref_lp, ref_ent = naive_logprobs(logits.float(), labels, 300, 1.0)  # the same bf16 values, in fp64
    assert lp.dtype == torch.float32
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5, rtol=0)
    assert torch.allclose(ent.double(), ref_ent, atol=1e-5, rtol=0)


def test_logprobs_without_entropy_and_only_entropy_gradient():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 20, generator=g, requires_grad=True)
    labels = torch.randint(0, 20, (6,), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, labels, compute_entropy=False)
    assert ent is None
    lp2, ent2 = vocab_parallel_logprobs(logits, labels)
    assert torch.equal(lp, lp2)
    grad, = torch.autograd.grad(ent2.sum(), logits)  # the log-prob output unused
    ref_lp, ref_ent = naive_logprobs(logits, labels, 20, 1.0)
    ref_grad, = torch.autograd.grad(ref_ent.sum(), logits)
    assert torch.allclose(grad.double(), ref_grad.double(), atol=1e-5, rtol=0)


def test_logprobs_reject_bad_arguments():
    x, y = torch.randn(4, 10), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(x, y, temperature=0.0)
    with pytest.raises(ValueError, match="vocab_size=11 exceeds"):
        vocab_parallel_logprobs(x, y, vocab_size=11)
    with pytest.raises(ValueError, match="rows"):
        vocab_parallel_logprobs(x, y, rows=torch.arange(3))
    with pytest.raises(ValueError, match="pass `rows`"):
        vocab_parallel_logprobs(x, y[:3])


def test_logprob_backend_registry():
    assert get_logprob_backend("torch") is vocab_parallel_logprobs
    with pytest.raises(ValueError, match="known: .*torch"):
        get_logprob_backend("no-such-kernel")
    register_logprob_backend("test-alias", vocab_parallel_logprobs)
    assert get_logprob_backend("test-alias") is vocab_parallel_logprobs


# ============================================================================ balancing


def brute_force_makespan(seqlens, k, equal_size):
    best = math.inf
    for assign in itertools.product(range(k), repeat=len(seqlens)):
        if equal_size and any(assign.count(j) != len(seqlens) // k for j in range(k)):
            continue
        sums = [sum(s for s, a in zip(seqlens, assign) if a == j) for j in range(k)]
        best = min(best, max(sums))
    return best


def check_partition(parts, n, k, equal_size):
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(n))
    if equal_size:
        assert {len(p) for p in parts} == {n // k}


@pytest.mark.parametrize("equal_size", [False, True])
@pytest.mark.parametrize("k", [2, 3])
def test_partitions_are_valid_and_near_optimal(k, equal_size):
    g = torch.Generator().manual_seed(k)
    for trial in range(12):
        n = 6 if equal_size else 5 + trial % 3
        seqlens = torch.randint(1, 100, (n,), generator=g).tolist()
        opt = brute_force_makespan(seqlens, k, equal_size)
        for fn in (karmarkar_karp, greedy_partition):
            parts = fn(seqlens, k, equal_size)
            check_partition(parts, n, k, equal_size)
            makespan = max(sum(seqlens[i] for i in p) for p in parts)
            # both methods are within 4/3 of the optimum (Graham's LPT bound; the differencing method's
            # worst case is lower still)
            assert makespan <= 4 / 3 * opt + 1e-9, (fn.__name__, seqlens, parts, opt)


def test_karmarkar_karp_beats_greedy_on_long_tails():
    g = torch.Generator().manual_seed(0)
    kk, greedy = [], []
    for _ in range(40):
        seqlens = (16 - 300 * torch.rand(64, generator=g).log()).long().tolist()  # exponential lengths
        kk.append(partition_spread(seqlens, karmarkar_karp(seqlens, 8, equal_size=True)))
        greedy.append(partition_spread(seqlens, greedy_partition(seqlens, 8, equal_size=True)))
    assert sum(kk) < sum(greedy)


def test_partition_errors_name_the_fix():
    with pytest.raises(ValueError, match="divisible by 3"):
        karmarkar_karp([1, 2, 3, 4], 3, equal_size=True)
    with pytest.raises(ValueError, match="karmarkar_karp"):
        partition_balanced([1, 2], 2, method="random")
    assert partition_balanced([5, 1, 4, 2], 2) == karmarkar_karp([5, 1, 4, 2], 2, True)


def test_split_by_token_budget():
    g = torch.Generator().manual_seed(3)
    seqlens = torch.randint(10, 200, (37,), generator=g).tolist()
    parts = split_by_token_budget(seqlens, 400)
    assert sorted(i for p in parts for i in p) == list(range(37))
    assert all(sum(seqlens[i] for i in p) <= 400 for p in parts)
    assert len(parts) >= math.ceil(sum(seqlens) / 400)
    parts4 = split_by_token_budget(seqlens, 400, multiple_of=4)
    assert len(parts4) % 4 == 0 and all(sum(seqlens[i] for i in p) <= 400 for p in parts4)
    with pytest.raises(ValueError, match="exceeds ppo_max_token_len_per_gpu=150"):
        split_by_token_budget(seqlens, 150)
    with pytest.raises(ValueError, match="interleaved"):
        split_by_token_budget([5, 5], 100, multiple_of=4)


def test_plan_micro_batches_fixed_and_errors():
    assert plan_micro_batches([3] * 6, micro_batch_size=2, use_dynamic_bsz=False, max_token_len=1) == [
        [0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="ppo_micro_batch_size_per_gpu"):
        plan_micro_batches([3] * 6, micro_batch_size=4, use_dynamic_bsz=False, max_token_len=1)
    with pytest.raises(ValueError, match="multiple of the pipeline size 2"):
        plan_micro_batches([3] * 6, micro_batch_size=2, use_dynamic_bsz=False, max_token_len=1, multiple_of=2)


# ============================================================================ packing


def padded_batch():
    """Three rows of the trainer's layout: left-padded prompt (P=4) + right-padded response (R=3)."""
    ids = torch.arange(100, 121).view(3, 7)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0],   # prompt 3, response 2
                         [1, 1, 1, 1, 1, 1, 1],   # prompt 4, response 3
                         [0, 0, 0, 1, 1, 0, 0]])  # prompt 1, response 1
    return ids, mask


def loop_reference(ids, mask, R):
    """Per row: the real tokens in order, and for each valid response column j the index (within the row's
    real tokens) of the token that predicts it."""
    out = []
    L = ids.shape[1]
    for row_ids, row_mask in zip(ids.tolist(), mask.tolist()):
        real = [t for t, m in zip(row_ids, row_mask) if m]
        preds = {}
        k = -1
        for col, m in enumerate(row_mask):
            if m:
                k += 1
                if col >= L - R:
                    preds[col - (L - R)] = k - 1
        out.append((real, preds))
    return out


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("pad_to_multiple_of", [1, 4])
def test_model_inputs_match_a_loop(packed, pad_to_multiple_of):
    ids, mask = padded_batch()
    R = 3
    x = build_model_inputs(ids, mask, R, packed=packed, pad_to_multiple_of=pad_to_multiple_of)
    ref = loop_reference(ids, mask, R)
    flat_ids = x.input_ids.reshape(-1)
    flat_pos = x.position_ids.reshape(-1)
    if packed:
        assert x.attention_mask is None and x.input_ids.shape[0] == 1
        assert x.input_ids.shape[1] % pad_to_multiple_of == 0
        cu = x.packed_seq_params.cu_seqlens_q.tolist()
        assert cu[:4] == [0, 5, 12, 14] and x.packed_seq_params.qkv_format == "thd"
        starts = cu[:3]
    else:
        S = x.input_ids.shape[1]
        assert S % pad_to_multiple_of == 0 and S >= 7
        assert x.attention_mask.shape == (3, 1, S, S)
        assert torch.equal(x.attention_mask[0, 0], torch.triu(torch.ones(S, S, dtype=torch.bool), 1))
        starts = [0, S, 2 * S]
    expected_rows, expected_labels, expected_grid = [], [], []
    for b, ((real, preds), start) in enumerate(zip(ref, starts)):
        assert flat_ids[start:start + len(real)].tolist() == real  # real tokens first, in order
        assert flat_pos[start:start + len(real)].tolist() == list(range(len(real)))  # positions restart
        for j, k in sorted(preds.items()):
            expected_rows.append(start + k)
            expected_labels.append(ids[b, ids.shape[1] - R + j].item())
            expected_grid.append(b * R + j)
    assert x.rows.tolist() == expected_rows
    assert x.labels.tolist() == expected_labels
    assert x.grid_index.tolist() == expected_grid
    # the label of every scored row is the next token in the model's layout
    assert flat_ids[x.rows + 1].tolist() == x.labels.tolist()
    assert x.num_tokens == 14 and x.seqlens == [5, 7, 2]
    grid = x.to_grid(torch.arange(1.0, len(expected_rows) + 1))
    assert grid.tolist() == [[1, 2, 0], [3, 4, 5], [6, 0, 0]]


@pytest.mark.parametrize("packed", [True, False])
def test_uniform_shape_padding_keeps_the_map(packed):
    ids, mask = padded_batch()
    plain = build_model_inputs(ids, mask, 3, packed=packed)
    big = build_model_inputs(ids, mask, 3, packed=packed, pad_to_length=20, pad_to_rows=5)
    assert big.input_ids.shape == ((1, 20) if packed else (5, 20))
    if packed:
        assert big.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 12, 14, 20]  # one dummy document
        assert torch.equal(big.rows, plain.rows)
    else:  # rows index (b * S + position): S changed, the tokens they point at did not
        assert torch.equal(big.input_ids.reshape(-1)[big.rows], plain.input_ids.reshape(-1)[plain.rows])
    assert torch.equal(big.labels, plain.labels) and torch.equal(big.grid_index, plain.grid_index)


def test_model_inputs_reject_an_empty_prompt():
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="empty prompt"):
        build_model_inputs(ids, torch.tensor([[0, 0, 1, 1]]), 2, packed=True)


# ============================================================================ FLOPs, config, offload


def test_flop_model_by_hand():
    shape = FlopShape(num_layers=2, hidden_size=8, num_attention_heads=2, num_query_groups=1, head_dim=4,
                      ffn_hidden_size=16, vocab_size=10)
    # per layer: QKV 8·(8+2·4)=128, out 8·8=64, MLP 3·8·16=384 -> 576; two layers 1152
    assert shape.matmul_params == 1152
    seqlens = [3, 1]
    assert effective_seqlen(seqlens) == (9 + 1) / 4
    per_token = 6 * 1152 + 6 * 2 * 8 * 2.5 + 6 * 8 * 10  # matmuls + causal attention (12·L·h·s/2) + vocab
    assert train_flops(shape, seqlens) == pytest.approx(per_token * 4)
    assert forward_flops(shape, seqlens) == pytest.approx(per_token * 4 / 3)
    assert mfu(1e12, 1.0, 2, 1e12) == 0.5 and mfu(1e12, 1.0, 2, None) is None


def test_peak_flops(monkeypatch):
    monkeypatch.delenv("RLHF_MCORE_PEAK_FLOPS", raising=False)
    assert peak_flops("cpu") is None
    monkeypatch.setenv("RLHF_MCORE_PEAK_FLOPS", "1.5e14")
    assert peak_flops_and_source("cpu") == (1.5e14, "RLHF_MCORE_PEAK_FLOPS")
    monkeypatch.setenv("RLHF_MCORE_PEAK_FLOPS", "fast")
    with pytest.raises(ValueError, match="RLHF_MCORE_PEAK_FLOPS='fast'.*989.4e12"):
        peak_flops("cpu")
    monkeypatch.delenv("RLHF_MCORE_PEAK_FLOPS")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, want in (("NVIDIA H200", 989.4e12), ("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H100 PCIe", 756.5e12),
                       ("NVIDIA H200 NVL", 835.5e12), ("NVIDIA H20", 148e12), ("NVIDIA A100-SXM4-80GB", 312e12)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        assert peak_flops(torch.device("cuda", 0)) == want, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Mystery GPU 9000")
    value, source = peak_flops_and_source(torch.device("cuda", 0))
    assert value is None and source.startswith("unknown: 'Mystery GPU 9000'") and "RLHF_MCORE_PEAK_FLOPS" in source


def test_engine_config_from_run_config():
    from rlhf_mcore.config import ActorConfig, ModelConfig, RolloutConfig

    actor = ActorConfig(ppo_mini_batch_size=16, ppo_micro_batch_size_per_gpu=4, entropy_coeff=0.01,
                        use_kl_loss=True, loss_scale_factor=512.0)
    cfg = EngineConfig.from_actor(actor, ModelConfig(path="x"), RolloutConfig(n=4, temperature=0.7), dp_size=2)
    assert (cfg.mini_batch_size, cfg.micro_batch_size, cfg.temperature) == (32, 4, 0.7)
    assert cfg.use_kl_loss and cfg.entropy_coeff == 0.01 and cfg.loss_scale_factor == 512.0
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 3"):
        EngineConfig.from_actor(actor, ModelConfig(path="x"), RolloutConfig(n=1), dp_size=3)
    with pytest.raises(ValueError, match="role="):
        EngineConfig(role="judge")


def test_storage_offloader_round_trip():
    base = torch.arange(12.0)
    view = base[3:7]  # e.g. a parameter living inside a DDP buffer
    grads = torch.full((5,), 7.0)
    off = StorageOffloader(torch.device("cpu"))
    assert off.offload("params", [base.untyped_storage()]) == 48
    assert off.offload("grads", [grads.untyped_storage()], keep_data=False) == 20
    assert base.untyped_storage().nbytes() == 0 and off.is_offloaded("params")
    assert off.onload("params") == 48 and off.onload("grads") == 20
    assert torch.equal(view, torch.arange(3.0, 7.0))
    assert torch.equal(grads, torch.zeros(5))  # gradients come back zeroed
    assert not off.is_offloaded("params")


def test_offload_host_memory_is_exact_size_and_reused():
    """The host copy of an offload is one arena sized to the storages (aligned slots, no power-of-two rounding:
    85 GiB of 7B optimizer state must not become 128), allocated once and reused by later offloads."""
    from rlhf_mcore.engine.offload import HostArena

    arena = HostArena([3, 1000, 513], pin=False)
    assert arena.offsets == [0, 512, 1536] and arena.buffer.numel() == 2560  # 512-byte aligned slots, exact total
    assert [arena.slot(i).numel() for i in range(3)] == [3, 1000, 513]

    a, b = torch.randn(1000), torch.arange(300, dtype=torch.int64)  # 4,000 and 2,400 bytes
    want_a, want_b = a.clone(), b.clone()
    off = StorageOffloader(torch.device("cpu"))
    first = None  # the first offload's host buffer, held: a reallocation could not take its address
    for _ in range(3):
        assert off.offload("optimizer", [a.untyped_storage(), b.untyped_storage()]) == 6400
        first = off.arenas["optimizer"].buffer if first is None else first
        assert off.arenas["optimizer"].buffer.numel() == 4096 + 2560
        assert off.arenas["optimizer"].buffer.data_ptr() == first.data_ptr()  # the same host memory every step
        off.onload("optimizer")
        assert torch.equal(a, want_a) and torch.equal(b, want_b)
        a.add_(1.0)  # the state changes between offloads: the copy must be fresh each time
        want_a = a.clone()


# ============================================================================ distributed (torchrun)


def _launch(nproc: int, cases: str, model_dir: Path, out: Path) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    # CPU fp32, what the tolerances are calibrated on (a GPU would build bf16)
    return launcher.start(WORKER, "--model", str(model_dir), "--out", str(out), "--cases", cases, nproc=nproc,
                          env_extra={**launcher.CPU, "PYTHONWARNINGS": "ignore"}, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    model_dir = tiny_model_dir("qwen2", layers=4)
    tmp = tmp_path_factory.mktemp("engine")
    launches = {
        "w1": (1, "hf,layout@1x1,grads,offload,critic,fp8@1x1,fusion@1x1,on_policy@1x1"),
        "w2": (2, "logprob_tp@2x1,layout@2x1,layout@1x1,layout@1x2v2,ckpt@2x1,fp8@2x1,fusion@1x2,fusion@1x1,"
                  "on_policy@1x1,on_policy@1x2,values_on_policy@1x1,values_on_policy@1x2"),
        "w4": (4, "layout@2x2,fusion@2x2,on_policy@2x2,values_on_policy@2x2"),
    }
    procs = {name: _launch(n, cases, model_dir, tmp / name) for name, (n, cases) in launches.items()}
    try:
        launcher.wait_all(procs, timeout=900)
    finally:
        for proc in procs.values():
            proc.kill()
    results = {name: json.loads((tmp / name / "results.json").read_text()) for name in procs}
    weights = {f"{name}/{case}": torch.load(tmp / name / f"{case.replace('@', '_')}.pt")["weights"]
               for name, r in results.items() for case in r if case.startswith("layout@")}
    return results, weights


LAYOUTS = [("w1", "layout@1x1"), ("w2", "layout@2x1"), ("w2", "layout@1x1"), ("w2", "layout@1x2v2"),
           ("w4", "layout@2x2")]
LAYOUT_IDS = ["1x1", "tp2", "dp2", "pp2-vpp2", "tp2xpp2"]


def grid_diff(a, b, mask=None) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    if mask is not None:
        m = torch.tensor(mask, dtype=torch.bool)
        a, b = a[m], b[m]
    return float((a - b).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("launch,case", LAYOUTS, ids=LAYOUT_IDS)
def test_logprobs_match_transformers_and_single_process(runs, launch, case):
    results, _ = runs
    hf, got, ref = results["w1"]["hf"], results[launch][case], results["w1"]["layout@1x1"]
    mask = hf["response_mask"]
    assert grid_diff(got["log_probs"], hf["log_probs"], mask) <= 1e-5
    assert grid_diff(got["entropy"], hf["entropy"], mask) <= 1e-5
    assert grid_diff(got["log_probs"], ref["log_probs"]) <= 1e-5
    # padding is zero, not garbage
    pad = [[1 - m for m in row] for row in mask]
    assert grid_diff(got["log_probs"], [[0.0] * len(r) for r in mask], pad) == 0.0
    # the padded path, token-budget micro-batches and the frozen reference engine agree with the packed path
    assert grid_diff(got["log_probs_padded"], got["log_probs"]) <= 1e-5
    assert grid_diff(got["log_probs_dynamic"], got["log_probs"]) <= 1e-5
    assert grid_diff(got["ref_log_probs"], got["log_probs"]) <= 1e-5 and got["ref_entropy_is_none"]
    if "x1" in case:  # no PP: shared-prompt packing (model.share_prompt_prefix) at this TP equals whole rows
        assert grid_diff(got["log_probs_grouped_shared"], got["log_probs_grouped"]) <= 1e-5
        assert grid_diff(got["log_probs_grouped"], got["log_probs"]) > 1e-2  # the grouped batch is another batch


@pytest.mark.slow
def test_fp8_training_at_tp2_tracks_tp1(runs):
    """FP8 decoder linears (fp8=hybrid, each recipe; CPU reference GEMMs; case_fp8's own model at init std 0.02)
    at TP=2 against TP=1, one PPO update: without FP8 the two layouts agree to fp32 rounding; with it each rank
    quantizes its own shards (scales over half of a row-parallel layer's K), so the gradient norm agrees within 2%
    and the losses within 5e-3 (measured: 0.4% and 1.6e-3, rowwise and tensorwise), and FP8 moved the gradient norm
    (the recipes ran). The delayed recipe's later micro-batches take the scales its first ones primed, per rank
    (session 41: grad norm 3.980 at TP=1, 3.977 at TP=2, 4.115 without FP8). Its MLPs run as one Function each
    (`fp8_training._fuse_swiglu_mlp`) and equal the two delayed linears exactly at both layouts. Mutations: the FP8
    linears' input-gradient all-reduce dropped -> the TP=2 gradient norm falls 16% (4.12 -> 3.47, run once); the
    fused MLP's output all-reduce dropped -> its TP=2 update leaves the two linears' (grad norm 4.017 against 3.977:
    within the TP tolerance, caught by the exact comparison; run once)."""
    results, _ = runs
    tp1, tp2 = results["w1"]["fp8@1x1"], results["w2"]["fp8@2x1"]
    assert tp2["off"]["grad_norm"] == pytest.approx(tp1["off"]["grad_norm"], rel=1e-5)
    for recipe in ("rowwise", "tensorwise", "delayed"):
        print(f"{recipe}: grad norm {tp1[recipe]['grad_norm']:.5f} (TP=1) {tp2[recipe]['grad_norm']:.5f} (TP=2), "
              f"{tp1['off']['grad_norm']:.5f} without FP8")
        assert tp2[recipe]["grad_norm"] == pytest.approx(tp1[recipe]["grad_norm"], rel=0.02), recipe
        for key in ("pg_loss", "loss"):
            assert tp2[recipe][key] == pytest.approx(tp1[recipe][key], abs=5e-3), (recipe, key)
        assert tp1[recipe]["grad_norm"] != tp1["off"]["grad_norm"]
    for run in (tp1, tp2):
        assert run["delayed"] == {**run["delayed_two_linears"], "fused_mlps": 4}
        assert run["delayed_two_linears"]["fused_mlps"] == 0


def test_gradient_accumulation_fusion_across_layouts(runs):
    """`gradient_accumulation_fusion` (weight gradients accumulated into main_grad by the GEMM) at TP=1, at PP=2
    (two pipeline stages, the output layer on the last), at DP=2 and at TP=2 x PP=2: every fused update's loss and
    gradient norm equal the single process's unfused update (fp32 on CPU: rounding only), as each layout's unfused
    update does. Mutation: the accumulation replaced by an assignment (each micro-batch's gradient overwrites the
    earlier ones') fails every fused case (run once: grad norm 11.48 against 16.40)."""
    results, _ = runs
    ref = results["w1"]["fusion@1x1"]["off"]
    for launch, case in (("w1", "fusion@1x1"), ("w2", "fusion@1x2"), ("w2", "fusion@1x1"), ("w4", "fusion@2x2")):
        for variant in ("off", "fused"):
            got = results[launch][case][variant]
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (case, variant)
            for key in ("pg_loss", "loss"):
                assert got[key] == pytest.approx(ref[key], abs=1e-6), (case, variant, key)


def test_first_mini_batch_old_log_probs_from_the_update_across_layouts(runs):
    """The update that takes its first mini-batch's old log-probs from its own forward (`on_policy`; the batch holds
    5.0 at those rows) equals the update after an old-log-prob pass -- two shuffled mini-batches a rank, two epochs
    -- in one process, at DP=2 (each rank its own rows), PP=2 (the grids broadcast from the last stage) and TP=2 x
    PP=2: loss, gradient norm and weights, and the old log-probs and entropy it writes back are the pass's. The
    shuffled first mini-batch is not the first rows. Mutation: the write-back's rows `order[:mini]` ->
    `torch.arange(mini)` fails (the later mini-batch and epoch read 5.0 where the shuffled rows were; run once: the
    single process's grad norm 14.02 against 14.15)."""
    results, _ = runs
    for launch, case in (("w1", "on_policy@1x1"), ("w2", "on_policy@1x1"), ("w2", "on_policy@1x2"),
                         ("w4", "on_policy@2x2")):
        got = results[launch][case]
        assert got["rows"] != list(range(len(got["rows"]))), case  # shuffled: not the leading rows
        for key in ("grad_norm", "pg_loss", "loss"):
            assert got["own"][key] == pytest.approx(got["pass"][key], rel=1e-5, abs=1e-6), (case, key)
        assert got["old_diff"] < 1e-5 and got["entropy_diff"] < 1e-5, case
        assert got["param_diff"] < 1e-6, case


def test_first_mini_batch_values_from_the_critic_update_across_layouts(runs):
    """The critic's update that takes its first mini-batch's values from its own forward (`on_policy`; the batch
    holds 5.0 at those rows) equals the update after a values pass -- two shuffled mini-batches a rank, two epochs,
    a value clip of 0.002 that the later mini-batches' loss reads -- at DP=2, PP=2 (the values broadcast from the last
    stage) and TP=2 x PP=2: loss, clip fraction, gradient norm and weights, and the values it writes back are the
    pass's. Mutation: critic_loss's old values zeros under on_policy -> fails (run once: the single process's
    gradient norm 0.833 against 1.416)."""
    results, _ = runs
    for case in ("values_on_policy@1x1", "values_on_policy@1x2", "values_on_policy@2x2"):
        got = results["w4" if case.endswith("2x2") else "w2"][case]
        assert got["rows"] != list(range(len(got["rows"]))), case  # shuffled: not the leading rows
        assert got["pass"]["vf_clipfrac"] > 0, case  # the clip read the old values
        for key in ("grad_norm", "vf_loss", "vf_clipfrac", "loss"):
            assert got["own"][key] == pytest.approx(got["pass"][key], rel=1e-5, abs=1e-6), (case, key)
        assert got["values_diff"] < 1e-5 and got["param_diff"] < 1e-6, case


@pytest.mark.slow
@pytest.mark.parametrize("launch,case", LAYOUTS[1:], ids=LAYOUT_IDS[1:])  # 1x1 is the reference itself
def test_ppo_update_matches_single_process(runs, launch, case):
    results, weights = runs
    got, ref = results[launch][case], results["w1"]["layout@1x1"]
    # the whole-batch loss (a forward/backward probe) drops after two updates, as in the reference run
    assert got["loss_after"]["loss"] < got["loss_before"]["loss"] - 0.05
    for when in ("loss_before", "loss_after"):
        for key in ("loss", "pg_loss", "kl_loss", "entropy", "pg_clipfrac", "approx_kl"):
            assert got[when][key] == pytest.approx(ref[when][key], abs=2e-5), (when, key)
    for m, r in zip(got["metrics"], ref["metrics"]):
        assert m["actor/grad_norm"] == pytest.approx(r["actor/grad_norm"], rel=1e-5)
        assert m["actor/pg_loss"] == pytest.approx(r["actor/pg_loss"], abs=1e-5)
    mine, reference = weights[f"{launch}/{case}"], weights["w1/layout@1x1"]
    assert mine.keys() == reference.keys()
    assert max(float((mine[k] - reference[k]).abs().max()) for k in mine) <= 1e-5
    assert grid_diff(got["log_probs_after"], ref["log_probs_after"]) <= 5e-5
    assert got["tp_mismatched_params"] == 0  # replicated parameters bitwise equal across TP ranks


@pytest.mark.slow
def test_update_metrics(runs):
    results, _ = runs
    first, second = results["w1"]["layout@1x1"]["metrics"]
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/approx_kl", "actor/ppo_kl", "actor/entropy",
                "actor/kl_loss", "actor/grad_norm", "actor/lr", "perf/actor/tokens_per_s",
                "perf/actor/tflops_per_gpu", "actor/num_optimizer_steps"):
        assert key in first and math.isfinite(first[key]), key
    assert first["actor/lr"] == 1e-4 and first["actor/num_optimizer_steps"] == 2.0
    assert first["actor/pg_clipfrac"] < second["actor/pg_clipfrac"]  # near on-policy at first, clipping later
    assert 0 < first["actor/entropy"] <= math.log(1024) and first["perf/actor/tokens_per_s"] > 0
    assert "perf/actor/mfu" not in first  # no peak FLOP/s known for a CPU: not made up


@pytest.mark.slow
def test_packed_and_padded_give_the_same_gradients(runs):
    g = runs[0]["w1"]["grads"]
    assert g["loss_packed=True"] == pytest.approx(g["loss_packed=False"], abs=1e-5)
    assert g["grad_max_abs"] > 0.1
    assert g["packed_vs_padded_grad_diff"] <= 1e-5 * max(1.0, g["grad_max_abs"])


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("variant", ["8x1", "dynamic"])
def test_gradient_accumulation_invariance(runs, variant, agg):
    g = runs[0]["w1"]["grads"]
    assert g[f"grad_diff/{variant}/{agg}"] <= 1e-5
    assert g[f"param_diff/{variant}/{agg}"] <= 1e-5
    assert g[f"loss/{variant}/{agg}"] == pytest.approx(g[f"loss/1x8/{agg}"], abs=1e-6)
    assert 1 < g["dynamic_micro_batches"] < 8


@pytest.mark.slow
def test_offload_onload_is_bit_identical(runs):
    o = runs[0]["w1"]["offload"]
    assert o["params_released"] and o["refused_while_offloaded"]
    for kind in ("params", "grads", "optimizer"):
        assert o["moved"][kind] > 0 and o["restored"][kind] == o["moved"][kind]
    # Adam's two fp32 moments (+ step counters) against the fp32 parameter buffer (+ alignment padding)
    assert 1.9 < o["moved"]["optimizer"] / o["moved"]["params"] < 2.1
    assert o["params_bitwise_equal"] and o["metrics_equal"]


@pytest.mark.slow
def test_checkpoint_saved_at_tp2_loads_at_tp1(runs):
    c = runs[0]["w2"]["ckpt@2x1"]
    assert c["saved_layout"] == [2, 1, 1] and c["loaded_layout"] == [1, 1, 2]
    assert c["log_prob_diff"] <= 1e-5
    # model, optimizer and scheduler came back: the next update is the one the saving run made
    assert c["grad_norm_resumed"] == pytest.approx(c["grad_norm_continued"], rel=1e-5)
    assert c["next_update_weight_diff"] <= 1e-5
    assert c["extra"]["note"] == "engine test" and c["global_steps"] == 2


@pytest.mark.slow
def test_value_head_fits_a_constant(runs):
    c = runs[0]["w1"]["critic"]
    assert c["final_error"] < 0.05 < c["initial_error"]
    assert c["values_zero_on_padding"]
    assert c["flop_head_width"] == 1 < c["vocab_size"]  # MFU counts the width-1 value head, not the vocabulary


@pytest.mark.slow
def test_vocab_parallel_logprobs_at_tp2(runs):
    r = runs[0]["w2"]["logprob_tp@2x1"]
    assert r["tp"] == 2
    padding_only_rank_seen = False
    for per_case in r["per_rank"]:
        for err in per_case.values():
            assert err["log_prob"] <= 1e-5 and err["entropy"] <= 1e-5
            assert err["grad"] <= 1e-5 * max(1.0, err["grad_scale"])
            padding_only_rank_seen |= err["grad_scale"] == 0.0
    assert padding_only_rank_seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: page-locks host memory")
def test_offload_arena_is_page_locked_on_cuda():
    x = torch.randn(3, 1000, device="cuda")
    want = x.clone()
    off = StorageOffloader(torch.device("cuda"))
    assert off.offload("optimizer", [x.untyped_storage()]) == 12000
    arena = off.arenas["optimizer"]
    assert arena.pinned and arena.buffer.is_pinned() and x.untyped_storage().nbytes() == 0
    off.onload("optimizer")
    assert torch.equal(x, want)
    del off, arena  # unregisters the host memory
