"""FP8 without Transformer Engine, on CPU: quantize/dequantize per layout against their error bounds, the scaled
GEMM's reference against a naive loop, the training linear's gradients, the engine's quantize-at-sync hook (with
the CPU reference GEMM) and the refusals. The cuBLAS kernels themselves: tests/test_fp8_gpu.py."""
from __future__ import annotations

import pytest
import torch

from rlhf_mcore.kernels import fp8
from rlhf_mcore.kernels.fp8 import E4M3, E5M2, FP8_MAX, Fp8Unsupported


def _weights(n=256, k=384, seed=0):
    """Rows of very different magnitudes (1e-4 .. 1e2), one all-zero 128 x 128 block and one zero row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-4, 2, n)[:, None]
    w[:128, 128:256] = 0
    w[200] = 0
    return w


@pytest.mark.parametrize("layout", ["channel", "block"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_dequantize_within_bound(layout, dtype):
    """Every element within half an ulp of its scaled value (error_bound); each group's amax lands on +-FP8_MAX;
    zero groups get scale 1 and zero codes. Mutation: _scale without the / FP8_MAX (scale = amax) -> all four fail."""
    w = _weights()
    q, s = fp8.quantize_rows(w, dtype) if layout == "channel" else fp8.quantize_blocks(w, dtype)
    assert q.dtype == dtype and s.dtype == torch.float32
    assert s.shape == ((256, 1) if layout == "channel" else (2, 3))
    err = (fp8.dequantize(q, s) - w).abs()
    bound = fp8.error_bound(w, s, dtype)
    assert bool((err <= bound * (1 + 1e-6)).all()), f"max excess {(err - bound).max().item():.3g}"
    assert torch.isfinite(q.float()).all()
    codes = q.float().abs()
    if layout == "channel":
        amax_codes, nonzero = codes.amax(1), w.abs().amax(1) > 0
    else:
        amax_codes = codes.reshape(2, 128, 3, 128).amax((1, 3)).flatten()
        nonzero = w.abs().reshape(2, 128, 3, 128).amax((1, 3)).flatten() > 0
    assert torch.equal(amax_codes[nonzero], torch.full_like(amax_codes[nonzero], FP8_MAX[dtype]))
    assert bool((amax_codes[~nonzero] == 0).all()) and bool((s.flatten()[~nonzero] == 1).all())
    assert (~nonzero).any()  # the zero row / block is there


def test_saturation_clamps_instead_of_nan():
    """Values past the format's range become +-FP8_MAX, not nan/inf. Mutation: drop the clamp_ in _cast -> fails
    (e4m3fn has no inf: the cast gives nan; e5m2 gives inf)."""
    x = torch.tensor([[1e6, -1e6, 3.0, 0.0]])
    for dtype in (E4M3, E5M2):
        q = fp8._cast(x, torch.ones(1, 1), dtype).float()
        assert q.tolist()[0][:2] == [FP8_MAX[dtype], -FP8_MAX[dtype]] and q[0, 2] == 3.0 and q[0, 3] == 0


def test_row_block_activation_scales():
    """1 x 128 activation scales: one per row slice. Mutation: amax over the whole row -> the bound fails for the
    row whose two halves differ 1e4-fold."""
    x = torch.randn(4, 256)
    x[1, 128:] *= 1e-4
    q, s = fp8.quantize_row_blocks(x)
    assert s.shape == (4, 2)
    assert bool(((fp8.dequantize(q, s) - x).abs() <= fp8.error_bound(x, s) * (1 + 1e-6)).all())
    assert ((fp8.dequantize(q, s)[1, 128:] - x[1, 128:]).abs() <= x[1, 128:].abs() * 2 ** -4 + 1e-12).all()


@pytest.mark.parametrize("layout", ["channel", "block"])
def test_reference_mm_equals_naive_loop(layout):
    """reference_mm (dequantize, fp32 matmul) against a triple loop over codes and scales, each scale looked up
    by hand. Mutation: dequantize repeating scale columns by r // sr instead of c // sc -> the block case fails."""
    g = torch.Generator().manual_seed(1)
    m, n, k = 3, (128 if layout == "block" else 5), 256
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.1
    if layout == "channel":
        aq, sa = fp8.quantize_rows(a)
        bq, sb = fp8.quantize_rows(b)
        a_s = [[sa[i, 0].item()] * k for i in range(m)]
        b_s = [[sb[j, 0].item()] * k for j in range(n)]
    else:
        aq, sa = fp8.quantize_row_blocks(a)
        bq, sb = fp8.quantize_blocks(b)
        a_s = [[sa[i, kk // 128].item() for kk in range(k)] for i in range(m)]
        b_s = [[sb[j // 128, kk // 128].item() for kk in range(k)] for j in range(n)]
    aql, bql = aq.float().tolist(), bq.float().tolist()
    naive = torch.tensor([[sum(aql[i][kk] * a_s[i][kk] * bql[j][kk] * b_s[j][kk] for kk in range(k))
                           for j in range(n)] for i in range(m)])
    torch.testing.assert_close(fp8.reference_mm(aq, sa, bq, sb), naive, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["channel", "block"])
def test_fp8_linear_close_to_full_precision(layout):
    """fp8_linear (the CPU reference path) within 2 x 2**-4 relative error of x @ w.T, bias added. Mutation:
    fp8_linear dropping the bias -> fails."""
    g = torch.Generator().manual_seed(2)
    x, w, bias = torch.randn(7, 256, generator=g), torch.randn(384, 256, generator=g) * 0.05, torch.randn(384)
    fw = fp8.Fp8Weight.empty_like(w, layout)
    fw.update_(w)
    out, ref = fp8.fp8_linear(x, fw, bias), x @ w.t() + bias
    rel = ((out - ref).norm() / (ref - bias).norm()).item()
    assert out.shape == (7, 384) and rel < 2 * 2 ** -4, rel


@pytest.mark.parametrize("grad", ["e4m3", "e5m2"])
def test_fp8_train_linear_gradients(grad):
    """Fp8LinearFunction's output and dx, dW, db against fp32 autograd (CPU reference GEMMs), rows not a
    multiple of 16 (the padding). Tolerance: 2**-3 relative (e4m3 and e5m2 halves of an ulp, combined). Mutation:
    db = None in backward -> fails (both formats)."""
    from rlhf_mcore.kernels.fp8_linear import GRAD_DTYPES, fp8_linear_train

    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 21, 64, generator=g, requires_grad=True)
    w = (torch.randn(48, 64, generator=g) * 0.1).requires_grad_()
    b = torch.randn(48, generator=g, requires_grad=True)
    dy = torch.randn(2, 21, 48, generator=g)
    y = fp8_linear_train(x, w, b, GRAD_DTYPES[grad])
    grads = torch.autograd.grad(y, (x, w, b), dy)
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y2 = torch.nn.functional.linear(x2, w2, b2)
    ref = torch.autograd.grad(y2, (x2, w2, b2), dy)
    tol = 2 ** -3
    for name, got, want in zip(("dx", "dW", "db"), grads, ref):
        assert got is not None and got.shape == want.shape, name
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < tol, f"{name}: {rel:.3g}"
    assert ((y - y2).norm() / y2.norm()).item() < tol


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_tensor_within_bound_and_transposed(dtype):
    """Per-tensor quantization: one (1, 1) scale from max |x| (here a negative value), every element within
    error_bound, the largest magnitude on +-FP8_MAX, the transposed codes exactly the codes transposed, a given
    amax used as given, an all-zero tensor scale 1. Mutation: amax as x.amax() (the signed max, smaller than
    max |x| here) -> the most negative value saturates and the bound fails."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 96, generator=g) * torch.logspace(-2, 1, 96)
    x[3, 7] = -40.0
    amax = x.abs().amax()
    q, s, qt = fp8.quantize_tensor(x, dtype, transpose=True)
    assert q.shape == (40, 96) and qt.shape == (96, 40) and s.shape == (1, 1) and q.dtype == qt.dtype == dtype
    assert s.item() == pytest.approx(amax.item() / FP8_MAX[dtype], rel=1e-7)
    err = (fp8.dequantize(q, s) - x).abs()
    assert bool((err <= fp8.error_bound(x, s, dtype) * (1 + 1e-6)).all()), (err - fp8.error_bound(x, s, dtype)).max()
    assert q[3, 7].float().item() == -FP8_MAX[dtype]
    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    q2, s2, none = fp8.quantize_tensor(x, dtype, amax=2 * amax)  # a given amax (a cached weight's): used as is
    assert none is None and s2.item() == pytest.approx(2 * s.item())
    qz, sz, _ = fp8.quantize_tensor(torch.zeros(16, 16), dtype)
    assert sz.item() == 1.0 and not qz.float().any()


@pytest.mark.parametrize("grad", ["e4m3", "e5m2"])
def test_fp8_tensorwise_linear_gradients(grad):
    """The tensorwise linear: y, dx, dW, db against fp32 autograd (tolerance 2**-3 relative, as the rowwise one),
    and exactly the per-tensor reference composed by hand (quantize_tensor + reference_mm, rows padded to 16).
    The forward under no_grad (the first pass of activation recompute) gives the same y bit for bit. Mutation:
    dW's GEMM with x's scale replaced by ones -> dW off by the scale and the exact comparison fails (both)."""
    from rlhf_mcore.kernels.fp8_linear import GRAD_DTYPES, fp8_linear_train_tensorwise

    gd = GRAD_DTYPES[grad]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 21, 64, generator=g, requires_grad=True)
    w = (torch.randn(48, 64, generator=g) * 0.1).requires_grad_()
    b = torch.randn(48, generator=g, requires_grad=True)
    dy = torch.randn(2, 21, 48, generator=g)
    y = fp8_linear_train_tensorwise(x, w, b, gd)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    ref = torch.autograd.grad(torch.nn.functional.linear(x2, w2, b2), (x2, w2, b2), dy)
    for name, got, want in zip(("dx", "dW", "db"), grads, ref):
        assert got is not None and got.shape == want.shape, name
        assert ((got - want).norm() / want.norm()).item() < 2 ** -3, name
    # the same arithmetic by hand: per-tensor codes, the fp32 reference GEMM
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, -t.shape[0] % 16))  # noqa: E731
    xm, dym = pad(x.detach().reshape(42, 64)), pad(dy.reshape(42, 48))
    xq, xs, _ = fp8.quantize_tensor(xm, E4M3)
    wq, ws, _ = fp8.quantize_tensor(w.detach(), E4M3)
    dq, ds, _ = fp8.quantize_tensor(dym, gd)
    want_y = (fp8.reference_mm(xq, xs, wq, ws)[:42] + b.detach()).reshape(2, 21, 48)
    want_dx = fp8.reference_mm(dq, ds, wq.t().contiguous(), ws)[:42].reshape(2, 21, 64)
    want_dw = fp8.reference_mm(dq.t().contiguous(), ds, xq.t().contiguous(), xs)
    torch.testing.assert_close(y.detach(), want_y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[0], want_dx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[1], want_dw, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(fp8_linear_train_tensorwise(x, w, b, gd), y.detach())


def test_delayed_scaling_history_and_its_linear():
    """`ActivationAmaxes` (fp8_recipe=delayed) on CPU. A site's first cast is current scaling (the codes of
    `quantize_tensor(x)`) and primes its scale; until the next roll every cast uses that scale (a tensor twice as
    large saturates at +-FP8_MAX) and folds its own max |x| into `seen`; `roll` pushes seen into the history (newest
    first, `history` steps kept) and the scale becomes the history's max, so an amax leaves it after `history` rolls;
    a site that saw nothing or only inf keeps its history; `state_dict` round-trips. The delayed linear's y, dx and dW
    equal the per-tensor reference under the sites' scales. Mutations (run): the roll without the shift (the history
    a running max) -> the first roll's history check fails; `seen` not updated on the CPU path -> the first
    roll finds nothing and fails; the backward casting dy with current scaling -> dy's site sees nothing and the
    last check fails."""
    from rlhf_mcore.kernels.fp8_linear import ActivationAmaxes, DelayedSites, fp8_linear_train_tensorwise

    g = torch.Generator().manual_seed(6)
    x = torch.randn(32, 64, generator=g)
    a1 = x.abs().max().item()
    reg = ActivationAmaxes(sites=3, history=2, device="cpu")
    i, j = reg.sites(2)
    q, s, _ = reg.quantize(i, x, E4M3, transpose=False)
    want_q, want_s, _ = fp8.quantize_tensor(x, E4M3)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    q2, s2, _ = reg.quantize(i, 2 * x, E4M3, transpose=True)  # the primed scale: 2x saturates
    assert torch.equal(s2, want_s) and q2.float().abs().max().item() == FP8_MAX[E4M3]
    assert reg.seen[i].item() == 2 * a1 and reg.seen[j].item() == 0.0
    reg.roll()
    assert reg.hist[i].tolist() == [2 * a1, 0.0] and reg.amax[i].item() == 2 * a1 and reg.seen[i].item() == 0.0
    assert reg.amax[j].item() == 0.0 and not reg.primed[j]  # never cast: nothing to roll
    for scale_by in (0.5, 0.25):  # two smaller steps push the 2 * a1 step out of a 2-step history
        reg.quantize(i, scale_by * x, E4M3, transpose=False)
        reg.roll()
    assert reg.amax[i].item() == 0.5 * a1, reg.hist[i]
    reg.seen[i] = float("inf")  # an overflowing (skipped) step adds nothing
    reg.roll()
    assert reg.amax[i].item() == 0.5 * a1 and reg.seen[i].item() == 0.0
    copy = ActivationAmaxes(sites=3, history=2, device="cpu")
    copy.load_state_dict(reg.state_dict())
    assert torch.equal(copy.hist, reg.hist) and torch.equal(copy.amax, reg.amax) and copy.primed == reg.primed
    with pytest.raises(ValueError, match="fp8_amax_history_len differs"):
        ActivationAmaxes(sites=3, history=4, device="cpu").load_state_dict(reg.state_dict())

    # the linear: x's and dy's scales from their sites (primed on a first call, then delayed)
    reg = ActivationAmaxes(sites=2, history=4, device="cpu")
    sites = DelayedSites(reg)
    w = (torch.randn(48, 64, generator=g) * 0.1).requires_grad_()
    dy = torch.randn(32, 48, generator=g)
    xr = x.clone().requires_grad_()
    fp8_linear_train_tensorwise(xr, w, None, E5M2, delayed=sites).backward(dy)  # primes both sites
    reg.roll()
    x3, dy3 = 3 * x, 0.5 * dy
    xr = x3.clone().requires_grad_()
    w.grad = None
    y = fp8_linear_train_tensorwise(xr, w, None, E5M2, delayed=sites)
    y.backward(dy3)
    xq, xs, _ = fp8.quantize_tensor(x3, E4M3, amax=torch.tensor(a1))  # x's scale: step 1's amax
    dq, ds, _ = fp8.quantize_tensor(dy3, E5M2, amax=dy.abs().max())
    wq, ws, _ = fp8.quantize_tensor(w.detach(), E4M3)
    assert xs.item() == pytest.approx(a1 / FP8_MAX[E4M3], rel=1e-7)
    torch.testing.assert_close(y.detach(), fp8.reference_mm(xq, xs, wq, ws), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xr.grad, fp8.reference_mm(dq, ds, wq.t().contiguous(), ws), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, fp8.reference_mm(dq.t().contiguous(), ds, xq.t().contiguous(), xs),
                               rtol=1e-6, atol=1e-6)
    assert reg.seen.tolist() == [x3.abs().max().item(), dy3.abs().max().item()]


def test_weight_amax_follows_every_write_to_the_weight():
    """WeightAmax keeps max |W| between calls and recomputes it after anything that writes W: an in-place update,
    an optimizer step, new storage (`.data =`, as an offload restores it), `invalidate()`; not otherwise (a write
    through `.data` moves no counter: the engine invalidates after its optimizer steps). The linear's output after
    an in-place update is the one a fresh amax gives. Mutation: the key without `weight._version` -> the in-place
    and optimizer cases keep the stale amax and fail."""
    from rlhf_mcore.kernels.fp8_linear import WeightAmax, fp8_linear_train_tensorwise

    g = torch.Generator().manual_seed(5)
    w = torch.nn.Parameter(torch.randn(32, 64, generator=g))
    x = torch.randn(16, 64, generator=g)
    cache = WeightAmax()
    assert cache(w).item() == w.abs().max().item() and cache.computed == 1
    cache(w)
    assert cache.computed == 1  # unchanged weight: kept
    with torch.no_grad():
        w.mul_(4)
    assert cache(w).item() == w.abs().max().item() and cache.computed == 2
    y_cached = fp8_linear_train_tensorwise(x, w, None, E4M3, None, cache)
    assert torch.equal(y_cached, fp8_linear_train_tensorwise(x, w, None, E4M3, None, WeightAmax()))
    w.grad = torch.ones_like(w)
    torch.optim.SGD([w], lr=100.0).step()
    assert cache(w).item() == w.abs().max().item() and cache.computed == 3
    w.data = w.data.clone() * 0.5
    assert cache(w).item() == w.abs().max().item() and cache.computed == 4
    # a write that moves neither (Megatron's optimizer writes bf16 weights so, through its parameter buffer): the
    # kept amax is stale until invalidate(), which the train engine calls after every optimizer step
    w.data.copy_(w.data * 2)
    assert cache(w).item() == w.abs().max().item() / 2 and cache.computed == 4
    cache.invalidate()
    assert cache(w).item() == w.abs().max().item() and cache.computed == 5


def test_refusals_are_one_line():
    """No CUDA, a GPU without FP8, and shapes off the 128 block: each refused in one line naming the key."""
    with pytest.raises(Fp8Unsupported, match=r"^k=fp8 needs a CUDA GPU .* device is cpu; unset k") as e:
        fp8.check_fp8_device("cpu", "k")
    assert "\n" not in str(e.value)
    fp8.check_block_shape((896, 4864), "w", "k")  # Qwen2.5-0.5B's MLP: 7 x 38 blocks
    with pytest.raises(Fp8Unsupported, match=r"^k: w has shape \(1000, 128\), not divisible by the 128 x 128"):
        fp8.check_block_shape((1000, 128), "w", "k")


def test_gpu_without_fp8_refused(monkeypatch):
    """An sm_80 GPU (A100) is refused, an sm_90 one passes. Mutation: MIN_CAPABILITY = (8, 0) -> fails."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    with pytest.raises(Fp8Unsupported, match=r"FP8 tensor cores .* NVIDIA A100 is sm_80; unset k"):
        fp8.check_fp8_device("cuda:0", "k")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    fp8.check_fp8_device("cuda:0", "k")


def test_config_keys_and_refusals():
    """The keys load with their defaults off (recipe rowwise, no weight cache); FP8 on a CPU run, under another
    rollout engine, on the reference, with an unknown format or recipe, a recipe, a weight cache or an amax history
    without FP8, a weight cache under the rowwise recipe, an amax history under a recipe without one or shorter than
    a step is refused in one line naming the key."""
    from rlhf_mcore.config import ConfigError, load_config

    cfg = load_config(None, ["actor_rollout_ref.model.path=/m"])
    assert cfg.actor_rollout_ref.rollout.quantization is None and cfg.actor_rollout_ref.actor.megatron.fp8 is None
    ok = load_config(None, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.rollout.quantization=fp8",
                            "actor_rollout_ref.actor.megatron.fp8=hybrid", "critic.megatron.fp8=e4m3"])
    assert ok.actor_rollout_ref.rollout.quantization == "fp8" and ok.critic.megatron.fp8 == "e4m3"
    assert ok.critic.megatron.fp8_recipe == "rowwise"
    tw = load_config(None, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.megatron.fp8=hybrid",
                            "actor_rollout_ref.actor.megatron.fp8_recipe=tensorwise"])
    assert tw.actor_rollout_ref.actor.megatron.fp8_recipe == "tensorwise"
    assert not tw.actor_rollout_ref.actor.megatron.fp8_weight_cache
    kept = load_config(None, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.megatron.fp8=hybrid",
                              "actor_rollout_ref.actor.megatron.fp8_recipe=tensorwise",
                              "actor_rollout_ref.actor.megatron.fp8_weight_cache=true"])
    assert kept.actor_rollout_ref.actor.megatron.fp8_weight_cache is True
    fwd = load_config(None, ["actor_rollout_ref.model.path=/m", "critic.megatron.fp8=hybrid",
                             "critic.megatron.fp8_recipe=tensorwise", "critic.megatron.fp8_weight_cache=forward"])
    assert fwd.critic.megatron.fp8_weight_cache == "forward"
    delayed = load_config(None, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.megatron.fp8=hybrid",
                                 "actor_rollout_ref.actor.megatron.fp8_recipe=delayed",
                                 "actor_rollout_ref.actor.megatron.fp8_amax_history_len=4",
                                 "actor_rollout_ref.actor.megatron.fp8_weight_cache=forward"])
    assert delayed.actor_rollout_ref.actor.megatron.fp8_amax_history_len == 4
    assert ok.critic.megatron.fp8_amax_history_len == 16
    bad = {("actor_rollout_ref.rollout.quantization=fp8", "trainer.device=cpu"):
           r"'actor_rollout_ref.rollout.quantization' has value 'fp8'; it must be null with trainer.device=cpu",
           ("actor_rollout_ref.rollout.quantization=fp8", "actor_rollout_ref.rollout.name=hf"):
           r"'actor_rollout_ref.rollout.quantization' .* null with rollout.name=hf",
           ("actor_rollout_ref.actor.megatron.fp8=e4m3", "trainer.device=cpu"):
           r"'actor_rollout_ref.actor.megatron.fp8' has value 'e4m3'; it must be null with trainer.device=cpu",
           ("actor_rollout_ref.ref.megatron.fp8=e4m3",): r"'actor_rollout_ref.ref.megatron.fp8' .* trained models",
           ("actor_rollout_ref.actor.megatron.fp8=e4m3", "actor_rollout_ref.actor.megatron.sequence_parallel=true"):
           r"null with sequence_parallel=true",
           ("actor_rollout_ref.actor.megatron.fp8=e5m2",): r"choose one of e4m3, hybrid",
           ("critic.megatron.fp8_recipe=tensorwise",):
           r"'critic.megatron.fp8_recipe' has value 'tensorwise'; it must be rowwise .* while critic.megatron.fp8 is "
           r"null",
           ("actor_rollout_ref.actor.megatron.fp8=hybrid", "actor_rollout_ref.actor.megatron.fp8_recipe=blockwise"):
           r"choose one of rowwise, tensorwise, delayed",
           ("critic.megatron.fp8_amax_history_len=4",):
           r"'critic.megatron.fp8_amax_history_len' has value 4; it must be 16 .* while critic.megatron.fp8 is null",
           ("critic.megatron.fp8=hybrid", "critic.megatron.fp8_recipe=tensorwise",
            "critic.megatron.fp8_amax_history_len=4"):
           r"'critic.megatron.fp8_amax_history_len' .* with fp8_recipe=tensorwise: only the delayed recipe",
           ("critic.megatron.fp8=hybrid", "critic.megatron.fp8_recipe=delayed",
            "critic.megatron.fp8_amax_history_len=0"):
           r"'critic.megatron.fp8_amax_history_len' has value 0; it must be an integer >= 1",
           ("critic.megatron.fp8_weight_cache=true",):
           r"'critic.megatron.fp8_weight_cache' has value True; it must be false .* while critic.megatron.fp8 is null",
           ("actor_rollout_ref.actor.megatron.fp8=hybrid", "actor_rollout_ref.actor.megatron.fp8_weight_cache=true"):
           r"'actor_rollout_ref.actor.megatron.fp8_weight_cache' .* false with fp8_recipe=rowwise: only the "
           r"per-tensor recipes",
           ("actor_rollout_ref.actor.megatron.fp8=hybrid", "actor_rollout_ref.actor.megatron.fp8_recipe=tensorwise",
            "actor_rollout_ref.actor.megatron.fp8_weight_cache=backward"):
           r"'actor_rollout_ref.actor.megatron.fp8_weight_cache' has value 'backward'; it must be false, true \(codes "
           r"and transposes\) or forward"}
    for overrides, msg in bad.items():
        with pytest.raises(ConfigError, match=msg) as e:
            load_config(None, ["actor_rollout_ref.model.path=/m", *overrides])
        assert "\n" not in str(e.value)


def test_engine_quantizes_once_per_sync(tiny_model_dir, monkeypatch):
    """The native engine with quantization="fp8" (CPU, the reference GEMM; the device check patched out): the
    FP8 copies follow each sync — quantized once before the next generation however many buckets it took —
    generation runs through them (log-probs move a little), and CPU without the patch is refused. Mutation: drop
    `self._fp8_stale = True` in update_weights -> the copy keeps the old weights and the second check fails."""
    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native import engine as native_engine
    from rlhf_mcore.rollout.native import fp8 as native_fp8
    from rlhf_mcore.rollout.native.weights import iter_safetensors

    model_dir = tiny_model_dir("qwen2", hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512)
    cpu = dict(max_num_seqs=4, max_model_len=64, device="cpu")  # also on a GPU machine: this test is the CPU path
    with pytest.raises(Fp8Unsupported, match="actor_rollout_ref.rollout.quantization=fp8 needs a CUDA GPU"):
        native_engine.NativeRolloutEngine(model_dir, quantization="fp8", **cpu)
    monkeypatch.setattr(native_fp8, "check_fp8_device", lambda device, key: None)
    eng = native_engine.NativeRolloutEngine(model_dir, quantization="fp8", **cpu)
    ref = native_engine.NativeRolloutEngine(model_dir, **cpu)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 33, 7], [100, 3, 2], [17, 250, 11, 40, 9]]
    out, want = eng.generate(prompts, params), ref.generate(prompts, params)
    assert eng.last_stats["fp8_quantize_s"] > 0 and "fp8_quantize_s" not in ref.last_stats
    # the first token's log-prob: moved by the FP8 GEMMs (the copies are used), but only slightly
    lp_diff = [abs(o.samples[0].logprobs[0] - r.samples[0].logprobs[0]) for o, r in zip(out, want)]
    assert max(lp_diff) > 0 and max(lp_diff) < 0.5, lp_diff
    assert sorted(eng.model.fp8[0]) == ["down", "gate_up"]
    torch.testing.assert_close(eng.model.fp8[0]["gate_up"].dequantize(), eng.weights.layers[0].gate_up.float(),
                               rtol=2 ** -4, atol=1e-6)

    # a sync in two buckets: new values for every tensor, quantized once at the next generation
    new = [(n, t * 0.5) for n, t in iter_safetensors(model_dir)]
    eng.update_weights(new[: len(new) // 2])
    eng.update_weights(new[len(new) // 2:])
    calls = []
    real = native_fp8.Fp8Layers.quantize_

    def counting(self, weights):
        calls.append(1)
        return real(self, weights)

    monkeypatch.setattr(native_fp8.Fp8Layers, "quantize_", counting)
    eng.generate(prompts, params)
    eng.generate(prompts, params)  # no sync in between: no quantization
    assert len(calls) == 1 and eng.last_stats["fp8_quantize_s"] == 0.0
    torch.testing.assert_close(eng.model.fp8[0]["gate_up"].dequantize(), eng.weights.layers[0].gate_up.float(),
                               rtol=2 ** -4, atol=1e-6)

    # the trainer's sync (several buckets): quantized once inside it, its seconds in the sync's metrics, so the
    # next generation has nothing left to quantize. Mutation: load_buckets_into not calling finish_weight_update
    # -> no sync/fp8_quantize_seconds, and the generation quantizes instead.
    from rlhf_mcore.sync import sync_actor_to_rollout

    metrics = sync_actor_to_rollout([(n, t * 2.0) for n, t in new], eng, bucket_mb=0.05)
    assert metrics["sync/buckets"] > 1 and len(calls) == 2
    assert 0 < metrics["sync/fp8_quantize_seconds"] <= metrics["sync/seconds"]
    eng.generate(prompts, params)
    assert len(calls) == 2 and eng.last_stats["fp8_quantize_s"] == 0.0
    torch.testing.assert_close(eng.model.fp8[0]["gate_up"].dequantize(), eng.weights.layers[0].gate_up.float(),
                               rtol=2 ** -4, atol=1e-6)


def test_w8a16_decode_refusals(tiny_model_dir):
    """The native engine's fp8_decode: an unknown mode, and weight-only FP8 with 128 x 128 block scales (its GEMM
    reads one scale per output channel), are refused in one line saying what to choose. (Its numerics: the
    interpreter checks of tests/test_rollout_native.py and the GPU test of tests/test_fp8_gpu.py.)"""
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    model_dir = tiny_model_dir("qwen2", hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512)
    cpu = dict(max_num_seqs=2, max_model_len=16, device="cpu", quantization="fp8")
    with pytest.raises(ValueError, match=r"^fp8_decode='w4a16': choose w8a8 or w8a16\.$"):
        NativeRolloutEngine(model_dir, fp8_decode="w4a16", **cpu)
    with pytest.raises(ValueError, match=r"fp8_layout='block' has 128 x 128 blocks: use fp8_layout='channel' or "):
        NativeRolloutEngine(model_dir, fp8_decode="w8a16", fp8_layout="block", **cpu)


def test_fp8_training_refusals():
    """enable_fp8_training: an unknown format, a weight cache under the rowwise recipe, and a model with no Megatron
    local-spec linears to switch, are refused in one line naming the key (the CUDA / sm >= 89 refusal is
    check_fp8_device's, above)."""
    from rlhf_mcore.models.fp8_training import enable_fp8_training

    with pytest.raises(Fp8Unsupported, match=r"^k='e5m2': choose e4m3 or hybrid"):
        enable_fp8_training([], "e5m2", "k")
    with pytest.raises(Fp8Unsupported, match=r"^k_weight_cache=true needs k_recipe=tensorwise or delayed \(the"):
        enable_fp8_training([], "hybrid", "k", "rowwise", weight_cache=True)
    with pytest.raises(Fp8Unsupported, match=r"^k=e4m3: no Megatron local-spec linear layers in the decoder"):
        enable_fp8_training([torch.nn.Module()], "e4m3", "k")


@pytest.mark.parametrize("mode", [True, "forward"], ids=["codes_and_transposes", "forward"])
def test_kept_weight_codes_follow_every_write_to_the_weight(mode):
    """WeightAmax(keep_codes=True) casts W once and hands the same codes to every later forward (with and without
    the transpose the backward needs), until W is written in place, gets new storage, or `invalidate()` is called;
    the linear's outputs and gradients then equal those of a fresh (uncached) WeightAmax bit for bit. "forward" keeps
    the codes only (no transpose held) and copies the transpose from them when a backward needs it: the same bits.
    Mutations (run): `__call__` keeping the codes when it recomputes the amax (the key moved, or after
    `invalidate()`) -> the in-place case reads the old weight's codes and fails; "forward" handing out the codes
    untransposed (q for q.T) -> its gradients differ."""
    from rlhf_mcore.kernels.fp8_linear import WeightAmax, fp8_linear_train_tensorwise

    g = torch.Generator().manual_seed(7)
    w = torch.nn.Parameter(torch.randn(32, 64, generator=g))
    x = torch.randn(16, 64, generator=g, requires_grad=True)
    cache = WeightAmax(keep_codes=mode)

    def check(casts):
        with torch.no_grad():  # a forward without backward (a log-prob pass, recompute's first pass) reads them too
            fp8_linear_train_tensorwise(x, w, None, E4M3, None, cache)
        outs = []
        for c in (cache, WeightAmax()):
            w.grad = x.grad = None
            y = fp8_linear_train_tensorwise(x, w, None, E4M3, None, c)
            y.backward(torch.ones_like(y))
            outs.append((y.detach(), w.grad.clone(), x.grad.clone()))
        for a, b in zip(*outs):
            assert torch.equal(a, b)
        assert cache.cast == casts, (cache.cast, casts)
        assert (cache.kept[2] is None) == (mode == "forward")  # what is held: the transpose only with True

    check(1)
    check(1)  # kept
    with torch.no_grad():
        w.mul_(4)
    check(2)
    w.data = w.data.clone() * 0.5
    check(3)
    w.data.copy_(w.data * 2)  # moves no counter: the engine invalidates after its optimizer steps
    cache.invalidate()
    check(4)


@pytest.fixture
def fp8_engine_env(tiny_model_dir, monkeypatch, cpu_only):
    """FP8 training on the CPU engine (the reference GEMMs; the FP8 device check patched out): a tiny Qwen2 model
    directory, a CPU process group (torn down after the test) and an 8-row RL batch."""
    from test_train_cuda_graphs import rl_batch

    from rlhf_mcore.models import fp8_training
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    monkeypatch.setattr(fp8_training, "check_fp8_device", lambda device, key: None)
    model_dir = tiny_model_dir(arch="qwen2", vocab=512, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128,
                               init_std=0.02)
    state = init_distributed(device="cpu")
    try:
        yield model_dir, state, rl_batch(8, 512, "cpu")
    finally:
        destroy_distributed()


@pytest.mark.parametrize("recompute, dtype", [(True, torch.float32), (False, torch.bfloat16)],
                         ids=["full_recompute", "bf16"])
def test_kept_weight_codes_on_the_engine(fp8_engine_env, recompute, dtype):
    """`megatron.fp8_weight_cache` on a tiny Megatron GPTModel (CPU, the reference GEMMs, tensorwise, fp8=hybrid):
    two PPO updates of 4 micro-batches and a log-prob pass give the same losses, gradient norms and parameters as
    without the cache (exactly: the same codes; "forward" too, its transposes copied from the kept codes), each layer
    casting its weight once per optimizer step (3 in all) however many micro-batches and recomputed forwards read it;
    an offload drops the kept codes. Mutations (run): the engine's `invalidate_weight_amaxes` after the optimizer step
    removed -> the bf16 case's second update reads the first one's codes and differs; the offload's call removed ->
    the codes survive it and the last check fails; "forward" handing out q for q.T -> its cases fail."""
    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine import EngineConfig, TrainEngine
    from rlhf_mcore.engine.builder import recompute_overrides
    from rlhf_mcore.models import build_model, fp8_training

    model_dir, state, batch = fp8_engine_env
    res = {}
    for kept in (False, True, "forward"):
        torch.manual_seed(0)
        chunks = build_model(model_dir, state, role="actor", dtype=dtype,
                             config_overrides=recompute_overrides(recompute) or None)
        assert fp8_training.enable_fp8_training(chunks, "hybrid", "k", "tensorwise", weight_cache=kept) == 8
        caches = chunks[0].fp8_weight_amaxes
        eng = TrainEngine(chunks, state, EngineConfig(role="actor", micro_batch_size=2, mini_batch_size=8),
                          OptimConfig(lr=1e-2))
        metrics = [eng.update_policy(batch) for _ in range(2)]
        logp = eng.compute_log_probs(batch)[0]
        res[kept] = (metrics, logp, [p.detach().clone() for p in chunks[0].parameters()])
        if kept:
            assert [c.cast for c in caches] == [3] * 8, [c.cast for c in caches]
            assert all(c.kept is not None for c in caches)
            eng.offload(params=False, grads=False, optimizer=False)
            assert all(c.kept is None for c in caches)
    for kept in (True, "forward"):
        for m0, m1 in zip(res[False][0], res[kept][0]):
            assert m1["actor/pg_loss"] == m0["actor/pg_loss"] and m1["actor/grad_norm"] == m0["actor/grad_norm"]
        assert torch.equal(res[False][1], res[kept][1])
        for a, b in zip(res[False][2], res[kept][2]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("recompute, dtype", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)],
                         ids=["eager", "full_recompute", "bf16"])
def test_tensorwise_training_on_the_engine(fp8_engine_env, recompute, dtype):
    """Two PPO updates of a tiny Megatron GPTModel (CPU, the reference GEMMs; the device check patched out) with
    fp8=hybrid under the tensorwise recipe, against the same model without FP8: the gradient norm within 10% and
    the losses within 5%; every switched layer computes its weight's amax once per optimizer step (once for each
    update and once for the log-prob pass after them), however many micro-batches and recomputed forwards read it,
    and the amax it then holds is the weight's current one. With full activation recompute the first forward runs
    under no_grad (no transposed codes) and the recompute reads the same amaxes. With bf16 parameters (the GPU's
    case) Megatron's optimizer writes them through its parameter buffer without moving their version counter, so
    only the engine's `invalidate_weight_amaxes` after the step keeps the amax current. Mutations: WeightAmax's key
    without `weight._version` -> computed once in the fp32 cases, the amax the first update's, and the last checks
    fail; the engine's `invalidate_weight_amaxes` call after the optimizer step removed -> the bf16 case fails the
    same way (found by this test's bf16 case: the version-counter key alone was stale there)."""
    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine import EngineConfig, TrainEngine
    from rlhf_mcore.engine.builder import recompute_overrides
    from rlhf_mcore.kernels.fp8_linear import WeightAmax
    from rlhf_mcore.models import build_model, fp8_training

    model_dir, state, batch = fp8_engine_env
    res, layers = {}, []
    for fp8_on in (False, True):
        torch.manual_seed(0)
        chunks = build_model(model_dir, state, role="actor", dtype=dtype,
                             config_overrides=recompute_overrides(recompute) or None)
        if fp8_on:
            assert fp8_training.enable_fp8_training(chunks, "hybrid", "k", "tensorwise") == 8
            layers = [m for m in chunks[0].modules() if isinstance(getattr(m, "fp8_weight_amax", None), WeightAmax)]
        eng = TrainEngine(chunks, state, EngineConfig(role="actor", micro_batch_size=2, mini_batch_size=8),
                          OptimConfig(lr=1e-2))
        res[fp8_on] = [eng.update_policy(batch) for _ in range(2)]
        eng.compute_log_probs(batch)  # the first use after the second step: the amax is W's after it
    assert len(layers) == 8
    for m0, m1 in zip(res[False], res[True]):
        assert abs(m1["actor/grad_norm"] - m0["actor/grad_norm"]) <= 0.1 * m0["actor/grad_norm"]
        assert abs(m1["actor/pg_loss"] - m0["actor/pg_loss"]) <= 0.05 * abs(m0["actor/pg_loss"]) + 1e-3
    for m in layers:
        assert m.fp8_weight_amax.computed == 3, m.fp8_weight_amax.computed  # 2 updates of 4 micro-batches
        assert m.fp8_weight_amax.amax.item() == m.weight.detach().abs().max().item()


def test_delayed_scaling_on_the_engine(fp8_engine_env, tmp_path):
    """fp8_recipe=delayed on a tiny Megatron GPTModel (CPU, the reference GEMMs, fp8=hybrid, a 2-step history): two
    PPO updates of 4 micro-batches within 10% (gradient norm) and 5% (loss) of the same model without FP8, after a
    log-prob pass that primes the inputs' sites and tracks fp32's log-probs; after them
    every one of the 16 sites (x and dy of 8 linears) holds both steps' amaxes, the scale the larger; with full
    activation recompute the updates equal the eager ones exactly (the scales stay fixed between a micro-batch's
    first pass and its recompute); a checkpoint holds the histories, and an engine loaded from it takes the next
    update bitwise as the one that saved it. Mutations (run): the engine's `roll_activation_amaxes` removed -> the
    histories stay empty and the history check fails; `_set_rng_state` not loading them -> the loaded engine's
    scales and its next update differ."""
    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine import EngineConfig, TrainEngine
    from rlhf_mcore.engine.builder import recompute_overrides
    from rlhf_mcore.models import build_model, fp8_training

    model_dir, state, batch = fp8_engine_env

    def engine(recipe, recompute=False):
        torch.manual_seed(0)
        chunks = build_model(model_dir, state, role="actor", dtype=torch.float32,
                             config_overrides=recompute_overrides(recompute) or None)
        if recipe:
            assert fp8_training.enable_fp8_training(chunks, "hybrid", "k", recipe, amax_history=2) == 8
        return TrainEngine(chunks, state, EngineConfig(role="actor", micro_batch_size=2, mini_batch_size=8),
                           OptimConfig(lr=1e-2))

    ref = engine(None)
    ref_logp = ref.compute_log_probs(batch)[0]
    want = [ref.update_policy(batch) for _ in range(2)]
    runs = {}
    for recompute in (False, True):
        eng = engine("delayed", recompute)
        # a log-prob pass first (the old log-probs; no_grad) primes the inputs' sites
        torch.testing.assert_close(eng.compute_log_probs(batch)[0], ref_logp, rtol=0.05, atol=0.05)
        assert sum(eng.chunks[0].fp8_activation_amaxes.primed) == 8  # x of 8 linears; dy at the first backward
        runs[recompute] = (eng, [eng.update_policy(batch) for _ in range(2)])
    eng, got = runs[False]
    for m0, m1 in zip(want, got):
        assert abs(m1["actor/grad_norm"] - m0["actor/grad_norm"]) <= 0.1 * m0["actor/grad_norm"]
        assert abs(m1["actor/pg_loss"] - m0["actor/pg_loss"]) <= 0.05 * abs(m0["actor/pg_loss"]) + 1e-3
    amaxes = eng.chunks[0].fp8_activation_amaxes
    assert amaxes.hist.shape == (16, 2) and all(amaxes.primed)
    assert bool((amaxes.hist > 0).all()) and torch.equal(amaxes.amax, amaxes.hist.amax(dim=1))
    assert not amaxes.seen.any()
    for m0, m1 in zip(got, runs[True][1]):
        assert (m1["actor/pg_loss"], m1["actor/grad_norm"]) == (m0["actor/pg_loss"], m0["actor/grad_norm"])

    eng.save_checkpoint(tmp_path / "ckpt")
    fresh = engine("delayed")
    fresh.load_checkpoint(tmp_path / "ckpt")
    loaded = fresh.chunks[0].fp8_activation_amaxes
    assert torch.equal(loaded.hist, amaxes.hist) and torch.equal(loaded.amax, amaxes.amax) and all(loaded.primed)
    after = [e.update_policy(batch) for e in (eng, fresh)]
    assert after[0]["actor/grad_norm"] == after[1]["actor/grad_norm"]
    for a, b in zip(eng.chunks[0].parameters(), fresh.chunks[0].parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_weight_gradients_accumulate_into_main_grad(fp8_engine_env, monkeypatch, recipe):
    """Megatron's gradient-accumulation fusion with FP8 training (the weight-gradient GEMM adds into main_grad,
    `kernels.fp8_wgrad`; CPU: its reference sum): two PPO updates of 4 micro-batches equal the unfused FP8 updates
    (losses and gradient norms, and the parameters after the first, fp32 within rounding), every decoder linear's
    weight gradient went through the accumulation (2 updates x 4 micro-batches x 8 linears) and the DDP hook added
    nothing for them (`grad_added_to_main_grad`, still set after the last micro-batch). Mutations (run): the
    accumulation replaced by an assignment (`main_grad.copy_`) -> the updates differ (grad norm 1.27 against 1.50);
    `_accumulated` not marking the weight (with a zero placeholder the hook adds, so the sums still agree) -> the
    marks fail."""
    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine import EngineConfig, TrainEngine
    from rlhf_mcore.kernels import fp8_wgrad
    from rlhf_mcore.models import build_model, fp8_training, grad_accum_fusion

    calls, real = [], fp8_wgrad.wgrad_accumulate
    monkeypatch.setattr(fp8_wgrad, "wgrad_accumulate", lambda *a: calls.append(a[-1].shape) or real(*a))
    grad_accum_fusion.install()
    model_dir, state, batch = fp8_engine_env
    res = {}
    for fused in (False, True):
        torch.manual_seed(0)
        calls.clear()
        chunks = build_model(model_dir, state, role="actor", dtype=torch.float32,
                             config_overrides={"gradient_accumulation_fusion": True} if fused else None)
        assert fp8_training.enable_fp8_training(chunks, "hybrid", "k", recipe) == 8
        eng = TrainEngine(chunks, state, EngineConfig(role="actor", micro_batch_size=2, mini_batch_size=8,
                                                      cuda_graphs=False), OptimConfig(lr=1e-2))
        first = eng.update_policy(batch)
        after_first = [p.detach().clone() for p in eng.chunks[0].parameters()]
        res[fused] = ([first, eng.update_policy(batch)], after_first, len(calls))
        marked = [getattr(m.weight, "grad_added_to_main_grad", None) for m in chunks[0].decoder.modules()
                  if hasattr(m, "_forward_impl") and hasattr(m, "weight")]
        assert len(marked) == 8 and all(x is fused for x in marked), (fused, marked)
    assert res[False][2] == 0 and res[True][2] == 2 * 4 * 8, (res[False][2], res[True][2])
    # the first update starts from the same weights: its metrics and the weights after it equal to fp32 rounding.
    # The second starts from weights that differ by that rounding (main_grad summed in another order), and a value on
    # an FP8 rounding boundary then takes the neighbouring code: its metrics within 1e-3 (a 2-core machine: 2.3e-5
    # in the gradient norm, rowwise), its weights not compared (Adam at lr 1e-2 moves a weight whose gradient took
    # another code by up to the lr: 0.4% of them by up to 0.0115 here). The mutation moves both by tens of percent.
    for m0, m1, rel in zip(res[False][0], res[True][0], (1e-5, 1e-3)):
        assert m1["actor/pg_loss"] == pytest.approx(m0["actor/pg_loss"], rel=rel, abs=1e-7)
        assert m1["actor/grad_norm"] == pytest.approx(m0["actor/grad_norm"], rel=rel)
    for a, b in zip(res[False][1], res[True][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_learn_gpu_variants_are_real_keys():
    """launch/learn_gpu.py --variants (the FP8 learning comparison): every run's overrides load on its config and
    set what the variant names, from the same seed. Mutation: VARIANTS' TIS threshold key misspelt
    (rollout_is_treshold) -> load_config raises."""
    import sys
    from pathlib import Path

    from rlhf_mcore.config import load_config

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "launch"))
    import learn_gpu

    runs = learn_gpu.plan_runs(["grpo", "ppo"], list(learn_gpu.VARIANTS))
    assert sorted(runs) == ["grpo", "grpo_fp8-rollout", "grpo_fp8-rollout-kv-tis", "grpo_fp8-rollout-tis",
                            "grpo_fp8-train", "ppo", "ppo_fp8-rollout", "ppo_fp8-rollout-kv-tis", "ppo_fp8-rollout-tis",
                            "ppo_fp8-train"]
    cfgs = {name: load_config(str(root / "configs/learn_gpu.yaml"), ["actor_rollout_ref.model.path=/m", *ov])
            for name, ov in runs.items() if name.startswith("grpo") or name == "ppo_fp8-train"}
    got = {name: (c.actor_rollout_ref.rollout.quantization, c.actor_rollout_ref.actor.megatron.fp8,
                  c.algorithm.rollout_correction.rollout_is, c.trainer.experiment_name) for name, c in cfgs.items()}
    assert got["grpo"] == (None, None, None, "grpo")
    assert got["grpo_fp8-rollout"] == ("fp8", None, None, "grpo_fp8-rollout")
    assert got["grpo_fp8-rollout-tis"] == ("fp8", None, "token", "grpo_fp8-rollout-tis")
    assert cfgs["grpo_fp8-rollout-tis"].algorithm.rollout_correction.rollout_is_threshold == 2.0
    assert got["grpo_fp8-rollout-kv-tis"] == ("fp8", None, "token", "grpo_fp8-rollout-kv-tis")
    assert cfgs["grpo_fp8-rollout-kv-tis"].actor_rollout_ref.rollout.kv_cache_dtype == "fp8_e4m3"
    assert cfgs["grpo_fp8-rollout-tis"].actor_rollout_ref.rollout.kv_cache_dtype == "auto"
    assert got["grpo_fp8-train"] == (None, "e4m3", None, "grpo_fp8-train")
    assert cfgs["ppo_fp8-train"].critic.megatron.fp8 == "e4m3"
    assert cfgs["ppo_fp8-train"].algorithm.adv_estimator == "gae"
    assert len({c.trainer.seed for c in cfgs.values()}) == 1


def fused_mlp_against_unfused(device, act, unfused_act, dtype, fuse_wgrad=False, steps=3):
    """`fp8_mlp.fp8_swiglu_mlp` with `act` against two delayed `fp8_linear_train_tensorwise` layers around
    `unfused_act` (the same activation under autograd: the unfused path), each with its own `ActivationAmaxes` (4
    sites) and kept weight codes, over `steps` forward + backward passes with a roll between them (the first primes
    every site with current scaling, the later ones use the delayed scales; on CUDA with `TRITON_SWIGLU` those run
    the producer casts): outputs, input gradients, weight gradients (or main_grad under `fuse_wgrad`) and the sites'
    state equal bit for bit. Returns how many passes ran with every site primed."""
    from rlhf_mcore.kernels.fp8_linear import ActivationAmaxes, DelayedSites, WeightAmax, fp8_linear_train_tensorwise
    from rlhf_mcore.kernels.fp8_mlp import LinearState, fp8_swiglu_mlp

    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(37, 64, generator=g).to(device, dtype)
    w1 = (torch.randn(2 * 96, 64, generator=g) * 0.1).to(device, dtype)
    w2 = (torch.randn(64, 96, generator=g) * 0.1).to(device, dtype)
    runs, delayed_passes = {}, 0
    for fused in (False, True):
        reg = ActivationAmaxes(4, 2, device)
        fc1 = LinearState(WeightAmax(keep_codes="forward"), DelayedSites(reg))
        fc2 = LinearState(WeightAmax(keep_codes="forward"), DelayedSites(reg))
        params = [w.clone().requires_grad_() for w in (w1, w2)]
        if fuse_wgrad:
            for p in params:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
        outs = []
        for step in range(steps):
            x = (x0 * (1 + step)).requires_grad_()  # growing amaxes: the delayed scales saturate
            if fused:
                out = fp8_swiglu_mlp(x, *params, fc1, fc2, act, E5M2, None, fuse_wgrad)
            else:
                y = fp8_linear_train_tensorwise(x, params[0], None, E5M2, None, fc1.weight_amax, fuse_wgrad,
                                                fc1.sites)
                out = fp8_linear_train_tensorwise(unfused_act(y), params[1], None, E5M2, None, fc2.weight_amax,
                                                  fuse_wgrad, fc2.sites)
            delayed_passes += fused and all(reg.primed)
            (out.float() * torch.linspace(-1, 1, out.shape[-1], device=device)).sum().backward()
            grads = [p.main_grad.clone() if fuse_wgrad else p.grad.clone() for p in params]
            outs.append((out.detach(), x.grad, *grads, reg.seen.clone()))
            for p in params:
                p.grad = None
            reg.roll()
            for fc in (fc1, fc2):
                fc.weight_amax.invalidate()
        runs[fused] = (outs, reg.hist.clone(), reg.amax.clone())
    for a, b in zip(runs[False][0], runs[True][0]):
        for u, v in zip(a, b):
            assert torch.equal(u, v)
    assert torch.equal(runs[False][1], runs[True][1]) and torch.equal(runs[False][2], runs[True][2])
    return delayed_passes


@pytest.mark.parametrize("fuse_wgrad", [False, True], ids=["grads", "main_grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_swiglu_mlp_equals_the_two_linears(dtype, fuse_wgrad):
    """The delayed recipe's MLP as one Function (`fp8_mlp`, CPU: the eager activation, the unfused casts inside the
    Function) equals the two delayed linears around Megatron's eager glu bit for bit over three passes (primed, then
    delayed, saturating), weight gradients returned or accumulated into main_grad; the fused path's producer casts
    are compared on the GPU (`test_fp8_gpu.py`). Mutations (run): dx from fc2's weight codes -> shape error; fc1's dy
    cast at fc1's x site -> the gradients differ; x cast in the gradient format (e5m2) -> the outputs differ."""
    from rlhf_mcore.kernels.fp8_mlp import EAGER_SWIGLU
    from rlhf_mcore.kernels.fused_layer import swiglu_reference

    assert fused_mlp_against_unfused("cpu", EAGER_SWIGLU, swiglu_reference, dtype, fuse_wgrad) == 2


@pytest.mark.parametrize("recompute, dtype", [(True, torch.float32), (False, torch.bfloat16)],
                         ids=["full_recompute", "bf16"])
def test_fused_swiglu_mlp_on_the_engine(fp8_engine_env, monkeypatch, recompute, dtype):
    """fp8_recipe=delayed on a tiny Megatron GPTModel (CPU, fp8=hybrid): with its two MLPs run as one Function each
    (`fp8_training._fuse_swiglu_mlp`, the default) a log-prob pass and two PPO updates of 4 micro-batches give the
    same log-probs, losses, gradient norms and parameters as the two linears around Megatron's glu, bit for bit.
    Mutation (run): the fused MLP's output not all-reduced is invisible here (TP=1: test_engine.py's TP=2 delayed
    case covers it); `_fuse_swiglu_mlp` returning before `mlp.forward` is replaced -> the count check fails."""
    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine import EngineConfig, TrainEngine
    from rlhf_mcore.engine.builder import recompute_overrides
    from rlhf_mcore.models import build_model, fp8_training

    model_dir, state, batch = fp8_engine_env
    res = {}
    for fuse in (False, True):
        monkeypatch.setattr(fp8_training, "FUSE_SWIGLU_MLP", fuse)
        torch.manual_seed(0)
        chunks = build_model(model_dir, state, role="actor", dtype=dtype,
                             config_overrides=recompute_overrides(recompute) or None)
        assert fp8_training.enable_fp8_training(chunks, "hybrid", "k", "delayed", amax_history=2) == 8
        assert getattr(chunks[0], "fp8_fused_mlps", 0) == (2 if fuse else 0)
        assert sum("forward" in vars(m) for m in chunks[0].modules()) == (2 if fuse else 0)
        eng = TrainEngine(chunks, state, EngineConfig(role="actor", micro_batch_size=2, mini_batch_size=8),
                          OptimConfig(lr=1e-2))
        logp = eng.compute_log_probs(batch)[0]
        metrics = [eng.update_policy(batch) for _ in range(2)]
        res[fuse] = (logp, metrics, [p.detach().clone() for p in chunks[0].parameters()],
                     chunks[0].fp8_activation_amaxes.hist.clone())
    assert torch.equal(res[False][0], res[True][0])
    for m0, m1 in zip(res[False][1], res[True][1]):
        assert (m1["actor/pg_loss"], m1["actor/grad_norm"]) == (m0["actor/pg_loss"], m0["actor/grad_norm"])
    for a, b in zip(res[False][2], res[True][2]):
        assert torch.equal(a, b)
    assert torch.equal(res[False][3], res[True][3])
