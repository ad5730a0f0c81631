"""The experts' grouped GEMM on a GPU (skipped without CUDA): `kernels.grouped_mm` through `torch._grouped_mm` in bf16
against its per-expert loop in bf16, forward and gradients (input and stacked weight), at one Qwen3-30B-A3B MoE
layer's fc1 shape (hidden 2048 -> 2 x 768, 128 experts, top-8 of 512 tokens: 4096 rows, some experts empty).

Tolerance: both paths accumulate in fp32 and round once to bf16 (unit roundoff 2^-8 = 3.9e-3), so they differ by
about one bf16 ulp of the result: |grouped - loop| <= 2e-2 max(1, std) + 2e-2 |loop| elementwise, and each
path's error against the fp32 loop is within 2x the other's plus 1e-3 of its scale (the kernel is no worse than the
loop). The trainer's experts (`models.grouped_experts`) call exactly this function; their equality with Megatron's
SequentialMLP is tests/test_grouped_experts.py's (CPU, fp32)."""
import pytest
import torch

pytestmark = [pytest.mark.cost(3), pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(x, w, counts, grad, grouped):
    from rlhf_mcore.kernels.grouped_mm import grouped_mm

    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_mm(x, w, counts, grouped=grouped)
    y.backward(grad)
    return y.detach().float(), x.grad.float(), w.grad.float()


def test_cuda_grouped_mm_equals_the_loop_in_bf16():
    """Not run in this project's CI (no GPU). The offsets' mutation (counts instead of their cumulative sum) is caught
    on the CPU by tests/test_grouped_experts.py through torch's CPU `_grouped_mm`; here the same would move rows to
    the wrong experts, far outside the tolerance."""
    from rlhf_mcore.kernels.grouped_mm import use_grouped_mm

    g = torch.Generator(device="cuda").manual_seed(0)
    experts, hidden, out, rows = 128, 2048, 2 * 768, 4096
    counts = torch.randint(0, 2 * rows // experts, (experts,), device="cuda", generator=g)
    counts[::9] = 0  # experts routed no token
    counts[-1] += rows - counts.sum()  # exactly `rows` rows
    counts = counts.clamp(min=0)
    rows = int(counts.sum())
    x = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
    w = (0.02 * torch.randn(experts, out, hidden, device="cuda", generator=g)).bfloat16()
    grad = torch.randn(rows, out, device="cuda", generator=g).bfloat16()
    assert use_grouped_mm(x, w)  # the CUDA path really runs torch._grouped_mm
    got = _run(x, w, counts, grad, grouped=None)
    loop = _run(x, w, counts, grad, grouped=False)
    ref = _run(x.float(), w.float(), counts, grad.float(), grouped=False)
    for name, a, b, r in zip(("out", "x.grad", "w.grad"), got, loop, ref):
        torch.testing.assert_close(a, b, atol=2e-2 * max(1.0, r.std().item()), rtol=2e-2, msg=name)
        err_a, err_b = (a - r).abs().max().item(), (b - r).abs().max().item()
        assert err_a <= 2 * err_b + 1e-3 * r.abs().max().item(), (name, err_a, err_b)
    assert got[2][counts == 0].abs().max() == 0  # empty experts: zero gradient
