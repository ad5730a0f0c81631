"""The fused SwiGLU and packed-RoPE kernels (kernels/fused_layer.py) against their eager references, alone and
inside the Megatron model (`build_model(fused_kernels=True)` against `False` on the same weights and batch).

On a GPU the kernels run compiled; without CUDA on CPU under the Triton interpreter (`TRITON_INTERPRET=1` set
before triton is imported, as in tests/test_kernel_fused_logprob.py). Tolerances: fp32 inputs agree with the
references to 1e-5; in bf16 the kernels round once (fp32 inside) where the eager chain rounds after every
operation, so each must be at least as close to the fp32 result as the eager bf16 result is (plus one bf16
unit of the value's magnitude).
"""
from __future__ import annotations

import pytest
import torch
from triton_kernels import import_kernel_module

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


fl = import_kernel_module("fused_layer")


def _close_as_eager(fused: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor) -> None:
    """fp32: fused == eager within 1e-5. bf16: the fused result no further from the fp32 one than eager + 1 ulp."""
    if fused.dtype == torch.float32:
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
        return
    err_fused = (fused.float() - exact).abs()
    err_eager = (eager.float() - exact).abs()
    ulp = exact.abs() * 2.0 ** -7 + 1e-6
    assert (err_fused <= err_eager + ulp).all(), (err_fused - err_eager - ulp).max()


def _both(fn_fused, fn_ref, inputs, dtype, seed=1):
    """Values and input gradients of the kernel, of the reference in `dtype`, and of the reference in fp32 (on
    the same inputs, rounded to `dtype` first)."""
    outs = []
    g = None
    inputs = [x.to(dtype) for x in inputs]
    for fn, dt in ((fn_fused, dtype), (fn_ref, dtype), (fn_ref, torch.float32)):
        xs = [x.to(dt).detach().requires_grad_(i == 0) for i, x in enumerate(inputs)]
        y = fn(*xs)
        if g is None:
            g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.device, dtype)
        y.backward(g.to(dt))
        outs.append((y.detach(), xs[0].grad))
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_values_and_gradients(dtype, monkeypatch):
    monkeypatch.setattr(fl, "BLOCK_F", 16)  # F = 37: three column blocks, the last one masked
    y = torch.randn(2, 9, 2 * 37, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 3
    (fo, fg), (eo, eg), (xo, xg) = _both(fl.swiglu, fl.swiglu_reference, [y], dtype)
    assert fo.shape == (2, 9, 37) and fo.dtype == dtype and fg.dtype == dtype
    _close_as_eager(fo, eo, xo)
    _close_as_eager(fg, eg, xg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_values_and_gradients(dtype):
    T, H, D = 23, 5, 16  # H not a power of two: masked heads
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, D, generator=g).to(DEVICE)
    angles = torch.rand(T, D // 2, generator=g) * 50
    angles = torch.cat([angles, angles], -1).to(DEVICE)  # Megatron's table: the frequencies twice
    cos, sin = angles.cos(), angles.sin()
    (fo, fg), (eo, eg), (xo, xg) = _both(fl.rope_rotate, fl.rope_reference, [x, cos, sin], dtype)
    _close_as_eager(fo, eo, xo)
    _close_as_eager(fg, eg, xg)


def test_bad_shapes_name_the_fix():
    x = torch.randn(4, 2, 12, device=DEVICE)  # D/2 = 6: not a power of two
    assert not fl.rope_supported(x, torch.randn(4, 12, device=DEVICE))
    with pytest.raises(ValueError, match="rope_reference"):
        fl.rope_rotate(x, torch.randn(4, 12, device=DEVICE), torch.randn(4, 12, device=DEVICE))
    with pytest.raises(ValueError, match="even last dimension"):
        fl.swiglu(torch.randn(3, 5, device=DEVICE))


def test_fused_model_equals_the_eager_model(tiny_model_dir):
    """The same weights and packed batch through `build_model(fused_kernels=True)` and `False`, both in fp32:
    logits and every parameter gradient agree within 1e-5 (CPU) / 1e-4 (GPU: other attention kernels, the
    same in both models)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from rlhf_mcore.models import build_model
    from rlhf_mcore.models.fused_layers import FusedSwiGLU
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    model_dir = tiny_model_dir(arch="qwen2", vocab=1000, layers=2, heads=4, kv_heads=2)
    state = init_distributed(device=DEVICE)
    try:
        lens = [37, 5, 20, 1]
        total = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        ids = torch.randint(0, 1000, (1, total), generator=torch.Generator().manual_seed(3)).to(DEVICE)
        pos = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)[None]
        results = {}
        for fused in (True, False):
            model = build_model(model_dir, state, fused_kernels=fused, dtype=torch.float32)[0]
            mlps = [layer.mlp for layer in model.decoder.layers]
            assert all(isinstance(m.activation_func, FusedSwiGLU) == fused for m in mlps)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                                     max_seqlen_kv=max(lens))
            logits = model(ids, pos, None, packed_seq_params=params)
            logits.float().square().mean().backward()
            results[fused] = (logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()
                                                        if p.grad is not None})
    finally:
        destroy_distributed()
    (lf, gf), (le, ge) = results[True], results[False]
    assert gf.keys() == ge.keys() and len(gf) > 10

    tol = 1e-4 if CUDA else 1e-5

    def check(a, b, name):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, b.abs().max().item()), msg=name)
    check(lf, le, "logits")
    for name in ge:
        check(gf[name], ge[name], name)
