"""The fused Triton log-prob/entropy kernel (rlhf_mcore.kernels.fused_logprob) against the torch reference.

Without CUDA the kernels run on CPU under the Triton interpreter: `TRITON_INTERPRET=1` must be set before
the `@triton.jit` decorators run (triton decides interpreted vs compiled at decoration time), so it is set
here before triton is imported (the file skips itself if triton was imported earlier in the session).
Shapes are tiny and non-power-of-two (37 rows × 300 real columns padded to 320), with the vocabulary block
lowered so each row spans several blocks of the online softmax. With CUDA the same tests run compiled on
the GPU, plus a realistic shape (4096 × 151936 bf16) that also checks peak memory against the reference.
"""
from __future__ import annotations

import os

import pytest
import torch
from triton_kernels import import_kernel_module

pytestmark = pytest.mark.cost(5)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


fl = import_kernel_module("fused_logprob")

from rlhf_mcore.engine.logprobs import get_logprob_backend  # noqa: E402
from rlhf_mcore.kernels.logprob_reference import vocab_parallel_logprobs  # noqa: E402

ROWS, V_LOCAL, VOCAB, TEMP = 37, 320, 300, 0.7
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Several vocabulary blocks per row even at V=320, so the online rescaling is exercised."""
    monkeypatch.setattr(fl, "BLOCK_V", 64)


def make_inputs(dtype, rows=ROWS, v_local=V_LOCAL, vocab=VOCAB, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, v_local, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    return logits.to(device), labels.to(device)


def run_both(logits, labels, **kwargs):
    """(log_probs, entropy, d/d logits) of the reference and of the kernel, for random output weights."""
    g = torch.Generator().manual_seed(1)
    n = labels.numel()
    w_lp, w_ent = (torch.randn(n, generator=g).to(logits.device) for _ in range(2))
    results = []
    for fn in (vocab_parallel_logprobs, fl.fused_vocab_parallel_logprobs):
        x = logits.detach().clone().requires_grad_(True)
        lp, ent = fn(x, labels, **kwargs)
        loss = (w_lp * lp.reshape(-1)).sum()
        if ent is not None:
            loss = loss + (w_ent * ent.reshape(-1)).sum()
        loss.backward()
        results.append((lp, ent, x.grad))
    return results


def assert_close(a, b, tol, what):
    err = (a.double() - b.double()).abs().max().item()
    assert err <= tol, f"{what}: max |Δ| = {err:.3g} > {tol:g}"


def assert_grads_close(a, b, dtype, what="grad"):
    """Within `TOL` relative to max(1, |reference|), plus one rounding step of the logits' dtype for bf16
    (gradients are stored in that dtype, so a value near a rounding boundary may round either way)."""
    assert a.dtype == b.dtype == dtype
    ref = b.double().abs()
    ulp = torch.finfo(dtype).eps * ref if dtype != torch.float32 else 0.0
    err = ((a.double() - b.double()).abs() - ulp) / ref.clamp(min=1.0)
    assert err.max().item() <= TOL[dtype], f"{what}: max relative |Δ| = {err.max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("subset", [False, True], ids=["all_rows", "rows_subset"])
def test_matches_reference(dtype, subset):
    logits, labels = make_inputs(dtype)
    kwargs = dict(temperature=TEMP, vocab_size=VOCAB)
    if subset:  # score 20 of the 37 rows, out of order
        kwargs["rows"] = torch.randperm(ROWS, generator=torch.Generator().manual_seed(2))[:20].to(DEVICE)
        labels = labels[:20]
    (lp_r, ent_r, g_r), (lp_k, ent_k, g_k) = run_both(logits, labels, **kwargs)
    assert lp_k.dtype == ent_k.dtype == torch.float32 and lp_k.shape == lp_r.shape
    assert_close(lp_k, lp_r, TOL[dtype], "log_probs")
    assert_close(ent_k, ent_r, TOL[dtype], "entropy")
    assert_grads_close(g_k, g_r, dtype)
    assert torch.all(g_k[:, VOCAB:] == 0), "padded vocabulary columns get no gradient"
    if subset:
        unscored = torch.ones(ROWS, dtype=torch.bool, device=DEVICE)
        unscored[kwargs["rows"]] = False
        assert torch.all(g_k[unscored] == 0), "unscored rows get no gradient"


def test_batched_shape_and_single_outputs():
    """(B, S, V) logits with (B, S) labels; compute_entropy=False; a gradient through only one output."""
    logits, labels = make_inputs(torch.float32)
    logits3, labels3 = logits[:36].reshape(4, 9, V_LOCAL), labels[:36].reshape(4, 9)
    (lp_r, _, g_r), (lp_k, ent_k, g_k) = run_both(logits3, labels3, compute_entropy=False, vocab_size=VOCAB)
    assert ent_k is None and lp_k.shape == (4, 9)
    assert_close(lp_k, lp_r, 1e-5, "log_probs")
    assert_grads_close(g_k, g_r, torch.float32)
    grads = []
    for fn in (vocab_parallel_logprobs, fl.fused_vocab_parallel_logprobs):  # entropy only
        x = logits.clone().requires_grad_(True)
        _, ent = fn(x, labels, temperature=TEMP)
        grads.append(torch.autograd.grad(ent.sum(), x)[0])
    assert_grads_close(grads[1], grads[0], torch.float32, "entropy-only grad")


def test_same_argument_errors_as_reference():
    x, y = make_inputs(torch.float32, rows=4, v_local=10, vocab=10)
    cases = [(dict(temperature=0.0), "temperature"), (dict(vocab_size=11), "vocab_size=11 exceeds"),
             (dict(rows=torch.arange(3)), "rows"), (dict(chunk_size=0), "chunk_size")]
    for kwargs, match in cases:
        for fn in (vocab_parallel_logprobs, fl.fused_vocab_parallel_logprobs):
            with pytest.raises(ValueError, match=match):
                fn(x, y, **kwargs)
    with pytest.raises(ValueError, match="pass `rows`"):
        fl.fused_vocab_parallel_logprobs(x, y[:3])


def test_clear_errors_when_it_cannot_run(monkeypatch):
    x, y = make_inputs(torch.float32, rows=4, v_local=10, vocab=10, device="cpu")
    monkeypatch.setattr(fl, "_INTERPRETED", False)
    with pytest.raises(RuntimeError, match="runs on CUDA tensors.*TRITON_INTERPRET=1"):
        fl.fused_vocab_parallel_logprobs(x, y)
    monkeypatch.setattr(fl, "triton", None)
    with pytest.raises(RuntimeError, match="needs the `triton` package"):
        fl.fused_vocab_parallel_logprobs(x, y)


def test_backend_selection():
    assert get_logprob_backend("triton") is fl.fused_vocab_parallel_logprobs
    x, y = make_inputs(torch.float32, rows=5, v_local=12, vocab=12, device="cpu")
    lp, ent = get_logprob_backend("auto")(x, y, temperature=TEMP)  # CPU logits: the torch reference
    lp_r, ent_r = vocab_parallel_logprobs(x, y, temperature=TEMP)
    assert torch.equal(lp, lp_r) and torch.equal(ent, ent_r)
    if CUDA:  # CUDA logits: the kernel
        x, y = x.cuda(), y.cuda()
        lp, ent = get_logprob_backend("auto")(x, y, temperature=TEMP)
        lp_k, ent_k = fl.fused_vocab_parallel_logprobs(x, y, temperature=TEMP)
        assert torch.equal(lp, lp_k) and torch.equal(ent, ent_k)


# ---------------------------------------------------------------------------------------- TP = 2 (gloo)


def _tp_worker(rank: int, init_file: str, out_dir: str) -> None:
    """Rank `rank` of 2: the kernel with the vocabulary split over a gloo group vs the full-vocab reference."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    fl.BLOCK_V = 64
    torch.set_num_threads(1)
    report = {}
    full, labels = make_inputs(torch.float32, device="cpu")  # (37, 320): the whole padded vocabulary
    rows = torch.arange(1, ROWS, 2)
    half = V_LOCAL // 2  # 160 columns per rank
    for vocab in (VOCAB, 150):  # 150: rank 1 holds only vocabulary padding
        kwargs = dict(rows=rows, temperature=TEMP, vocab_size=vocab)
        lab = labels[rows] % vocab
        x_full = full.clone().requires_grad_(True)
        lp_r, ent_r = vocab_parallel_logprobs(x_full, lab, **kwargs)  # single process, whole vocabulary
        g_r, = torch.autograd.grad((lp_r + 0.5 * ent_r).sum(), x_full)
        x = full[:, rank * half:(rank + 1) * half].clone().requires_grad_(True)  # this rank's slice
        lp_k, ent_k = fl.fused_vocab_parallel_logprobs(x, lab, tp_group=dist.group.WORLD, **kwargs)
        g_k, = torch.autograd.grad((lp_k + 0.5 * ent_k).sum(), x)
        report[vocab] = [(lp_k - lp_r).abs().max().item(), (ent_k - ent_r).abs().max().item(),
                         (g_k - g_r[:, rank * half:(rank + 1) * half]).abs().max().item()]
    torch.save(report, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.skipif(CUDA, reason="CPU processes under the Triton interpreter (fork after CUDA init is unsafe)")
@pytest.mark.timeout(120)
def test_tensor_parallel_two_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_tp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="fork")
    for rank in range(2):
        for vocab, errors in torch.load(tmp_path / f"rank{rank}.pt").items():
            assert max(errors) <= 1e-5, f"rank {rank}, vocab_size {vocab}: (log_prob, entropy, grad) errors {errors}"


# ---------------------------------------------------------------------------------------- GPU, realistic


def _peak_bytes(fn) -> tuple[object, int]:
    """`fn()`'s result and the peak CUDA memory it allocated beyond what was allocated before."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_qwen_vocab_bf16(monkeypatch):
    monkeypatch.setattr(fl, "BLOCK_V", 4096)
    n, vocab = 4096, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(n, vocab, generator=g, device="cuda") * 3).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), generator=g, device="cuda")
    w_lp, w_ent = torch.randn(2, n, generator=g, device="cuda")

    def fwd_bwd(fn):
        def run():
            x = logits.detach().requires_grad_(True)
            lp, ent = fn(x, labels, temperature=TEMP)
            grad, = torch.autograd.grad((w_lp * lp).sum() + (w_ent * ent).sum(), x)
            return lp.detach(), ent.detach(), grad
        return run

    (lp_r, ent_r, g_r), peak_ref = _peak_bytes(fwd_bwd(vocab_parallel_logprobs))
    (lp_k, ent_k, g_k), peak_kernel = _peak_bytes(fwd_bwd(fl.fused_vocab_parallel_logprobs))
    assert_close(lp_k, lp_r, 1e-3, "log_probs")
    assert_close(ent_k, ent_r, 1e-3, "entropy")
    assert_grads_close(g_k, g_r, torch.bfloat16)
    assert peak_kernel <= peak_ref, f"kernel peak {peak_kernel / 2**30:.2f} GiB > reference {peak_ref / 2**30:.2f} GiB"
