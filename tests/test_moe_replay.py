"""Routing replay (veRL's actor.router_replay.mode R2 / R3) through the real parts, in one process (fp32, CPU): the
native engine recording each token's routes, the rows and the batch carrying them (and the data bus's packing, the
fully asynchronous stream's pause and continue), the train engine replaying them in the old-log-prob, reference and
update passes, the learner's routing metrics.

The trainer's routing is perturbed so that every token's routes flip: each router's logits get +50 on the first
expert outside the token's own top-k (`flipped_routing`, tests/scripts/moe_check.py), which leaves the logits of the
experts the token routed to unchanged -- so with Qwen3-MoE's renormalised top-k a replayed pass computes exactly what
the unperturbed model does. tests/test_moe.py checks R3 the same way at EP=2 and PP=2 (its 2-process worker).
"""
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_rollout_native import make_prompts

from rlhf_mcore.algos import get_policy_loss, register_policy_loss

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from moe_check import flipped_routing  # noqa: E402  (the EP=2 / PP=2 replay check flips routing the same way)

pytestmark = pytest.mark.cost(15)

TINY = dict(arch="qwen3_moe", layers=3, hidden=32, heads=4, kv_heads=2, vocab=1000, experts=4, top_k=2,
            tie_word_embeddings=False)  # layer 0 dense, layers 1 and 2 MoE
ATOL = 1e-5
N_PROMPTS, N_SAMPLES, NEW_TOKENS = 3, 2, 6

CAPTURED: list = []  # the update's log-probs, per micro-batch (the policy loss below)


@register_policy_loss("replay_test_capture", override=True)
def capture_loss(old_log_prob, log_prob, *args, **kwargs):
    """The vanilla PPO loss; keeps the log-probs the update computed."""
    CAPTURED.append(log_prob.detach().clone())
    return get_policy_loss("vanilla")(old_log_prob, log_prob, *args, **kwargs)


@pytest.fixture(scope="module")
def env(tiny_model_dir):
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    if torch.cuda.is_available():  # as tests/test_lora.py's CPU engine
        pytest.skip("a CPU engine would hide the GPUs from this whole process (cpu_compat)")
    state = init_distributed(device="cpu")
    yield state, tiny_model_dir(**TINY)
    destroy_distributed()


def config(model_dir, mode: str):
    from rlhf_mcore.config import load_config

    return load_config(None, [
        f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cpu", "data.train_batch_size=3",
        f"actor_rollout_ref.rollout.n={N_SAMPLES}", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.optim.lr=0",
        "actor_rollout_ref.actor.policy_loss=replay_test_capture",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3", "actor_rollout_ref.rollout.temperature=1",
        f"actor_rollout_ref.actor.router_replay.mode={mode}"])


@pytest.fixture(scope="module")
def engine(env):
    from rlhf_mcore.rollout import build_rollout_engine

    _, model_dir = env
    return build_rollout_engine("native", model_dir, max_num_seqs=8, max_model_len=64, device="cpu",
                                record_routes=True)


@pytest.fixture(scope="module")
def rollout(env, engine):
    """A rollout of N_PROMPTS prompts (lengths 3-14) x N_SAMPLES samples as the trainer's padded batch, with routes."""
    from rlhf_mcore.data.batch import build_batch
    from rlhf_mcore.rollout import SamplingParams

    prompts = make_prompts(N_PROMPTS, seed=5, lengths=(3, 15))
    outs = engine.generate(prompts, SamplingParams(n=N_SAMPLES, temperature=1.0, max_new_tokens=NEW_TOKENS,
                                                   stop_token_ids=(), seed=3))
    samples = [(p, s) for p, o in zip(prompts, outs) for s in o.samples]
    batch = build_batch([p for p, _ in samples], [s.token_ids for _, s in samples], [s.logprobs for _, s in samples],
                        [s.finish_reason for _, s in samples], [i for i, o in enumerate(outs) for _ in o.samples], {},
                        pad_token_id=0, routes=[s.routes for _, s in samples])
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(0))
    return batch, samples


@pytest.fixture(scope="module")
def engines(env):
    """The actor and the reference of an R3 run (each pass's mode is switched per test through engine.cfg)."""
    from rlhf_mcore.trainer import roles

    state, model_dir = env
    cfg = config(model_dir, "R3")
    actor = roles.build_actor(cfg, state, total_steps=1)
    return cfg, actor, roles.build_reference(cfg, state, actor)


@contextmanager
def mode(engine, name: str, **cfg):
    """The engine's passes under routing-replay mode `name` (and other EngineConfig fields `cfg`)."""
    saved = engine.cfg
    engine.cfg = replace(saved, router_replay=name, **cfg)
    try:
        yield engine
    finally:
        engine.cfg = saved


def masked_gap(a, b, mask) -> float:
    return float(((a - b).abs() * mask).max())


def update_log_probs(actor, batch) -> torch.Tensor:
    """The log-probs of the actor's update pass (lr 0: the weights do not move), as (B, R)."""
    CAPTURED.clear()
    actor.update_policy(batch)
    return torch.cat(CAPTURED)  # (b, R) per micro-batch, in row order (no shuffle, one epoch, one mini-batch)


def test_rollout_routes_are_the_trainers_own_on_the_same_weights(env, engines, rollout):
    """Unperturbed, the trainer's routers pick the rollout's experts for every token it fed (prompt and response
    but the last) and its log-probs equal the rollout's within fp32 noise; the batch aligns each row's routes with
    its tokens (left-padded prompt, response) and fills the rest with experts 0..k-1."""
    from rlhf_mcore.trainer.learner import Learner

    cfg, actor, _ = engines
    batch, samples = rollout
    P = batch["prompts"].shape[1]
    for i, (p, s) in enumerate(samples):
        routes = batch["routed_experts"][i]  # (P + R, n, k)
        assert s.routes.shape == (len(p) + len(s.token_ids) - 1, 2, 2)
        assert torch.equal(routes[P - len(p):P + len(s.token_ids) - 1], s.routes)
        assert (routes[P + len(s.token_ids) - 1:] == torch.tensor([0, 1], dtype=routes.dtype)).all()
    with mode(actor, "disabled"):
        b = dict(batch)
        metrics = Learner(cfg, env[0], actor).forward_passes(b)
    mask = batch["response_mask"]
    assert masked_gap(b["old_log_probs"], batch["rollout_log_probs"], mask) < ATOL
    assert metrics["actor/moe_routing_mismatch/max"] == 0.0
    assert metrics["actor/moe_expert_load/max"] >= 1.0


def test_r3_replays_the_rollouts_routes_in_the_old_reference_and_update_passes(env, engines, rollout):
    """With every token's routes flipped in the trainer, R3's old-log-prob, reference and update passes give the
    rollout's log-probs within fp32 noise; the same passes without replay do not. The learner's metric sees every
    token flipped; padded micro-batches (use_remove_padding=false) replay as packed ones do. Mutations:
    routing_replay.routed without set_router_replay_action(REPLAY_FORWARD) -> fails; packing's router_index
    batch-major in the padded layout (vb * S + rank) -> fails; the packed router_index reversed -> fails."""
    from rlhf_mcore.trainer.learner import Learner

    cfg, actor, ref = engines
    batch, _ = rollout
    mask, want = batch["response_mask"], batch["rollout_log_probs"]
    with flipped_routing(actor, ref):
        b = dict(batch)
        metrics = Learner(cfg, env[0], actor, ref=ref).forward_passes(b)  # actor and ref: R3
        assert metrics["actor/moe_routing_mismatch/mean"] == 1.0  # the trainer's own routes: all flipped
        assert masked_gap(b["old_log_probs"], want, mask) < ATOL
        assert masked_gap(b["ref_log_prob"], want, mask) < ATOL
        assert masked_gap(update_log_probs(actor, b), want, mask) < ATOL
        with mode(actor, "R3", use_remove_padding=False):  # padded micro-batches: the routers' (S, B) order
            padded, _ = actor.compute_log_probs(batch)
        assert masked_gap(padded, want, mask) < ATOL
        with mode(actor, "disabled"), mode(ref, "disabled"):
            plain, _ = actor.compute_log_probs(batch)
            plain_ref, _ = ref.compute_log_probs(batch)
            plain_update = update_log_probs(actor, b)
    for got in (plain, plain_ref, plain_update):
        assert masked_gap(got, want, mask) > 1e-2


def test_r2_replays_the_old_log_prob_passs_routes_in_the_update(env, engines, rollout):
    """R2: the old-log-prob pass records the trainer's routes; with routing flipped after it, the update replaying
    them computes the old-log-prob pass's log-probs within fp32 noise, and without replay it does not (an update
    pass whose routes moved since the old policy's). Mutation: Learner.forward_passes not storing the recorded
    routes under old_routed_experts -> KeyError; engine.routes.replay_key returning None for R2's update -> fails."""
    from rlhf_mcore.engine.routes import OLD_ROUTES
    from rlhf_mcore.trainer.learner import Learner

    cfg, actor, _ = engines
    batch, _ = rollout
    r2 = replace(cfg, actor_rollout_ref=replace(cfg.actor_rollout_ref, actor=replace(
        cfg.actor_rollout_ref.actor, router_replay=replace(cfg.actor_rollout_ref.actor.router_replay, mode="R2"))))
    with mode(actor, "R2"):
        b = {k: v for k, v in batch.items() if k != "routed_experts"}  # R2 needs no rollout routes
        metrics = Learner(r2, env[0], actor).forward_passes(b)
        assert "actor/moe_routing_mismatch/mean" not in metrics  # nothing from the rollout to compare with
        old, mask = b["old_log_probs"], b["response_mask"]
        assert b[OLD_ROUTES].shape == batch["routed_experts"].shape
        with flipped_routing(actor):
            replayed = update_log_probs(actor, b)
            with mode(actor, "disabled"):
                plain = update_log_probs(actor, b)
    assert masked_gap(replayed, old, mask) < ATOL
    assert masked_gap(plain, old, mask) > 1e-2


def test_the_fully_async_stream_and_the_data_bus_carry_the_routes(env, engine, rollout):
    """The fully asynchronous rollout's stream (paused and continued mid-response, as at a weight sync) returns
    rows whose routes equal those of an uninterrupted generation; packed and unpacked as the data bus sends them,
    they become the batch's `routed_experts`. Mutation: sample_streams.SampleStream.step building its Row without
    routes -> fails."""
    from rlhf_mcore.data.batch import build_batch
    from rlhf_mcore.parallel.pools import pack, unpack
    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.trainer.sample_streams import SampleStream

    prompts = make_prompts(2, seed=9, lengths=(4, 12))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=NEW_TOKENS, stop_token_ids=(), seed=11)
    want = engine.generate(prompts, params, request_ids=[7, 8])
    stream = SampleStream(engine, params)
    engine.open_stream(params)
    try:
        for uid, p in zip((7, 8), prompts):
            stream.add(uid, {"input_ids": p}, None)
        rows = stream.step() + stream.step()  # prefill and a decode step
        stream.pause()  # every sample out of the engine with its tokens so far...
        stream.resume()  # ... and back in, continued (prefilled again over prompt + prefix)
        while engine.num_pending:
            rows += stream.step()
    finally:
        engine.close_stream()
    assert len(rows) == 4
    rows = unpack(pack(rows))  # what the data bus sends
    for uid, row in rows:
        s = want[uid - 7].samples[row.sample]
        assert row.response_ids == s.token_ids and torch.equal(row.routes, s.routes)
    batch = build_batch([r.prompt_ids for _, r in rows], [r.response_ids for _, r in rows],
                        [r.logprobs for _, r in rows], [r.finish_reason for _, r in rows], [0] * 4, {}, pad_token_id=0,
                        routes=[r.routes for _, r in rows])
    P = batch["prompts"].shape[1]
    for i, (_, r) in enumerate(rows):
        n = len(r.prompt_ids)
        assert torch.equal(batch["routed_experts"][i, P - n:P - n + r.routes.shape[0]], r.routes)
