"""The train engine's decoder as CUDA graphs (rlhf_mcore/engine/cuda_graphs.py).

CPU: the static-shape padding the graphs need (token ladder, dummy documents no longer than the static
`max_seqlen`, zero-length documents) leaves every log-prob unchanged; where graphs cannot run, an explicit
`cuda_graphs=true` is refused with the reason. GPU: graphed log-probs and updates equal eager ones on the same
shapes, a second update captures nothing new, and an offload drops the graphs (recaptured, same results)."""
from __future__ import annotations

import types

import pytest
import torch

from rlhf_mcore.engine import cuda_graphs
from rlhf_mcore.engine.cuda_graphs import fits, graphs_supported, seqlen_bucket, static_shape, token_bucket
from rlhf_mcore.engine.packing import build_model_inputs

CUDA = torch.cuda.is_available()


def test_token_ladder_pads_at_most_an_eighth():
    for n in list(range(1, 3000)) + [4096, 4097, 6000, 16384, 16385, 100_000]:
        b = token_bucket(n)
        assert b >= n and b % 128 == 0
        assert b <= max(128 * -(-n // 128), n * 9 // 8 + 1), n
    assert token_bucket(4096) == 4096 and token_bucket(4097) == 4608 and token_bucket(1000) == 1024
    assert len({token_bucket(n) for n in range(2048, 4097)}) == 8 + 1  # eight steps an octave (and 4096 itself)


def test_static_shape_sizes_max_seqlen_by_the_longest_document():
    """max_seqlen: the longest document on powers of two (at least 128, at most the tokens), not the packed length
    (Flash Attention launches ceil(max_seqlen / 128) blocks per document and head). The document count holds each
    micro-batch's documents plus the dummies its padding takes at that length, rounded up to 8.

    Mutations: max_seqlen = the tokens again -> the first and third asserts fail; one dummy whatever the padding
    -> the (1024, 16, 256) case gives 8, and `fits` admits a shape its padding overflows."""
    assert seqlen_bucket(349, 16384) == 512 and seqlen_bucket(512, 16384) == 512 and seqlen_bucket(3, 16384) == 128
    assert seqlen_bucket(3000, 2048) == 2048
    assert static_shape([15900] * 11, [47] * 11, 349) == (16384, 48, 512)  # TRL's GRPO workload's micro-batches
    assert static_shape([4096, 3000, 4000], [4, 3, 4], 2000) == (4096, 8, 2048)
    assert static_shape([100], [7], 50) == (128, 8, 128) and static_shape([100], [8], 50) == (128, 16, 128)
    assert static_shape([600, 1000], [2, 6], 250) == (1024, 8, 256)  # 424 padding tokens: two dummies of <= 256
    assert static_shape([500, 1000], [6, 6], 250) == (1024, 16, 256)  # 6 documents + 3 dummies: 9 -> 16
    assert fits((1024, 8, 256), [600, 1000], [3, 6], 250) and not fits((1024, 8, 256), [500, 1000], [6, 6], 250)
    assert not fits((1024, 8, 256), [600], [2], 300)  # a document longer than max_seqlen
    assert not fits((1024, 8, 256), [1100], [2], 200)  # more tokens than the shape


def test_static_padding_adds_empty_documents_and_keeps_the_map():
    ids = torch.arange(100, 121).view(3, 7)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0, 0]])
    plain = build_model_inputs(ids, mask, 3, packed=True)
    static = build_model_inputs(ids, mask, 3, packed=True, pad_to_length=128, pad_docs_to=8)
    p = static.packed_seq_params
    assert static.input_ids.shape == (1, 128)
    assert p.cu_seqlens_q.tolist() == [0, 5, 12, 14, 128, 128, 128, 128, 128]  # a dummy, then empty documents
    assert p.max_seqlen_q == p.max_seqlen_kv == 128
    assert getattr(p, cuda_graphs.STATIC_FLAG) and not hasattr(plain.packed_seq_params, cuda_graphs.STATIC_FLAG)
    assert torch.equal(static.rows, plain.rows) and torch.equal(static.labels, plain.labels)
    with pytest.raises(ValueError, match="do not fit a static shape of 2"):
        build_model_inputs(ids, mask, 3, packed=True, pad_to_length=128, pad_docs_to=2)
    # a static max_seqlen of 32: the 114 padding tokens become dummies of 32, 32, 32 and 18, positions restarting
    short = build_model_inputs(ids, mask, 3, packed=True, pad_to_length=128, pad_docs_to=8, static_max_seqlen=32)
    q = short.packed_seq_params
    assert q.cu_seqlens_q.tolist() == [0, 5, 12, 14, 46, 78, 110, 128, 128] and q.max_seqlen_q == q.max_seqlen_kv == 32
    assert short.position_ids[0, 14:].tolist() == [*range(32), *range(32), *range(32), *range(18)]
    assert torch.equal(short.rows, plain.rows) and torch.equal(short.labels, plain.labels)
    with pytest.raises(ValueError, match="do not fit a static shape of 6"):  # 3 documents + 4 dummies
        build_model_inputs(ids, mask, 3, packed=True, pad_to_length=128, pad_docs_to=6, static_max_seqlen=32)
    with pytest.raises(ValueError, match="a document of 7 tokens exceeds the static max_seqlen 6"):
        build_model_inputs(ids, mask, 3, packed=True, pad_to_length=128, pad_docs_to=64, static_max_seqlen=6)


def _state(device="cuda", tp=1, pp=1):
    return types.SimpleNamespace(device=torch.device(device), dims=types.SimpleNamespace(tp=tp, pp=pp))


def test_where_graphs_cannot_run_the_reason_is_given():
    cfg = types.SimpleNamespace(context_parallel_size=1, recompute_granularity=None, hidden_dropout=0.0,
                                attention_dropout=0.0)
    assert graphs_supported(cfg, _state(), 1, True) is None
    assert "cpu" in graphs_supported(cfg, _state("cpu"), 1, True)
    assert "packed" in graphs_supported(cfg, _state(), 1, False)
    assert "pipeline" in graphs_supported(cfg, _state(pp=2), 2, True)
    assert "TP" in graphs_supported(cfg, _state(tp=2), 1, True)
    assert "recompute" in graphs_supported(types.SimpleNamespace(**{**vars(cfg), "recompute_granularity": "full"}),
                                           _state(), 1, True)
    assert "dropout" in graphs_supported(types.SimpleNamespace(**{**vars(cfg), "hidden_dropout": 0.1}),
                                         _state(), 1, True)


def rl_batch(n: int, vocab: int, device, seed: int = 0) -> dict:
    """n sequences of the trainer's layout with varied prompt and response lengths (P = 12, R = 20)."""
    g = torch.Generator().manual_seed(seed)
    P, R = 12, 20
    ids = torch.randint(3, vocab, (n, P + R), generator=g)
    plen = torch.randint(1, P + 1, (n,), generator=g)
    rlen = torch.randint(1, R + 1, (n,), generator=g)
    cols = torch.arange(P + R)
    mask = ((cols[None] >= P - plen[:, None]) & (cols[None] < P + rlen[:, None])).long()
    return {k: v.to(device) for k, v in {
        "input_ids": ids * mask, "attention_mask": mask, "responses": ids[:, P:] * mask[:, P:],
        "response_mask": mask[:, P:], "old_log_probs": -6.9 + 0.1 * torch.randn(n, R, generator=g),
        "advantages": torch.randn(n, R, generator=g)}.items()}


def _engine(model_dir, state, graphs, dtype, static_eager=False):
    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine import EngineConfig, TrainEngine
    from rlhf_mcore.models import build_model

    chunks = build_model(model_dir, state, role="actor", dtype=dtype)
    engine = TrainEngine(chunks, state, EngineConfig(role="actor", micro_batch_size=4, mini_batch_size=8,
                                                     cuda_graphs=graphs), OptimConfig(lr=1e-3))
    if static_eager:  # the graphs' padded shapes, run eagerly
        engine._static_shape = lambda plan, seqlens, grad: static_shape(
            [sum(int(seqlens[i]) for i in rows) for rows in plan], [len(rows) for rows in plan],
            max(int(seqlens[i]) for rows in plan for i in rows))
    return engine


@pytest.mark.skipif(CUDA, reason="a CPU engine would hide the GPUs from this whole process; on a GPU machine "
                    "test_graphed_decoder_equals_eager_on_the_gpu compares the padded and natural shapes")
def test_static_padding_leaves_log_probs_and_updates_unchanged_on_cpu(tiny_model_dir, monkeypatch):
    """The static shapes (dummy documents no longer than the static max_seqlen of 32, empty documents) through the
    real model, fp32 on CPU: log-probs equal the natural shapes' within fp32 rounding of matmuls over more rows
    (2e-5 on values near -7; a wrong position, mask or document boundary moves them by 1e-2 or more), and so does
    an update. (The 128-token floor of max_seqlen is lowered to 16 so that these 32-token documents get a
    max_seqlen below the 128-token micro-batches, and the padding splits.) A log-prob pass under the caller's
    torch.inference_mode gives the plain one's log-probs bit for bit (the packed RoPE's table cache keyed by a
    version counter that inference tensors lack raised there).

    Mutation: the padding as one dummy document of every padding token (longer than max_seqlen) -> the RoPE table
    of max_seqlen rows is indexed past its end: an error."""
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    monkeypatch.setattr(cuda_graphs, "MIN_MAX_SEQLEN", 16)
    model_dir = tiny_model_dir(arch="qwen2", vocab=1000, layers=2, heads=4, kv_heads=2)
    state = init_distributed(device="cpu")
    try:
        batch = rl_batch(16, 1000, "cpu")
        plain, padded = _engine(model_dir, state, None, torch.float32), _engine(model_dir, state, None, torch.float32,
                                                                                static_eager=True)
        lp_plain, ent_plain = plain.compute_log_probs(batch)
        with torch.inference_mode():  # a caller's inference mode: the same log-probs (it raised before session 41)
            assert torch.equal(plain.compute_log_probs(batch)[0], lp_plain)
        lp_pad, ent_pad = padded.compute_log_probs(batch)
        torch.testing.assert_close(lp_pad, lp_plain, rtol=0, atol=2e-5)
        torch.testing.assert_close(ent_pad, ent_plain, rtol=0, atol=2e-5)
        m_plain, m_pad = plain.update_policy(batch), padded.update_policy(batch)
        assert abs(m_plain["actor/pg_loss"] - m_pad["actor/pg_loss"]) < 1e-5
        assert abs(m_plain["actor/grad_norm"] - m_pad["actor/grad_norm"]) < 1e-5 * m_plain["actor/grad_norm"]
        with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.megatron\.cuda_graphs=true.*cpu"):
            _engine(model_dir, state, True, torch.float32)
    finally:
        destroy_distributed()


@pytest.mark.skipif(not CUDA, reason="needs CUDA: CUDA graphs")
def test_graphed_decoder_equals_eager_on_the_gpu(tiny_model_dir, monkeypatch):
    """bf16 on the GPU: the graphed engine against an eager engine on the same padded shapes (the same kernels:
    log-probs within 1e-5, the update's loss and gradient norm within 1e-5 relative, parameters after it within
    bf16 rounding), and against the natural shapes within bf16 tolerance (0.05 in log-prob). A second update
    captures no new graph; an offload drops the graphs, the next call recaptures with the same results. The 128-token
    floor of the static max_seqlen is lowered to 16, so Flash Attention runs with a max_seqlen of 32 below the
    micro-batches' 128 tokens and the padding split into dummy documents of at most 32."""
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    monkeypatch.setattr(cuda_graphs, "MIN_MAX_SEQLEN", 16)
    model_dir = tiny_model_dir(arch="qwen2", vocab=1000, layers=2, heads=4, kv_heads=2)
    state = init_distributed(device="cuda")
    try:
        batch = rl_batch(16, 1000, "cuda")
        graphed = _engine(model_dir, state, True, torch.bfloat16)
        eager = _engine(model_dir, state, False, torch.bfloat16, static_eager=True)
        natural = _engine(model_dir, state, False, torch.bfloat16)
        assert len(graphed._graphs) == 1 and not eager._graphs
        lp_g, ent_g = graphed.compute_log_probs(batch)
        lp_e, ent_e = eager.compute_log_probs(batch)
        lp_n, _ = natural.compute_log_probs(batch)
        assert graphed.graph_captures == 1  # the forward-only graph
        assert [key[2] for key in graphed._graphs[0]._graphs] == [32]  # (tokens, cu entries, max_seqlen, grad)
        torch.testing.assert_close(lp_g, lp_e, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent_g, ent_e, rtol=0, atol=1e-5)
        assert (lp_g - lp_n).abs().max() < 0.05
        m_g, m_e = graphed.update_policy(batch), eager.update_policy(batch)
        assert m_g["perf/actor/cuda_graph_captures"] == 1  # the training graph, one shape for both mini-batches
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert abs(m_g[key] - m_e[key]) <= 1e-5 * max(1.0, abs(m_e[key])), key
        for (name, p_g), p_e in zip(graphed.chunks[0].named_parameters(), eager.chunks[0].parameters()):
            torch.testing.assert_close(p_g.float(), p_e.float(), rtol=0, atol=2e-2, msg=name)
        m_g2 = graphed.update_policy(batch)
        assert m_g2["perf/actor/cuda_graph_captures"] == 0
        after_g, _ = graphed.compute_log_probs(batch)
        graphed.offload()
        assert len(graphed._graphs[0]) == 0
        graphed.onload()
        again, _ = graphed.compute_log_probs(batch)
        assert graphed.graph_captures == 3
        torch.testing.assert_close(again, after_g, rtol=0, atol=1e-5)
        assert torch.isfinite(again).all() and not torch.equal(after_g, lp_g)  # the updates changed the policy
    finally:
        destroy_distributed()


def test_unset_graphs_only_take_host_bound_micro_batches():
    """`cuda_graphs` unset: micro-batches above AUTO_MAX_TOKENS run eagerly (no capture); `true` graphs them all."""
    from rlhf_mcore.engine import TrainEngine
    from rlhf_mcore.engine.cuda_graphs import AUTO_MAX_TOKENS

    def shape(graphs, lengths):
        fake = types.SimpleNamespace(_graphs=[types.SimpleNamespace(reuse=lambda shape, *a: shape, failed=None)],
                                     cfg=types.SimpleNamespace(cuda_graphs=graphs))
        return TrainEngine._static_shape(fake, [[i] for i in range(len(lengths))], lengths, grad=True)

    assert shape(None, [1024, AUTO_MAX_TOKENS]) == (AUTO_MAX_TOKENS, 8, AUTO_MAX_TOKENS)
    assert shape(None, [1024, AUTO_MAX_TOKENS + 1]) is None
    big = token_bucket(AUTO_MAX_TOKENS + 1)
    assert shape(True, [1024, AUTO_MAX_TOKENS + 1]) == (big, 8, big)
    assert shape(True, [1024, 300, 2000]) == (2048, 8, 2048)  # one document a micro-batch: the longest sets it
    assert TrainEngine._static_shape(types.SimpleNamespace(_graphs=[]), [[0]], [5], grad=True) is None
    failed = types.SimpleNamespace(_graphs=[types.SimpleNamespace(failed="RuntimeError: ...")])
    assert TrainEngine._static_shape(failed, [[0]], [5], grad=True) is None  # a failed capture: eager, unpadded


def test_a_captured_graph_serves_slightly_smaller_shapes():
    """A call reuses the smallest captured graph of its grad mode that holds its tokens (at most a quarter more), its
    longest document (the graph's max_seqlen) and its documents with the dummies their padding takes, instead of
    capturing another.

    Mutation: reuse ignoring the graph's max_seqlen -> the 700-token document case takes the 512 graph."""
    from rlhf_mcore.engine.cuda_graphs import DecoderGraphs

    graphs = DecoderGraphs(types.SimpleNamespace(decoder=torch.nn.Linear(2, 2)))
    for key in ((1024, 9, 512, True), (1280, 17, 512, True), (2048, 9, 1024, True), (1024, 9, 512, False)):
        graphs._graphs[key] = object()  # (tokens, cu_seqlens entries, max_seqlen, grad): what the dispatcher caches
    assert graphs.reuse((896, 8, 512), True, [896], [7], 400) == (1024, 8, 512)  # 1024 <= 1.25 x 896
    assert graphs.reuse((768, 8, 512), True, [768], [7], 400) == (768, 8, 512)  # 1024 > 1.25 x 768: its own
    assert graphs.reuse((1024, 16, 512), True, [1024], [15], 400) == (1280, 16, 512)  # more documents
    assert graphs.reuse((1024, 8, 1024), True, [1000], [2], 700) == (1024, 8, 1024)  # longer than 512
    assert graphs.reuse((1792, 8, 1024), True, [1700], [4], 900) == (2048, 8, 1024)
    assert graphs.reuse((1152, 24, 512), True, [1152], [23], 400) == (1152, 24, 512)  # none holds 24 documents
    assert graphs.reuse((1152, 8, 512), False, [1100], [7], 400) == (1152, 8, 512)  # forward-only: its own set


@pytest.mark.skipif(CUDA, reason="a CPU model would hide the GPUs from this whole process; on a GPU machine "
                    "test_graphed_decoder_equals_eager_on_the_gpu runs the real graphs")
def test_dispatcher_caches_evicts_and_recaptures_on_cpu(tiny_model_dir, monkeypatch):
    """The dispatcher's bookkeeping with the capture replaced by the eager function (CPU has no CUDA graphs): only
    active, packed, static-shape calls are routed; one capture per (shape, grad mode); least recently used out at
    `max_graphs`; a parameter that moved (new storage) drops the graphs. The routed calls go through the same
    function the capture would record (parameter aliases through `functional_call`): outputs and gradients equal
    the eager decoder's."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from rlhf_mcore.engine import cuda_graphs
    from rlhf_mcore.models import build_model
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    captured = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "make_graphed_callables",
                        lambda fn, sample, **kw: captured.append(("train", sample[0].shape)) or fn)
    monkeypatch.setattr(cuda_graphs, "_forward_graph",
                        lambda call, sample, *a: captured.append(("forward", sample[0].shape)) or call)
    state = init_distributed(device="cpu")
    try:
        model = build_model(tiny_model_dir(arch="qwen2", vocab=1000, layers=2, heads=4, kv_heads=2), state,
                            dtype=torch.float32)[0]
        graphs = cuda_graphs.DecoderGraphs(model, max_graphs=2)

        def run(lens, total, docs, active=True, grad=True, max_seqlen=None):
            ids = torch.randint(0, 1000, (1, total), generator=torch.Generator().manual_seed(total))
            pos = torch.cat([torch.arange(n) for n in lens] + [torch.arange(total - sum(lens))])[None]
            cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
            cu = torch.tensor(cu + [total] * (docs + 1 - len(cu)), dtype=torch.int32)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=max_seqlen or total, max_seqlen_kv=max_seqlen or total)
            setattr(params, cuda_graphs.STATIC_FLAG, True)  # as packing.build_model_inputs marks a static shape
            model.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(grad):
                if active:
                    with graphs.active():
                        out = model(ids, pos, None, packed_seq_params=params)
                else:
                    out = model(ids, pos, None, packed_seq_params=params)
                if grad:
                    out.square().mean().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            return out.detach(), grads

        eager_out, eager_grads = run([20, 30], 128, 8, active=False)
        assert captured == [] and len(graphs) == 0
        out, grads = run([20, 30], 128, 8)
        assert captured == [("train", (128, 1, model.config.hidden_size))]
        torch.testing.assert_close(out, eager_out, rtol=0, atol=1e-6)
        assert grads.keys() == eager_grads.keys() and len(grads) > 10  # DDP-free here: .grad of every parameter
        for n in grads:
            torch.testing.assert_close(grads[n], eager_grads[n], rtol=0, atol=1e-6, msg=n)
        run([20, 30], 128, 8)
        run([20, 30], 128, 8, grad=False)
        assert len(captured) == 2 and len(graphs) == 2  # one training and one forward-only graph
        run([40], 256, 8, grad=False)  # a third shape: the least recently used (training) graph goes
        assert len(captured) == 3 and len(graphs) == 2
        run([20, 30], 128, 8, grad=False)
        assert len(captured) == 3  # still cached
        unpacked = len(captured)
        with graphs.active():  # a call without the static-shape mark runs eagerly
            cu = torch.tensor([0, 20, 50], dtype=torch.int32)
            model(torch.zeros(1, 50, dtype=torch.long), torch.arange(50)[None], None,
                  packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                    max_seqlen_q=30, max_seqlen_kv=30))
        assert len(captured) == unpacked
        first = next(model.decoder.parameters())
        first.data = first.data.clone()  # the parameter moved: every graph is dropped and this one recaptured
        run([20, 30], 128, 8, grad=False)
        assert len(captured) == 4 and len(graphs) == 1
        run([20, 30], 128, 8, grad=False, max_seqlen=96)  # another static max_seqlen: another graph
        assert len(captured) == 5 and len(graphs) == 2
    finally:
        destroy_distributed()


@pytest.mark.skipif(CUDA, reason="a CPU model would hide the GPUs from this whole process; the capture path runs "
                    "for real in test_graphed_decoder_equals_eager_on_the_gpu")
def test_a_failed_capture_falls_back_to_eager_unless_graphs_are_required(tiny_model_dir, monkeypatch):
    """`cuda_graphs` unset: a capture that fails (an op this setup cannot capture) warns once, naming the key, and
    the run goes on eagerly with the same outputs; `true`: the failure is an error that names the key."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from rlhf_mcore.engine import cuda_graphs
    from rlhf_mcore.models import build_model
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    attempts = []

    def fail(*a, **k):
        attempts.append(1)
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fail)
    state = init_distributed(device="cpu")
    try:
        model = build_model(tiny_model_dir(arch="qwen2", vocab=1000, layers=2, heads=4, kv_heads=2), state,
                            dtype=torch.float32)[0]
        ids = torch.randint(0, 1000, (1, 128), generator=torch.Generator().manual_seed(0))
        pos = torch.cat([torch.arange(50), torch.arange(78)])[None]
        cu = torch.tensor([0, 50, 128, 128, 128, 128, 128, 128, 128], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=128,
                                 max_seqlen_kv=128)
        setattr(params, cuda_graphs.STATIC_FLAG, True)
        eager = model(ids, pos, None, packed_seq_params=params).detach()
        key = "actor_rollout_ref.actor.megatron.cuda_graphs"
        graphs = cuda_graphs.DecoderGraphs(model, key=key)
        with graphs.active(), pytest.warns(UserWarning, match=rf"{key} unset: capturing .* failed .*not permitted"):
            out = model(ids, pos, None, packed_seq_params=params)
        torch.testing.assert_close(out.detach(), eager, rtol=0, atol=1e-6)
        with graphs.active():
            model(ids, pos, None, packed_seq_params=params)
        assert len(attempts) == 1 and graphs.failed and len(graphs) == 0  # no second attempt
        model.decoder.forward = graphs._eager  # a fresh dispatcher that must have graphs
        required = cuda_graphs.DecoderGraphs(model, required=True, key=key)
        with required.active(), pytest.raises(RuntimeError, match=rf"{key}=true, but capturing .* failed"):
            model(ids, pos, None, packed_seq_params=params)
    finally:
        destroy_distributed()
