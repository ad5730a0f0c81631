"""The output layer on the scored rows only (rlhf_mcore/engine/scored_rows.py): the train engine's log-probs,
entropy, values and updates equal those of the full output layer, packed and padded, while the layer computes only
the rows that predict response tokens; the FLOP count takes the rows it ran on; where rows cannot be selected
(sequence or context parallelism, no output layer, a reward model's last-token scores) nothing is wrapped."""
from __future__ import annotations

import types

import pytest
import torch

from rlhf_mcore.engine.flops import FlopShape, train_flops
from rlhf_mcore.engine.scored_rows import head_unsupported

CUDA = torch.cuda.is_available()


def _engines(model_dir, state, role: str, packed: bool, monkeypatch, dtype=torch.float32):
    """(rows-only engine, full-output engine) on the same weights, and the row counts the first one's output
    layer saw (one entry per call)."""
    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine import EngineConfig, TrainEngine
    from rlhf_mcore.models import build_model

    out = []
    for rows_only in (True, False):
        monkeypatch.setattr(TrainEngine, "SCORES_RESPONSE_ROWS", rows_only)
        chunks = build_model(model_dir, state, role=role, dtype=dtype)
        out.append(TrainEngine(chunks, state, EngineConfig(role=role, micro_batch_size=4, mini_batch_size=8,
                                                           use_remove_padding=packed), OptimConfig(lr=1e-3)))
    seen = []
    head = out[0]._heads[0]
    inner = head._forward
    head._forward = lambda hidden, *a, **k: seen.append(hidden.shape[0]) or inner(hidden, *a, **k)
    assert not out[1]._heads
    return out[0], out[1], seen


@pytest.mark.skipif(CUDA, reason="a CPU engine would hide the GPUs from this whole process")
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_rows_only_equals_the_full_output_layer(tiny_model_dir, monkeypatch, packed):
    """fp32 on CPU, against the full output layer on the same weights: the actor's log-probs and entropy within
    1e-5 (the same rows of the same GEMM, blocked differently), an update's loss and gradient norm within 1e-5
    relative, the parameters after it within 1e-5; the critic's values and update the same way. The output layer
    ran on exactly the response tokens of each micro-batch (8 sequences of up to 20 response tokens, never the
    whole micro-batch). The FLOPs the update reports count the output layer on those rows only.

    Mutations: the padded layout flattened without the (S, B) -> (B, S) transpose -> the padded case's log-probs
    differ; the micro-batch handed to the loss with its `rows` kept -> index errors (rows past the M outputs); the
    selection ignored (every row through the layer) -> the row count fails."""
    from test_train_cuda_graphs import rl_batch

    from rlhf_mcore.engine import train_engine
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    model_dir = tiny_model_dir(arch="qwen2", vocab=1000, layers=2, heads=4, kv_heads=2)
    state = init_distributed(device="cpu")
    try:
        batch = rl_batch(16, 1000, "cpu")
        responses = int(batch["response_mask"].sum())
        rows_only, full, seen = _engines(model_dir, state, "actor", packed, monkeypatch)
        assert rows_only._rows_only and not full._rows_only
        lp, ent = rows_only.compute_log_probs(batch)
        lp_full, ent_full = full.compute_log_probs(batch)
        torch.testing.assert_close(lp, lp_full, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent, ent_full, rtol=0, atol=1e-5)
        assert sum(seen) == responses and len(seen) == 4  # four micro-batches of 4 sequences
        tokens = int(batch["attention_mask"].sum())
        assert responses < 0.8 * tokens  # the prompts' rows were skipped

        counted = []
        real = train_engine.train_flops
        monkeypatch.setattr(train_engine, "train_flops", lambda shape, seqlens, head_rows=None: counted.append(
            (sum(seqlens), head_rows)) or real(shape, seqlens, head_rows))
        m, m_full = rows_only.update_policy(batch), full.update_policy(batch)
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert abs(m[key] - m_full[key]) <= 1e-5 * max(1.0, abs(m_full[key])), key
        for p, q in zip(rows_only.chunks[0].parameters(), full.chunks[0].parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
        assert [h is None for _, h in counted] == [False, False, True, True]  # 2 mini-batches each, rows-only first
        mine = counted[:2]
        assert sum(h for _, h in mine) == responses and sum(t for t, _ in mine) == tokens  # two mini-batches
        assert m["perf/actor/tflops_per_gpu"] > 0

        critic, critic_full, seen_c = _engines(model_dir, state, "critic", packed, monkeypatch)
        batch = {**batch, "values": torch.zeros_like(batch["advantages"]), "returns": torch.randn_like(
            batch["advantages"])}
        torch.testing.assert_close(critic.compute_values(batch), critic_full.compute_values(batch), rtol=0, atol=1e-5)
        assert sum(seen_c) == responses
        c, c_full = critic.update_critic(batch), critic_full.update_critic(batch)
        for key in ("critic/vf_loss", "critic/grad_norm"):
            assert abs(c[key] - c_full[key]) <= 1e-5 * max(1.0, abs(c_full[key])), key
    finally:
        destroy_distributed()


def test_flops_count_the_output_layer_on_the_rows_it_ran_on():
    shape = FlopShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16,
                      ffn_hidden_size=128, vocab_size=1000)
    full = train_flops(shape, [30, 50])
    assert train_flops(shape, [30, 50], None) == full
    assert full - train_flops(shape, [30, 50], 20) == pytest.approx(6 * 64 * 1000 * (80 - 20))


def test_where_rows_cannot_be_selected_the_reason_is_given():
    from megatron.core.models.gpt import GPTModel

    def chunk(**config):
        c = GPTModel.__new__(GPTModel)
        torch.nn.Module.__init__(c)
        c.post_process, c.output_layer = True, torch.nn.Linear(2, 2)
        c.config = types.SimpleNamespace(sequence_parallel=False, context_parallel_size=1, mtp_num_layers=None,
                                         **config)
        return c

    assert head_unsupported(chunk()) is None
    assert "sequence parallelism" in head_unsupported(_with(chunk(), sequence_parallel=True))
    assert "context parallelism" in head_unsupported(_with(chunk(), context_parallel_size=2))
    assert "multi-token" in head_unsupported(_with(chunk(), mtp_num_layers=1))
    other = types.SimpleNamespace(post_process=True, output_layer=torch.nn.Linear(2, 2), config=chunk().config)
    assert "only a plain GPTModel" in head_unsupported(other)


def _with(c, **config):
    for k, v in config.items():
        setattr(c.config, k, v)
    return c


@pytest.mark.skipif(CUDA, reason="a CPU engine would hide the GPUs from this whole process")
def test_a_reward_model_keeps_its_full_output(tiny_model_dir):
    """The reward engine scores the head's output at each sequence's last token, not at response rows: no rows
    are selected there."""
    from rlhf_mcore.engine import EngineConfig
    from rlhf_mcore.engine.reward_engine import RewardEngine
    from rlhf_mcore.models import build_model
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    state = init_distributed(device="cpu")
    try:
        chunks = build_model(tiny_model_dir(arch="qwen2", vocab=1000, layers=2, heads=4, kv_heads=2), state,
                             role="reward", dtype=torch.float32)
        assert RewardEngine(chunks, state, EngineConfig(role="reward"))._heads == []
    finally:
        destroy_distributed()


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the bf16 path with the fused log-prob kernel")
def test_rows_only_tracks_the_full_output_layer_on_the_gpu(tiny_model_dir, monkeypatch):
    """bf16 on the GPU (the fused Triton log-prob kernel's `rows=None` path, the graphed decoder where it applies):
    the rows-only engine against the full output layer on the same weights: log-probs within 2e-2 (bf16 logits of
    GEMMs blocked differently), the update's loss and gradient norm within 2%, the output layer on the response
    tokens only."""
    from test_train_cuda_graphs import rl_batch

    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    model_dir = tiny_model_dir(arch="qwen2", vocab=1000, layers=2, heads=4, kv_heads=2)
    state = init_distributed(device="cuda")
    try:
        batch = rl_batch(16, 1000, "cuda")
        rows_only, full, seen = _engines(model_dir, state, "actor", True, monkeypatch, dtype=torch.bfloat16)
        lp, _ = rows_only.compute_log_probs(batch)
        lp_full, _ = full.compute_log_probs(batch)
        assert (lp - lp_full).abs().max() < 2e-2
        assert sum(seen) == int(batch["response_mask"].sum())
        m, m_full = rows_only.update_policy(batch), full.update_policy(batch)
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert abs(m[key] - m_full[key]) <= 2e-2 * max(1.0, abs(m_full[key])), key
    finally:
        destroy_distributed()
