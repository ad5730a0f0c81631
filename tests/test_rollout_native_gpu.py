"""The native rollout engine on a GPU: what only runs there, against references.

The CPU tests (test_rollout_native.py) cover the engine's logic in fp32 on the torch paths, and the Triton
kernels under the interpreter in fp32. Here, compiled: the decode-attention kernel, the decode GEMMs and packed
prefill attention in bf16 against higher precision, the fused sampler against the torch sampler on a full-size
vocabulary, and the whole engine (CUDA graphs or eager, Triton or torch attention, fused or unfused element-wise
ops) against transformers' greedy decoding, teacher-forced log-probs, batch-invariant seeded sampling and
sleep/wake.
Skipped without CUDA.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCHS = ["qwen2", "llama", "qwen3"]
NEW_TOKENS = 24
# engine variants: CUDA graphs + Triton attention (the default on GPU), and one switch off at a time
VARIANTS = {"graphs_triton": {}, "graphs_torch_attention": {"attention": "torch"},
            "eager_triton": {"cuda_graphs": False}, "graphs_unfused": {"fused_kernels": False}}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype,hq,hkv,d,tol", [(torch.bfloat16, 14, 2, 64, 1e-2), (torch.bfloat16, 32, 8, 128, 1e-2),
                                               (torch.float32, 4, 2, 16, 1e-5)], ids=["bf16_gqa7", "bf16_gqa4", "fp32"])
def test_decode_attention_kernel_matches_fp64(dtype, hq, hkv, d, tol):
    """Slot-indexed decode attention over lengths 1..L, with one split, the heuristic's and eight; the program order
    with a row's kv heads launched together gives the same bits as the order with them apart."""
    from rlhf_mcore.rollout.native.attention import decode_attention_torch
    from rlhf_mcore.rollout.native.triton_kernels import attention_config, decode_attention, num_splits_for

    g = torch.Generator(device="cuda").manual_seed(0)
    slots_total, max_len, batch = 64, 700, 37
    k = torch.randn(slots_total, max_len, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(slots_total, max_len, hkv, d, device="cuda", dtype=dtype, generator=g)
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype, generator=g)
    slots = torch.randperm(slots_total, device="cuda", generator=g)[:batch]
    lens = torch.randint(1, max_len + 1, (batch,), device="cuda", generator=g)
    ref = decode_attention_torch(q.double(), k.double(), v.double(), slots, lens, d ** -0.5, max_len)
    for splits in (1, num_splits_for(batch, hkv, max_len), 8):
        out = decode_attention(q, k, v, slots, lens, d ** -0.5, splits)
        assert out.dtype == dtype and out.shape == q.shape
        err = rel_err(out, ref)
        assert err <= tol, f"{splits} split(s): relative error {err:.3g} > {tol:g}"
        for heads_fastest in (False, True):
            cfg = dict(attention_config(batch, d), HEADS_FASTEST=heads_fastest)
            assert torch.equal(decode_attention(q, k, v, slots, lens, d ** -0.5, splits, config=cfg), out)


@pytest.mark.parametrize("rows", [1, 64, 256, 512])
def test_decode_gemm_kernels_bf16_match_fp32(rows):
    """The decode step's Triton GEMMs at the Qwen2.5-0.5B shapes, with their configs' K splits and tiles, in bf16
    against fp32 torch: o/down as K-split partials summed by add_rms_norm, gate_up with silu*mul, and the QKV GEMM
    with bias, RoPE and the cache write (at 512 rows with its 64-wide K blocks; the engine sends o/down to cuBLAS
    there). Mutation: the split loop of _add_rms_norm_kernel starting at 2 (one K partial dropped) -> the residual
    check fails at 1, 64 and 256 rows (o and down run split at all three)."""
    from rlhf_mcore.models.rope import default_inv_freq
    from rlhf_mcore.rollout.native.model import rms_norm
    from rlhf_mcore.rollout.native.rope import apply_rope, rope_tables
    from rlhf_mcore.rollout.native.triton_kernels import add_rms_norm, linear, qkv_rope_cache

    g = torch.Generator(device="cuda").manual_seed(3)
    bf = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", generator=g)).to(bf)

    d, inter, hq, hkv, hd = 896, 4864, 14, 2, 64
    for k, scale in ((d, 0.03), (inter, 0.015)):  # o_proj, down_proj: partials + residual add + norm
        x, w, res, nw = rnd(rows, k), rnd(d, k, scale=scale), rnd(rows, d), rnd(d)
        ref_res = res.float() + (x.float() @ w.float().T)
        new_res, h = add_rms_norm(res.clone(), linear(x, w, allow_split=True), nw, 1e-6)
        assert rel_err(new_res, ref_res) <= 1e-2, f"K={k}: residual {rel_err(new_res, ref_res):.3g}"
        assert rel_err(h, rms_norm(ref_res, nw.float(), 1e-6)) <= 1e-2
    x, wgu = rnd(rows, d), rnd(2 * inter, d, scale=0.03)
    ref = torch.nn.functional.silu(x.float() @ wgu[:inter].float().T) * (x.float() @ wgu[inter:].float().T)
    assert rel_err(linear(x, wgu, silu_mul=True), ref) <= 1e-2
    cos, sin = rope_tables(default_inv_freq(hd, 1e6), 600, "cuda", bf)
    wqkv, bqkv = rnd((hq + 2 * hkv) * hd, d, scale=0.03), rnd((hq + 2 * hkv) * hd, scale=0.1)
    pos = torch.randint(0, 600, (rows,), device="cuda", generator=g)
    slot = torch.randperm(rows + 3, device="cuda", generator=g)[:rows]
    kc, vc = (torch.zeros(rows + 3, 600, hkv, hd, device="cuda", dtype=bf) for _ in range(2))
    q = qkv_rope_cache(x, wqkv, bqkv, pos, slot, cos, sin, kc, vc, hq, hkv)
    qkv = x.float() @ wqkv.float().T + bqkv.float()
    cf, sf = cos.float()[pos], sin.float()[pos]
    assert rel_err(q, apply_rope(qkv[:, :hq * hd].view(rows, hq, hd), cf, sf)) <= 1e-2
    assert rel_err(kc[slot, pos], apply_rope(qkv[:, hq * hd:(hq + hkv) * hd].view(rows, hkv, hd), cf, sf)) <= 1e-2
    assert rel_err(vc[slot, pos], qkv[:, (hq + hkv) * hd:].view(rows, hkv, hd)) <= 1e-2


@pytest.mark.parametrize("rows", [1, 64, 256])
def test_qkv_epilogue_at_the_7b_head_layout_bf16_matches_fp32(rows):
    """The 7B head layout (28 query heads, 4 KV heads of 128): `rope_cache` on cuBLAS's bf16 projection (what a
    weight above `TRITON_GEMM_MAX_WEIGHT` takes), and `qkv_rope_cache` with two programs a head, in bf16 against
    fp32 torch (q, the cache rows written); and the prefill's `rope_qkv` (its k and v rows written to the cache here).
    Mutation: `rope_cache` reading the second half at the first half's columns -> the q check fails at every row
    count."""
    from rlhf_mcore.models.rope import default_inv_freq
    from rlhf_mcore.rollout.native.rope import apply_rope, rope_tables
    from rlhf_mcore.rollout.native.triton_kernels import qkv_rope_cache, rope_cache, rope_qkv

    g = torch.Generator(device="cuda").manual_seed(4)
    bf = torch.bfloat16
    k_dim, hq, hkv, hd = 3584, 28, 4, 128
    x = torch.randn(rows, k_dim, device="cuda", generator=g).to(bf)
    wqkv = (0.02 * torch.randn((hq + 2 * hkv) * hd, k_dim, device="cuda", generator=g)).to(bf)
    bqkv = (0.1 * torch.randn((hq + 2 * hkv) * hd, device="cuda", generator=g)).to(bf)
    cos, sin = rope_tables(default_inv_freq(hd, 1e6), 600, "cuda", bf)
    pos = torch.randint(0, 600, (rows,), device="cuda", generator=g)
    slot = torch.randperm(rows + 3, device="cuda", generator=g)[:rows]
    qkv = x.float() @ wqkv.float().T + bqkv.float()
    cf, sf = cos.float()[pos], sin.float()[pos]
    want_q = apply_rope(qkv[:, :hq * hd].view(rows, hq, hd), cf, sf)
    want_k = apply_rope(qkv[:, hq * hd:(hq + hkv) * hd].view(rows, hkv, hd), cf, sf)
    def packed(kc, vc):
        q, k, v = rope_qkv(torch.nn.functional.linear(x, wqkv, bqkv), pos, cos, sin, hq, hkv)
        kc[slot, pos], vc[slot, pos] = k, v
        return q

    for name, run in (("rope_cache", lambda kc, vc: rope_cache(torch.nn.functional.linear(x, wqkv, bqkv), pos, slot,
                                                                cos, sin, kc, vc, hq, hkv)),
                      ("head_split=2", lambda kc, vc: qkv_rope_cache(x, wqkv, bqkv, pos, slot, cos, sin, kc, vc, hq,
                                                                     hkv, head_split=2)),
                      ("rope_qkv", packed)):
        kc, vc = (torch.zeros(rows + 3, 600, hkv, hd, device="cuda", dtype=bf) for _ in range(2))
        q = run(kc, vc)
        assert rel_err(q, want_q) <= 1e-2, (name, rel_err(q, want_q))
        assert rel_err(kc[slot, pos], want_k) <= 1e-2, name
        assert rel_err(vc[slot, pos], qkv[:, (hq + hkv) * hd:].view(rows, hkv, hd)) <= 1e-2, name


def test_rope_epilogues_bf16_equal_the_torch_path():
    """The rotary epilogues that read a computed bf16 projection -- the prefill's `rope_qkv` and the decode's
    `rope_cache` -- give q, k (and v) bit for bit what the torch path gives (`apply_rope` on the projection's views,
    transformers' rounding), at the 7B head layout and positions up to 1,000. Mutation: `NO_FP_FUSION` emptied (the
    compiler's floating-point fusion back on) -> 16% of q's values one bf16 step off, fails (session 37)."""
    from rlhf_mcore.models.rope import default_inv_freq
    from rlhf_mcore.rollout.native.rope import apply_rope, rope_tables
    from rlhf_mcore.rollout.native.triton_kernels import rope_cache, rope_qkv

    g = torch.Generator(device="cuda").manual_seed(7)
    n, hq, hkv, hd = 600, 28, 4, 128
    qkv = torch.randn(n, (hq + 2 * hkv) * hd, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 1000, (n,), device="cuda", generator=g)
    cos, sin = rope_tables(default_inv_freq(hd, 1e6), 1000, "cuda", torch.bfloat16)
    qk = apply_rope(qkv[:, :(hq + hkv) * hd].view(n, hq + hkv, hd), cos[pos], sin[pos])
    v_want = qkv[:, (hq + hkv) * hd:].view(n, hkv, hd)
    q, k, v = rope_qkv(qkv, pos, cos, sin, hq, hkv)
    assert torch.equal(q, qk[:, :hq]) and torch.equal(k, qk[:, hq:]) and torch.equal(v, v_want)
    slot = torch.randperm(n, device="cuda", generator=g)
    kc, vc = (torch.zeros(n, 1000, hkv, hd, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q2 = rope_cache(qkv, pos, slot, cos, sin, kc, vc, hq, hkv)
    assert torch.equal(q2, qk[:, :hq]) and torch.equal(kc[slot, pos], qk[:, hq:]) and torch.equal(vc[slot, pos], v_want)


def test_prefill_cache_write_equals_kv_cache_put():
    """The prefill's cache write (`kv_write`) at the 7B head layout, 2,000 tokens written to 3,000 (slot, position)
    entries (a third of the tokens to two slots, as a fresh prompt's samples): a bf16 cache and an FP8 one hold
    exactly what `KVCache.put` of the gathered rows writes (codes and scales bit for bit: the same amax / 448 and
    hardware cast). Mutation: the source row taken as the entry index -> the caches differ."""
    from rlhf_mcore.rollout.native.kv_cache import KVCache
    from rlhf_mcore.rollout.native.triton_kernels import kv_write

    g = torch.Generator(device="cuda").manual_seed(3)
    n, hkv, hd, slots, max_len = 2000, 4, 128, 64, 128
    k, v = (torch.randn(n, hkv, hd, device="cuda", generator=g).mul(s).to(torch.bfloat16) for s in (8.0, 0.5))
    tok = torch.cat([torch.arange(n, device="cuda"), torch.randperm(n, device="cuda", generator=g)[:1000]])
    flat = torch.randperm(slots * max_len, device="cuda", generator=g)[:tok.numel()]  # distinct entries
    entry = (flat // max_len, flat % max_len)
    for fp8 in (False, True):
        ref = KVCache.allocate(1, slots, max_len, hkv, hd, "cuda", torch.bfloat16, fp8=fp8)
        ref.put(0, entry, k.index_select(0, tok), v.index_select(0, tok))
        got = KVCache.allocate(1, slots, max_len, hkv, hd, "cuda", torch.bfloat16, fp8=fp8)
        kv_write(k, v, tok, *entry, **got.layer(0))
        pairs = [(got.k, ref.k), (got.v, ref.v)] + ([(got.k_scale, ref.k_scale), (got.v_scale, ref.v_scale)]
                                                    if fp8 else [])
        for a, b in pairs:
            assert torch.equal(a.view(torch.uint8) if fp8 and a.element_size() == 1 else a,
                               b.view(torch.uint8) if fp8 and b.element_size() == 1 else b), fp8


def test_prefill_attention_bf16_matches_fp32():
    """Packed causal prefill of documents of very different lengths (one of a single token)."""
    from rlhf_mcore.rollout.native.attention import PackedLayout, prefill_attention

    g = torch.Generator(device="cuda").manual_seed(2)
    lengths = [5, 130, 77, 1, 256]
    layout = PackedLayout(lengths, "cuda")
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, 64, device="cuda", generator=g, dtype=torch.bfloat16) for h in (14, 2, 2))
    out = prefill_attention(q, k, v, layout, 64 ** -0.5)
    ref = prefill_attention(q.float(), k.float(), v.float(), layout, 64 ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert rel_err(out, ref) <= 1e-2


def test_fused_sampler_matches_torch_sampler():
    """bf16 logits over Qwen2.5's vocabulary, a quarter of the rows greedy: the same tokens, the same log-probs."""
    from rlhf_mcore.rollout.native.sampling import sample_torch
    from rlhf_mcore.rollout.native.triton_kernels import sample_fused

    g = torch.Generator(device="cuda").manual_seed(1)
    batch, vocab = 64, 151936
    logits = (3 * torch.randn(batch, vocab, device="cuda", generator=g)).to(torch.bfloat16)
    keys = torch.randint(0, 2**32, (batch,), device="cuda", generator=g)
    steps = torch.randint(0, 500, (batch,), device="cuda", generator=g)
    greedy = torch.arange(batch, device="cuda") % 4 == 0
    inv_t = torch.where(greedy, 1.0, 1 / 0.8).float()
    t_fused, lp_fused = sample_fused(logits, keys, steps, inv_t, greedy)
    t_ref, lp_ref = sample_torch(logits, keys, steps, inv_t, greedy)
    assert torch.equal(t_fused[greedy], t_ref[greedy]), "greedy rows must pick the argmax"
    same = t_fused == t_ref
    # the same draws and logits: only a draw within fp32 rounding of a boundary between two tokens' intervals (the
    # kernel's cumulative sums are fp32, the reference's fp64) may pick the neighbour
    assert same.sum().item() >= batch - 1, f"{(~same).sum().item()} of {batch} sampled tokens differ"
    torch.testing.assert_close(lp_fused[same], lp_ref[same], atol=1e-4, rtol=0)


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 40, (n,), generator=g)]


@pytest.fixture(scope="module")
def gpu_model_dirs(tiny_model_dir):
    return {a: tiny_model_dir(a, hidden=128, heads=4, kv_heads=2, vocab=1024) for a in ARCHS}


def hf_greedy(model, prompts) -> list[list[int]]:
    out = []
    for p in prompts:
        with torch.inference_mode():
            o = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW_TOKENS,
                               min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(o[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_fp32_equals_transformers(gpu_model_dirs, arch):
    """fp32: every engine variant decodes greedily exactly as transformers; sampled log-probs equal teacher
    forcing; seeded samples do not depend on the batch; sleep(2) frees memory and wake restores the engine."""
    from transformers import AutoModelForCausalLM

    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    model_dir = gpu_model_dirs[arch]
    prompts = make_prompts(8, 900)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    ref = hf_greedy(hf, prompts)
    greedy = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, stop_token_ids=())
    for name, cfg in VARIANTS.items():
        engine = NativeRolloutEngine(model_dir, dtype=torch.float32, max_num_seqs=4, max_model_len=128, **cfg)
        out = [o.samples[0].token_ids for o in engine.generate(prompts, greedy)]
        engine.shutdown()
        assert out == ref, f"{name}: greedy tokens differ from transformers"

    engine = NativeRolloutEngine(model_dir, dtype=torch.float32, max_num_seqs=4, max_model_len=128)
    sampled = engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=16, n=2, seed=5))
    for p, o in zip(prompts, sampled):
        for s in o.samples:
            with torch.inference_mode():
                logits = hf(torch.tensor([p + s.token_ids], device="cuda")).logits[0, len(p) - 1:-1].float()
            lp = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(s.token_ids, device="cuda")[:, None])
            torch.testing.assert_close(torch.tensor(s.logprobs), lp.squeeze(-1).cpu(), atol=1e-4, rtol=0)
    del hf

    seeded = SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=9)
    small_batches = engine.generate(prompts, seeded)
    engine.shutdown()
    engine = NativeRolloutEngine(model_dir, dtype=torch.float32, max_num_seqs=16, max_model_len=128)
    one_batch = engine.generate(prompts, seeded)
    assert [[s.token_ids for s in o.samples] for o in small_batches] == \
        [[s.token_ids for s in o.samples] for o in one_batch], "seeded samples depend on the batching"

    before = torch.cuda.memory_allocated()
    freed = engine.sleep(2)
    dropped = before - torch.cuda.memory_allocated()
    assert freed > 0 and dropped > 0, f"sleep(2) reported {freed} bytes freed, allocated memory fell by {dropped}"
    engine.wake()
    again = engine.generate(prompts, seeded)
    engine.shutdown()
    assert [[s.token_ids for s in o.samples] for o in again] == \
        [[s.token_ids for s in o.samples] for o in one_batch], "sleep/wake changed the samples"


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_bf16_graphs_equal_eager_and_track_transformers(gpu_model_dirs, arch):
    """bf16: CUDA-graph replay is bit-identical to eager execution, and greedy decoding stays close to
    transformers in bf16 (rounding may flip a near-tie, after which the continuations differ)."""
    from transformers import AutoModelForCausalLM

    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    model_dir = gpu_model_dirs[arch]
    prompts = make_prompts(8, 900)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ref = hf_greedy(hf, prompts)
    del hf
    greedy = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, stop_token_ids=())
    outs = {}
    for name, cfg in VARIANTS.items():
        engine = NativeRolloutEngine(model_dir, dtype=torch.bfloat16, max_num_seqs=4, max_model_len=128, **cfg)
        outs[name] = [o.samples[0].token_ids for o in engine.generate(prompts, greedy)]
        engine.shutdown()
    assert outs["graphs_triton"] == outs["eager_triton"], "CUDA-graph replay differs from eager execution"
    for name, out in outs.items():
        first_agree = sum(a[0] == b[0] for a, b in zip(out, ref))
        assert first_agree >= len(prompts) - 1, f"{name}: first greedy token differs from transformers' " \
                                                f"in {len(prompts) - first_agree} of {len(prompts)} prompts"
        agree = sum(x == y for a, b in zip(out, ref) for x, y in zip(a, b)) / (NEW_TOKENS * len(prompts))
        assert agree >= 0.5, f"{name}: only {agree:.0%} of greedy tokens agree with transformers in bf16"


def test_programmatic_dependent_launch_changes_no_bit(gpu_model_dirs, monkeypatch):
    """The decode kernels with programmatic dependent launch (the default on Hopper) against the same engine with it
    off (`RLHF_MCORE_DECODE_PDL=0`): bf16, CUDA graphs, 64 rows sampled with a seed;
    tokens and log-probs bit for bit. PDL only moves when a kernel's programs start, never what they compute: a
    mismatch is a race (a kernel reading its predecessor's output before `gdc_wait`). Mutation: moving
    `_pdl_wait` in `_add_rms_norm_kernel` below its loads and stores fails it (the residual races)."""
    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native import triton_kernels
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability >= 9 (Hopper)")
    prompts = make_prompts(64, 900)
    params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=3, stop_token_ids=())
    outs = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("RLHF_MCORE_DECODE_PDL", pdl)
        assert triton_kernels.pdl_enabled() == (pdl == "1")
        engine = NativeRolloutEngine(gpu_model_dirs["qwen2"], dtype=torch.bfloat16, max_num_seqs=64,
                                     max_model_len=128)
        outs[pdl] = [(o.samples[0].token_ids, o.samples[0].logprobs) for o in engine.generate(prompts, params)]
        engine.shutdown()
    assert outs["1"] == outs["0"], "programmatic dependent launch changed the samples"


def test_decode_graphs_use_pdl_by_batch_size(gpu_model_dirs, monkeypatch):
    """The engine captures a decode batch's graph inside `pdl_for_batch(its padded rows)`: with PDL_OFF_ROWS set to
    (2, 4) here, the graph of 1 row is captured with programmatic dependent launch and the graph of 3 rows (padded to
    4) without; the samples are the same either way (the test above). Mutation: `_launch` without `self._pdl_scope`
    (every batch on) -> fails."""
    from contextlib import contextmanager

    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native import triton_kernels
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability >= 9 (Hopper)")
    monkeypatch.delenv("RLHF_MCORE_DECODE_PDL", raising=False)
    monkeypatch.setattr(triton_kernels, "PDL_OFF_ROWS", (2, 4))
    seen, real = [], triton_kernels.pdl_for_batch
    launches = []
    real_launch = triton_kernels._launch

    @contextmanager
    def recorded(rows):
        with real(rows):
            seen.append(rows)
            yield

    monkeypatch.setattr(triton_kernels, "pdl_for_batch", recorded)
    monkeypatch.setattr(triton_kernels, "_launch", lambda pdl: launches.append((seen[-1] if seen else 0, pdl))
                        or real_launch(pdl))
    engine = NativeRolloutEngine(gpu_model_dirs["qwen2"], dtype=torch.bfloat16, max_num_seqs=8, max_model_len=64)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3, stop_token_ids=())
    for n in (1, 3):
        seen.clear()
        launches.clear()
        engine.generate(make_prompts(n, 900), params)
        bucket = 1 if n == 1 else 4
        assert seen and set(seen) == {bucket}, seen
        decode = [pdl for rows, pdl in launches if rows == bucket]
        assert decode and all(pdl == (bucket == 1) for pdl in decode), (n, decode)
    engine.shutdown()


def test_shared_prompt_reads_change_no_bit_on_the_gpu(gpu_model_dirs, monkeypatch):
    """GRPO's layout on the GPU (bf16, CUDA graphs, Triton attention): 16 prompts x 8 samples through 64 slots, the
    rows of one prefilled prompt reading it from one slot (`engine.SHARE_PROMPT_READS`, the default) against every
    row reading its own copy: tokens and log-probs bit for bit (the copies hold the same values; a mismatch is a row
    reading a slot that no longer holds its prompt). The interpreter test (`_shared_prompt_reads_check`) has the
    mutations."""
    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native import engine as eng_mod

    prompts = make_prompts(16, 900)
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=40, seed=5, stop_token_ids=(7, 11, 13))
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(eng_mod, "SHARE_PROMPT_READS", on)
        engine = eng_mod.NativeRolloutEngine(gpu_model_dirs["qwen2"], dtype=torch.bfloat16, max_num_seqs=64,
                                             max_model_len=128)
        outs[on] = [[(s.token_ids, s.logprobs) for s in o.samples] for o in engine.generate(prompts, params)]
        engine.shutdown()
    assert outs[True] == outs[False], "reading a group's prompt from one slot changed the samples"


@pytest.mark.parametrize("steps_a_launch", [1, 4])
def test_decode_step_in_flight_on_cuda(gpu_model_dirs, steps_a_launch):
    """The engine's CUDA path of one decode launch in flight (page-locked double buffers, events, finished rows' tokens
    copied back behind the next launch): bf16, CUDA graphs of one and of four decode steps a launch
    (`decode_steps_per_launch`), rows reaching their caps at different steps, then rows stopping early. Every
    request comes back once; capped rows with exactly their cap; with a stop id, each sample either ends at its
    first stop id ("stop") or runs to the cap without one ("length"); decode steps = the longest cap - 1 when every
    row runs to its cap. (Structure only: bf16 tokens may differ between batch sizes.) Reading a host copy before
    its event (a race) returns stale flags or tokens: wrong lengths, a stop id inside a response, or a request
    missing."""
    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    engine = NativeRolloutEngine(gpu_model_dirs["qwen2"], dtype=torch.bfloat16, max_num_seqs=64, max_model_len=128,
                                 decode_steps_per_launch=steps_a_launch)
    prompts = make_prompts(16, 900)
    caps = [4 + 3 * (i % 8) for i in range(16)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=5, stop_token_ids=())
    capped = engine.generate(prompts, params, max_new_tokens=caps)
    assert [[len(s.token_ids) for s in o.samples] for o in capped] == [[c, c] for c in caps]
    assert all(s.finish_reason == "length" and len(s.logprobs) == len(s.token_ids) for o in capped for s in o.samples)
    full = engine.generate(prompts, params)
    assert engine.last_stats["decode_steps"] == 31
    stop = full[0].samples[0].token_ids[5]
    stopped = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=5,
                                                      stop_token_ids=(stop,)))
    assert len(stopped) == 16 and all(len(o.samples) == 2 for o in stopped)
    for s in (s for o in stopped for s in o.samples):
        assert len(s.logprobs) == len(s.token_ids) >= 1
        if s.finish_reason == "stop":
            assert s.token_ids[-1] == stop and stop not in s.token_ids[:-1]
        else:
            assert s.finish_reason == "length" and len(s.token_ids) == 32 and stop not in s.token_ids
    assert any(s.finish_reason == "stop" for o in stopped for s in o.samples)
    engine.shutdown()


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_weights_updated_while_awake_reach_the_captured_graphs(tiny_model_dir, quantization):
    """An engine that stays awake between weight syncs (`rollout.free_cache_engine=false`, and the asynchronous
    trainers' rollout pools) keeps its decode CUDA graphs: `update_weights` copies into the tensors the graphs
    were captured on, and with quantization=fp8 `finish_weight_update` requantizes the FP8 copies in place. The
    next generate replays the same graph objects (no capture) and samples, bit for bit, what an engine built from
    the new weights samples (bf16, seeded sampling, tokens and log-probs). Mutations (written in session 24, not
    yet run on a GPU): `update_weights` not marking the FP8 copies stale (the fp8 case samples from stale copies:
    `after == reference` fails); `sleep`'s `self.graphs.clear()` moved into `update_weights` (the graph objects
    differ)."""
    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine
    from rlhf_mcore.rollout.native.weights import iter_safetensors

    if quantization and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability >= 8.9 (Ada or Hopper)")
    shape = dict(hidden=128, heads=4, kv_heads=2, vocab=1024)
    old, new = tiny_model_dir("qwen2", **shape), tiny_model_dir("qwen2", seed=1, **shape)
    prompts = make_prompts(16, 1024, seed=4)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=7, stop_token_ids=())
    kw = dict(dtype=torch.bfloat16, max_num_seqs=32, max_model_len=128, quantization=quantization)

    def samples(outs):
        return [(s.token_ids, s.logprobs) for o in outs for s in o.samples]

    fresh = NativeRolloutEngine(new, **kw)
    reference = samples(fresh.generate(prompts, params))
    fresh.shutdown()
    engine = NativeRolloutEngine(old, **kw)
    before = samples(engine.generate(prompts, params))
    captured = dict(engine.graphs.graphs)
    assert captured and engine.last_stats["graph_captures"] == len(captured) > 0, "no decode graph was captured"
    named = list(iter_safetensors(new))
    engine.update_weights(named[: len(named) // 2])  # in buckets, as the weight sync sends them
    engine.update_weights(named[len(named) // 2:])
    engine.finish_weight_update()
    after = samples(engine.generate(prompts, params))
    replayed, captures = dict(engine.graphs.graphs), engine.last_stats["graph_captures"]
    engine.shutdown()
    assert after != before, "the new weights changed nothing: the test cannot tell stale weights from fresh ones"
    assert after == reference, "the awake engine's graphs sampled differently from an engine built on the new weights"
    assert captures == 0 and replayed.keys() == captured.keys() and \
        all(replayed[k] is g for k, g in captured.items()), "the weight update dropped or recaptured the decode graphs"
