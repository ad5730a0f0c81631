"""The native engine's FP8 KV cache (`kv_cache_dtype="fp8_e4m3"`, `actor_rollout_ref.rollout.kv_cache_dtype`) on
CPU: the quantization rule, the cache's writes, the engine and config refusals, and a greedy run against the
model-dtype cache. The Triton kernels that read and write it are checked under the interpreter
(tests/test_rollout_native.py, `_kv_fp8_check`) and on a GPU (tests/test_fp8_gpu.py)."""

import pytest
import torch

from rlhf_mcore.kernels.fp8 import E4M3, Fp8Unsupported
from rlhf_mcore.rollout.native.kv_cache import KVCache, dequantize_kv, quantize_kv


def test_quantize_kv_one_scale_per_head_vector_within_half_an_e4m3_step():
    """Each (token, head) vector gets scale amax / 448 (its largest value becomes the largest code, exactly), every
    element comes back within half an e4m3 step (|x| / 16, or half the smallest subnormal step times the scale),
    and a zero vector gets scale 1 and zero codes. Mutation: the scale taken over the whole tensor instead of each
    vector -> the small-magnitude rows lose their precision and the bound fails."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 64, generator=g) * torch.logspace(-3, 2, 6)[:, None, None]
    x[2, 1] = 0
    q, scale = quantize_kv(x)
    assert q.dtype == E4M3 and q.shape == x.shape and scale.shape == (6, 3) and scale.dtype == torch.float32
    amax = x.abs().amax(-1)
    torch.testing.assert_close(scale[amax > 0], amax[amax > 0] / 448)
    assert scale[2, 1] == 1 and not q[2, 1].float().any()
    back = dequantize_kv(q, scale, torch.float32)
    assert (back - x).abs().le(x.abs() / 16 + scale[..., None] * 2 ** -10).all()
    assert (back.abs().amax(-1) - amax).abs().max() <= 1e-6 * amax.max()
    assert dequantize_kv(x, None, torch.float32) is x  # a model-dtype cache as it is


def test_fp8_cache_writes_codes_and_scales_at_the_index_only():
    """`KVCache.put` on an FP8 cache writes each (slot, position) row's codes and scales, and nothing else; its
    `layer` hands the attention functions both; its bytes are the codes' plus the scales' (less than half a bf16
    cache's at head_dim 64). Mutation: `put` writing the values' scales into k_scale -> the scale check fails."""
    cache = KVCache.allocate(2, 4, 8, 2, 64, "cpu", torch.bfloat16, fp8=True)
    plain = KVCache.allocate(2, 4, 8, 2, 64, "cpu", torch.bfloat16)
    assert cache.fp8 and not plain.fp8 and cache.k.dtype == E4M3
    assert cache.nbytes() == 2 * (2 * 4 * 8 * 2 * 64 + 2 * 4 * 8 * 2 * 4) < plain.nbytes() * 0.57
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 2, 64, generator=g), 5 * torch.randn(3, 2, 64, generator=g)
    slots, pos = torch.tensor([0, 3, 3]), torch.tensor([1, 0, 7])
    cache.put(1, (slots, pos), k, v)
    kq, ks = quantize_kv(k)
    vq, vs = quantize_kv(v)
    assert torch.equal(cache.k[1, slots, pos].view(torch.uint8), kq.view(torch.uint8))
    assert torch.equal(cache.v[1, slots, pos].view(torch.uint8), vq.view(torch.uint8))
    assert torch.equal(cache.k_scale[1, slots, pos], ks) and torch.equal(cache.v_scale[1, slots, pos], vs)
    written = torch.zeros(4, 8, dtype=torch.bool)
    written[slots, pos] = True
    assert not cache.k[0].float().any() and not cache.k[1][~written].float().any()
    assert (cache.k_scale[1][~written] == 1).all() and (cache.k_scale[0] == 1).all()
    assert set(cache.layer(1)) == {"k_cache", "v_cache", "k_scale", "v_scale"}
    assert set(plain.layer(1)) == {"k_cache", "v_cache"}


def test_engine_refuses_an_fp8_cache_where_it_cannot_run(tiny_model_dir):
    """kv_cache_dtype: an unknown value, and fp8_e4m3 on a device without FP8 (here: the CPU), are refused in one
    line naming the key and the value."""
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    model_dir = tiny_model_dir("qwen2", hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512)
    cpu = dict(max_num_seqs=2, max_model_len=16, device="cpu")
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.rollout.kv_cache_dtype='fp8': choose auto"):
        NativeRolloutEngine(model_dir, kv_cache_dtype="fp8", **cpu)
    with pytest.raises(Fp8Unsupported, match=r"^actor_rollout_ref.rollout.kv_cache_dtype=fp8_e4m3 needs a CUDA GPU"):
        NativeRolloutEngine(model_dir, kv_cache_dtype="fp8_e4m3", **cpu)


def test_fp8_cache_engine_tracks_the_model_dtype_cache(tiny_model_dir, monkeypatch):
    """The engine with an FP8 cache (CPU, torch paths, the device check patched out) against the same model with a
    model-dtype cache, greedy: the first token's log-prob is the same (a prompt's prefill attends over its exact
    keys), later ones move (the decode steps read the codes): this tiny random model is sharp (log-probs near -1) and
    moves a lot under any rounding; measured 0.12 mean / 0.43 max over 62 steps, where FP8 weights
    (quantization=fp8) move it 0.16 / 0.51; bounds 0.2 / 0.75. The cache holds codes and scales, and is FP8 again
    after a sleep and wake.
    Mutation: the torch decode path reading the codes without their scales (`_rows` returning codes.to(dtype)) ->
    the log-probs leave the model-dtype run's and the bound fails."""
    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native import fp8 as native_fp8
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    monkeypatch.setattr(native_fp8, "check_fp8_device", lambda *a: None)
    model_dir = tiny_model_dir("qwen2", hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512)
    cpu = dict(max_num_seqs=12, max_model_len=64, device="cpu")
    fp8 = NativeRolloutEngine(model_dir, kv_cache_dtype="fp8_e4m3", **cpu)
    ref = NativeRolloutEngine(model_dir, **cpu)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=16, ignore_eos=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (12,), generator=g)]
    out, want = fp8.generate(prompts, params), ref.generate(prompts, params)
    assert fp8.cache.fp8 and fp8.cache.k.dtype == E4M3 and not ref.cache.fp8
    assert fp8.cache.k_scale.ne(1).any() and fp8.cache.k.float().abs().max() == 448
    gaps = []
    for o, r in zip(out, want):
        a, b = o.samples[0], r.samples[0]
        assert a.logprobs[0] == pytest.approx(b.logprobs[0], abs=1e-6)
        for j in range(1, len(a.token_ids)):
            if a.token_ids[j - 1] != b.token_ids[j - 1]:
                break
            gaps.append(abs(a.logprobs[j] - b.logprobs[j]))
    gaps = torch.tensor(gaps)
    print(f"fp8 cache: {len(gaps)} steps, |dlogprob| mean {gaps.mean():.4f} max {gaps.max():.4f}")
    assert len(gaps) >= 20 and 0 < gaps.max() < 0.75 and gaps.mean() < 0.2, gaps
    # sleep frees the cache, wake allocates it again: FP8 again, and the same greedy samples. Mutation (run): `wake`
    # allocating the cache in the model's dtype (KVCache.allocate without fp8=) -> the check fails.
    freed = fp8.sleep(1)
    assert fp8.cache is None and freed > 0
    fp8.wake()
    again = fp8.generate(prompts, params)
    assert fp8.cache.fp8 and [o.samples[0].token_ids for o in again] == [o.samples[0].token_ids for o in out]
