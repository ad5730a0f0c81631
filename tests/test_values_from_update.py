"""The critic's old values from its update's own forward (Learner.values_from_update, critic.values_from_update): the
critic update's first mini-batch runs before any optimizer step, so its clipped loss takes its own values, detached,
as the old ones, and the values pass leaves its rows out. Exact where the returns do not read the values (GAE with
lam=1: the discounted rewards-to-go); the advantages, which do, are estimated again once the critic's update has
written its values back, before the actor's update. One process, fp32 on CPU, the real actor and critic engines of
a tiny Qwen2 model, one PPO (GAE) step on 4 responses, against the same step with the values pass on every row
(values_from_update=false): the same critic and actor weights, values, returns, advantages and metrics.
"""
import pytest
import torch

pytestmark = pytest.mark.cost(12)

B, R = 4, 6


@pytest.fixture(scope="module")
def env(cpu_state, tiny_model_dir):
    return cpu_state, tiny_model_dir(arch="qwen2", vocab=1000, layers=2, heads=4, kv_heads=2)


def learner(env, *extra):
    """A learner around a fresh actor and critic (the same weights and optimizer state every time) of a PPO run;
    the critic's `compute_values` calls record the rows each took in `learner.value_rows` (a row's token sum names
    it). A small `cliprange_value` makes the clipped loss read the old values (around zeros they would clip); the
    Adam eps of 1e-3 keeps the first step's `lr * g / (|g| + eps)` from turning fp32 noise in tiny
    gradients (the values pass's micro-batches against the update's) into lr-sized moves."""
    from rlhf_mcore.config import load_config
    from rlhf_mcore.trainer import roles
    from rlhf_mcore.trainer.learner import Learner

    state, model_dir = env
    cfg = load_config(None, [
        f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cpu", "algorithm.adv_estimator=gae",
        f"data.train_batch_size={B}", "actor_rollout_ref.rollout.n=1",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={B}", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.optim.eps=1e-3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.rollout.temperature=1", "critic.optim.lr=1e-2",
        "critic.optim.eps=1e-3", "critic.cliprange_value=0.002", "algorithm.gamma=0.9", *extra])
    out = Learner(cfg, state, roles.build_actor(cfg, state, total_steps=1),
                  critic=roles.build_critic(cfg, state, total_steps=1))
    out.value_rows = []
    compute = out.critic.compute_values

    def recorded(batch, *a, **kw):
        out.value_rows.append(batch["input_ids"].sum(-1).tolist())
        return compute(batch, *a, **kw)

    out.critic.compute_values = recorded
    return out


def ppo_batch() -> dict:
    """4 prompts x 1 response of random tokens (lengths 3-6), an outcome score on each last token and a small
    per-token one before it (so that gamma < 1 discounts something)."""
    from rlhf_mcore.data.batch import build_batch

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (4, 7, 5, 3)]
    responses = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (3, 6, 5, 4)]
    batch = build_batch(prompts, responses, [[-1.0] * len(r) for r in responses], ["stop"] * B, list(range(B)),
                        {}, pad_token_id=0)
    scores = torch.zeros(batch["response_mask"].shape)
    for i, (r, s) in enumerate(zip(responses, (1.0, 0.0, -1.0, 1.0))):
        scores[i, :len(r)] = 0.1 * (i + 1)
        scores[i, len(r) - 1] = s
    batch["token_level_scores"] = scores
    return batch


def step(learn) -> tuple[dict, dict, dict]:
    """One train_on: the step's metrics (the batch's and the learner's, timings out), the batch, both models'
    parameters."""
    from rlhf_mcore.trainer.hooks import PhaseTimer
    from rlhf_mcore.trainer.stats import batch_metrics

    batch = ppo_batch()
    metrics = learn.train_on(batch, PhaseTimer())
    metrics = {k: v for k, v in {**batch_metrics(batch), **metrics}.items() if not k.startswith("perf/")}
    params = {f"{role}.{n}": p.detach().clone() for role, e in (("actor", learn.actor), ("critic", learn.critic))
              for n, p in e.chunks[0].named_parameters()}
    return metrics, batch, params


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-6, atol=1e-6, msg=n)


SHUFFLED = ["actor_rollout_ref.actor.shuffle=true", "critic.megatron.seed=3"]  # the critic shuffles as the actor


@pytest.mark.parametrize("extra, share, passed", [
    ([], 1.0, []),
    (["critic.ppo_epochs=2"], 1.0, []),
    (["critic.ppo_mini_batch_size=2"], 0.5, [[2, 3]]),
    (["critic.ppo_mini_batch_size=2", "critic.ppo_epochs=2", *SHUFFLED], 0.5, None),
], ids=["one_step", "two_epochs", "two_mini_batches", "two_mini_batches_two_epochs_shuffled"])
def test_the_values_from_the_update_equal_the_pass(env, extra, share, passed):
    """The step with the critic's first mini-batch's values from its update equals the step after the values pass
    on every row: critic and actor weights, the batch's values, returns and advantages, the metrics (timings aside;
    `critic/values_from_update` says what share of the rows the update took); the pass took only the other rows
    (`passed`; None: those not in the engine's shuffled first mini-batch). Mutations (each run, each fails):
    critic_loss's old values the batch's under on_policy (zeros there, clipped around) -> every case fails on the
    critic's weights; Learner.update not estimating the advantages again after the critic's update -> fails on
    the advantages and the actor's weights; the write-back at `torch.arange(mini)` instead of `order[:mini]` ->
    the shuffled case fails; the values pass over every row (`skip_values` ignored) -> the rows check fails."""
    fast = learner(env, *extra)
    first = fast.critic.on_policy_rows(B).tolist()
    (m_fast, b_fast, p_fast) = step(fast)
    slow = learner(env, *extra, "critic.values_from_update=false")
    (m_slow, b_slow, p_slow) = step(slow)
    assert_same_params(p_fast, p_slow)
    for k in ("values", "returns", "advantages"):
        torch.testing.assert_close(b_fast[k], b_slow[k], rtol=1e-5, atol=1e-6, msg=k)
    assert m_fast.pop("critic/values_from_update") == share and m_slow.pop("critic/values_from_update") == 0.0
    assert m_fast.keys() == m_slow.keys()
    for k in m_fast:
        assert m_fast[k] == pytest.approx(m_slow[k], rel=1e-5, abs=1e-6), k
    assert m_fast["critic/vf_loss"] > 0 and m_fast["critic/grad_norm"] > 0 and m_fast["actor/grad_norm"] > 0
    assert m_fast["critic/vf_clipfrac"] > 0 or "critic.ppo_mini_batch_size=2" not in extra  # clipping was read
    rows = b_fast["input_ids"].sum(-1).tolist()  # the rows' names
    assert len(set(rows)) == B
    if passed is None:
        assert first != [0, 1] and len(first) == 2  # the shuffle chose other rows than the unshuffled first two
        passed = [[i for i in range(B) if i not in first]]
    assert fast.value_rows == [[rows[i] for i in p] for p in passed]
    assert slow.value_rows == [rows]
    untouched = learner(env)  # the critic did move: the comparison is not of two untouched models
    assert any(not torch.equal(p, p_fast[f"critic.{n}"]) for n, p in untouched.critic.chunks[0].named_parameters())


@pytest.mark.parametrize("extra", [["algorithm.lam=0.95"], ["critic.values_from_update=false"]], ids=["lam", "off"])
def test_returns_that_read_the_values_keep_the_pass(env, extra):
    """GAE with lam < 1: the returns (the critic's targets) read every row's values before the critic's update, so
    the values pass takes every row. Mutation: Learner.values_from_update without the estimator's
    `returns_free_of_values(lam)` -> the lam case fails."""
    learn = learner(env, *extra)
    assert not learn.values_from_update()
    metrics, batch, _ = step(learn)
    assert metrics["critic/values_from_update"] == 0.0
    assert learn.value_rows == [batch["input_ids"].sum(-1).tolist()]


def test_gae_returns_at_lam_one_do_not_read_the_values():
    """The fact the skip rests on, against a naive loop: GAE's returns at lam=1 are the discounted rewards-to-go
    over the valid tokens whatever the values (the advantages are not); at lam < 1 they are not. Mutation:
    `lam1_returns_free_of_values=False` in gae's registration -> the registry check fails."""
    from rlhf_mcore.algos.advantages import adv_estimator_info, compute_gae

    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(3, 7, generator=g)
    mask = torch.ones(3, 7)
    mask[0, 5:] = 0
    mask[1, 2] = 0  # an observation token inside the response: skipped, the chain goes on
    want = torch.zeros(3, 7)
    for b in range(3):
        acc = 0.0
        for t in reversed(range(7)):
            if mask[b, t]:
                acc = float(rewards[b, t]) + 0.9 * acc
                want[b, t] = acc
    for values in (torch.zeros(3, 7), torch.randn(3, 7, generator=g)):
        _, returns = compute_gae(token_level_rewards=rewards, response_mask=mask, values=values, gamma=0.9, lam=1.0)
        torch.testing.assert_close(returns, want, rtol=1e-5, atol=1e-5)
    v1, v2 = torch.zeros(3, 7), torch.randn(3, 7, generator=g)
    _, r1 = compute_gae(token_level_rewards=rewards, response_mask=mask, values=v1, gamma=0.9, lam=0.95)
    _, r2 = compute_gae(token_level_rewards=rewards, response_mask=mask, values=v2, gamma=0.9, lam=0.95)
    assert not torch.allclose(r1, r2)
    gae = adv_estimator_info("gae")
    assert gae.returns_free_of_values(1.0) and not gae.returns_free_of_values(0.95)
    assert not adv_estimator_info("grpo").returns_free_of_values(1.0)


def test_the_key_is_named_unused_where_the_values_pass_always_runs(capsys):
    """`critic.values_from_update` set where the values pass always takes every row (lam < 1) is named in the
    unused-keys notice with the reason; with lam=1 it is not. Mutation: the rule dropped from config.unused._RULES
    -> fails."""
    from rlhf_mcore.config import load_config

    key = "critic.values_from_update=false"
    base = ["actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=gae", key]
    load_config(None, [*base, "algorithm.lam=0.95"])
    err = capsys.readouterr().err
    assert "critic.values_from_update" in err and "algorithm.lam=0.95 < 1" in err, err
    load_config(None, base)
    assert "values_from_update" not in capsys.readouterr().err
