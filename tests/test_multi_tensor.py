"""The sync-free stand-ins for megatron-core's multi-tensor fallbacks (rlhf_mcore/engine/multi_tensor.py)."""
from __future__ import annotations

import pytest
import torch

from rlhf_mcore.engine import multi_tensor


def _tensors(device="cpu"):
    g = torch.Generator().manual_seed(0)
    shapes = [(896, 896), (4864,), (1,), (3, 7, 5), (151_936 // 64, 64)]
    return [(torch.randn(s, generator=g) * (i + 1)).to(device) for i, s in enumerate(shapes)]


def test_l2_norm_matches_a_float64_loop():
    """Mutation: summing the per-tensor norms instead of taking the norm of them (error ~2x)."""
    tensors = _tensors()
    total, per = multi_tensor.foreach_l2_norm(2048 * 32, None, [tensors], True)
    ref_per = [t.double().pow(2).sum().sqrt() for t in tensors]
    ref = torch.stack(ref_per).pow(2).sum().sqrt()
    assert total.shape == (1,) and total.dtype == torch.float32
    torch.testing.assert_close(total.double(), ref.reshape(1), rtol=1e-5, atol=0)  # fp32 sums of ~1e6 squares
    torch.testing.assert_close(per.double(), torch.stack(ref_per), rtol=1e-5, atol=0)  # fp32 sums of ~1e6 squares
    assert multi_tensor.foreach_l2_norm(0, None, [tensors], False)[1] is None


def test_l2_norm_matches_megatrons_local_fallback():
    """The same number megatron-core's own fallback gives (it builds its result on 'cuda': CPU mode maps it)."""
    from megatron.core.utils import local_multi_tensor_l2_norm

    from rlhf_mcore.parallel import cpu_compat

    tensors = _tensors()
    ours, _ = multi_tensor.foreach_l2_norm(0, None, [tensors], False)
    if torch.cuda.is_available():
        theirs, _ = local_multi_tensor_l2_norm(0, None, [[t.cuda() for t in tensors]], False)
    else:
        with cpu_compat._CudaToCpuMode():  # its result tensor is made on "cuda"
            theirs, _ = local_multi_tensor_l2_norm(0, None, [tensors], False)
    torch.testing.assert_close(ours, theirs.cpu(), rtol=1e-5, atol=0)  # fp32 sums of ~1e6 squares


def test_scale_in_place_copy_and_cast():
    """Mutation: skipping the in-place multiply when src is dst (the clipped gradients keep their size)."""
    tensors = _tensors()
    before = [t.clone() for t in tensors]
    multi_tensor.foreach_scale(0, None, [tensors, tensors], 0.25)  # gradient clipping: in place
    for t, b in zip(tensors, before):
        torch.testing.assert_close(t, b * 0.25, rtol=0, atol=0)
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in tensors]
    multi_tensor.foreach_scale(0, None, [tensors, dst], 1.0)  # main (fp32) -> model (bf16) parameters
    for t, d in zip(tensors, dst):
        assert torch.equal(d, t.to(torch.bfloat16))
    multi_tensor.foreach_scale(0, None, [tensors, dst], 2.0)
    for t, d in zip(tensors, dst):
        assert torch.equal(d, (t * 2.0).to(torch.bfloat16))
    multi_tensor.foreach_scale(0, None, [[], []], 2.0)  # nothing to do


def test_install_replaces_only_the_local_fallbacks(monkeypatch):
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, optimizer

    monkeypatch.setattr(clip_grads, "l2_norm_impl", mcore_utils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", mcore_utils.local_multi_tensor_scale)
    fused = object()  # what Transformer Engine or Apex would have put there
    monkeypatch.setattr(optimizer, "multi_tensor_scale_impl", fused)
    replaced = multi_tensor.install()
    assert replaced == ["megatron.core.optimizer.clip_grads.l2_norm_impl",
                        "megatron.core.optimizer.clip_grads.multi_tensor_scale_impl"]
    assert clip_grads.l2_norm_impl is multi_tensor.foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is multi_tensor.foreach_scale
    assert optimizer.multi_tensor_scale_impl is fused
    assert multi_tensor.install() == []  # idempotent


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the host reads are what it removes)")
def test_l2_norm_never_syncs_with_the_host():
    """Mutation: megatron's local fallback in its place (it reads every tensor's norm back: the sync check raises)."""
    tensors = _tensors("cuda")
    before = [t.clone() for t in tensors]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        total, _ = multi_tensor.foreach_l2_norm(0, None, [tensors], False)
        multi_tensor.foreach_scale(0, None, [tensors, tensors], 0.5)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = torch.stack([t.double().norm() for t in before]).norm()
    torch.testing.assert_close(total.double().cpu(), ref.cpu().reshape(1), rtol=1e-5, atol=0)
    for t, b in zip(tensors, before):
        assert torch.equal(t, b * 0.5)
