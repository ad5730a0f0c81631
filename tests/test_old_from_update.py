"""The old log-probs from the update's own forward (Learner.old_from_update, actor.old_log_prob_from_update): the
actor update's first mini-batch runs before any optimizer step, so its loss takes its own log-probs, detached, as the
old ones, and the old-log-prob pass leaves its rows out (no pass when the update is one optimizer step on the whole
batch). One process, fp32 on CPU, the real actor engine of a tiny Qwen2 model, one GRPO update of 2 prompts x 2
samples:
- with the skip the update equals the update after the pass: the same parameters (to fp32 rounding), loss and
  metrics (timings aside; `actor/old_log_prob_from_update` says what share of the rows the update took), the same
  old log-probs and entropy in the batch for the step's metrics, and the pass runs on the other rows only;
- the same with ppo_epochs=2 (no pass: the first epoch's one mini-batch is the whole batch) and with two
  mini-batches (the pass on the second's rows), shuffled or not;
- nothing that reads the old log-probs before the update loses them: KL in the reward, rollout correction,
  use_rollout_log_probs each keep the whole pass.
"""
import pytest
import torch

pytestmark = pytest.mark.cost(10)

B_PROMPTS, N, R = 2, 2, 6
RC = "algorithm.rollout_correction"


@pytest.fixture(scope="module")
def env(cpu_state, tiny_model_dir):
    return cpu_state, tiny_model_dir(arch="qwen2", vocab=1000, layers=2, heads=4, kv_heads=2)


def learner(env, *extra):
    """A learner around a fresh actor (the same weights and optimizer state every time) of a GRPO run; its
    `compute_log_probs` calls are counted in `learner.passes`, the rows each took in `learner.pass_rows`."""
    from rlhf_mcore.config import load_config
    from rlhf_mcore.trainer import roles
    from rlhf_mcore.trainer.learner import Learner

    state, model_dir = env
    cfg = load_config(None, [
        f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cpu", "algorithm.adv_estimator=grpo",
        f"data.train_batch_size={B_PROMPTS}", f"actor_rollout_ref.rollout.n={N}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={B_PROMPTS}", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.rollout.temperature=1", *extra])
    actor = roles.build_actor(cfg, state, total_steps=1)
    out = Learner(cfg, state, actor)
    out.passes, out.pass_rows = 0, []
    compute = actor.compute_log_probs

    def counted(batch, *a, **kw):
        out.passes += 1
        out.pass_rows.append(batch["input_ids"].sum(-1).tolist())  # each row's token sum names it
        return compute(batch, *a, **kw)

    actor.compute_log_probs = counted
    return out


def grpo_batch() -> dict:
    """2 prompts x 2 responses of random tokens (lengths 3-6), a 0/1 outcome score on each last token."""
    from rlhf_mcore.data.batch import build_batch

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (4, 7) for _ in range(N)]
    responses = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (3, 6, 5, 4)]
    batch = build_batch(prompts, responses, [[-1.0] * len(r) for r in responses], ["stop"] * 4,
                        [i // N for i in range(4)], {}, pad_token_id=0)
    scores = torch.zeros(batch["response_mask"].shape)
    for i, (r, s) in enumerate(zip(responses, (1.0, 0.0, 0.0, 1.0))):
        scores[i, len(r) - 1] = s
    batch["token_level_scores"] = scores
    return batch


def step(learn) -> tuple[dict, dict, dict]:
    """One train_on: the step's metrics (the batch's and the learner's, timings out), the batch, the parameters."""
    from rlhf_mcore.trainer.hooks import PhaseTimer
    from rlhf_mcore.trainer.stats import batch_metrics

    batch = grpo_batch()
    metrics = learn.train_on(batch, PhaseTimer())
    metrics = {k: v for k, v in {**batch_metrics(batch), **metrics}.items() if not k.startswith("perf/")}
    return metrics, batch, {n: p.detach().clone() for n, p in learn.actor.chunks[0].named_parameters()}


def reference(learn) -> tuple[dict, dict]:
    """The naive update: the old-log-prob pass first, then the update (the learner's own parts, no decision)."""
    batch = grpo_batch()
    learn.forward_passes(batch)
    learn.compute_advantages(batch)
    learn.update(batch)
    return batch, {n: p.detach().clone() for n, p in learn.actor.chunks[0].named_parameters()}


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-6, atol=1e-6, msg=n)


def test_the_skip_equals_the_pass_and_runs_no_pass(env):
    """One GRPO update on the whole batch: with the skip (the default) no old-log-prob pass runs, and parameters,
    loss, metrics and the batch's old log-probs / entropy equal those of the update after the pass
    (old_log_prob_from_update=false). Mutations: actor_loss's old log-probs not its own under on_policy (zeros)
    -> fails; `entropy` instead of `old_entropy` in ON_POLICY_KEYS and actor_loss (the entropy metric
    overwritten) -> fails; Learner.old_log_probs running the whole pass whatever `skip` says -> fails (the count)."""
    skip, keep = learner(env), learner(env, "actor_rollout_ref.actor.old_log_prob_from_update=false")
    (m_skip, b_skip, p_skip), (m_keep, b_keep, p_keep) = step(skip), step(keep)
    assert (skip.passes, keep.passes) == (0, 1)
    assert m_skip.pop("actor/old_log_prob_from_update") == 1.0 and m_keep.pop("actor/old_log_prob_from_update") == 0.0
    assert m_skip.keys() == m_keep.keys()
    for k in m_skip:
        assert m_skip[k] == pytest.approx(m_keep[k], rel=1e-5, abs=1e-6), k
    assert m_skip["actor/pg_loss"] != 0 and m_skip["actor/grad_norm"] > 0 and "rollout/k3_kl" in m_skip
    for k in ("old_log_probs", "old_entropy"):
        torch.testing.assert_close(b_skip[k], b_keep[k], rtol=1e-6, atol=1e-6)
    assert_same_params(p_skip, p_keep)
    start = learner(env)  # the weights did move: the comparison is not of two untouched models
    assert any(not torch.equal(p, p_skip[n]) for n, p in start.actor.chunks[0].named_parameters())


def test_the_shuffled_update_writes_back_in_row_order(env):
    """actor.shuffle=true permutes the one mini-batch's rows; the old log-probs written back are still each row's
    own, those of the pass. Mutation: TrainEngine.update's write-back at `torch.arange(mini)` instead of
    `order[:mini]` (the mini-batch's order as is) -> fails."""
    shuffled = ("actor_rollout_ref.actor.shuffle=true", "actor_rollout_ref.actor.megatron.seed=1")  # 42: identity
    skip = learner(env, *shuffled)
    keep = learner(env, *shuffled, "actor_rollout_ref.actor.old_log_prob_from_update=false")
    assert not torch.equal(skip.actor._epoch_order(4, 0), torch.arange(4))  # the step's rows will be permuted
    (_, b_skip, p_skip), (_, b_keep, p_keep) = step(skip), step(keep)
    assert skip.passes == 0
    torch.testing.assert_close(b_skip["old_log_probs"], b_keep["old_log_probs"], rtol=1e-6, atol=1e-6)
    assert_same_params(p_skip, p_keep)


SHUFFLED = ["actor_rollout_ref.actor.shuffle=true", "actor_rollout_ref.actor.megatron.seed=3"]


@pytest.mark.parametrize("extra, share, passed", [
    (["actor_rollout_ref.actor.ppo_epochs=2"], 1.0, []),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=1"], 0.5, [[2, 3]]),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=1", *SHUFFLED], 0.5, None),
], ids=["two_epochs", "two_mini_batches", "two_mini_batches_shuffled"])
def test_more_than_one_step_takes_the_first_mini_batch_from_the_update(env, extra, share, passed):
    """ppo_epochs=2, or two mini-batches: the first mini-batch's old log-probs come from the update, the pass takes
    the other rows (none with two epochs of one mini-batch), and the update equals the naive pass + update --
    weights, and the old log-probs and entropy the batch carries. `passed`: the rows the pass took (None: those not
    in the engine's shuffled first mini-batch). Mutations: the first-mini-batch test in TrainEngine.update without
    `epoch == 0` -> two_epochs fails on the weights (the second epoch's ratio is 1 against its own policy); the
    update's own grids not written back into its `batch` (only the caller's) -> two_epochs fails (the second epoch
    reads zeros as the old log-probs); the write-back at `torch.arange(mini)` instead of `order[:mini]` ->
    two_mini_batches_shuffled fails; Learner.old_log_probs_but passing every row -> the rows check fails."""
    learn = learner(env, *extra)
    first = learn.actor.on_policy_rows(B_PROMPTS * N).tolist()
    metrics, batch, params = step(learn)
    want_batch, want = reference(learner(env, *extra))
    assert_same_params(params, want)  # first: a wrong old policy shows here, in the weights
    for k in ("old_log_probs", "old_entropy"):
        torch.testing.assert_close(batch[k], want_batch[k], rtol=1e-5, atol=1e-6, msg=k)
    assert metrics["actor/old_log_prob_from_update"] == share
    assert metrics["actor/num_optimizer_steps"] == 2.0
    rows = batch["input_ids"].sum(-1).tolist()  # the rows' names (see learner)
    assert len(set(rows)) == 4
    if passed is None:
        assert first != [0, 1] and len(first) == 2  # the shuffle chose other rows than the unshuffled first two
        passed = [[i for i in range(4) if i not in first]]
    assert learn.pass_rows == [[rows[i] for i in p] for p in passed]


@pytest.mark.parametrize("extra", [
    ["algorithm.use_kl_in_reward=true"],  # the advantages read old - ref
    [f"{RC}.rollout_is=token"],  # IS weights from old vs rollout, before the update
    [f"{RC}.rollout_rs=token", f"{RC}.rollout_rs_threshold=2.0"],  # the rejection mask shapes the loss's tokens
    [f"{RC}.rollout_token_veto_threshold=1e-4"],
    ["actor_rollout_ref.actor.use_rollout_log_probs=true"],  # no pass to skip: the rollout's are the old ones
    ["actor_rollout_ref.actor.old_log_prob_from_update=false"],
], ids=["kl_in_reward", "rollout_is", "rollout_rs", "token_veto", "rollout_log_probs", "off"])
def test_what_reads_the_old_log_probs_before_the_update_keeps_the_pass(env, extra):
    """Each of these needs the old log-probs before the update (or has none to compute): the skip is not taken.
    Mutations: Learner.old_from_update without `not alg.use_kl_in_reward` -> kl_in_reward fails; without
    `not _corrects(...)` -> the three rollout-correction cases fail."""
    learn = learner(env, *extra)
    assert not learn.old_from_update(grpo_batch())




def test_the_key_is_named_unused_where_the_pass_always_runs(capsys):
    """`actor.old_log_prob_from_update` set where the pass always takes every row (KL in the reward, rollout
    correction, use_rollout_log_probs) is named in the unused-keys notice with the reason; where the key decides
    (ppo_epochs=2 among them) it is not. Mutation: the rule dropped from config.unused._RULES -> fails."""
    from rlhf_mcore.config import load_config

    key = "actor_rollout_ref.actor.old_log_prob_from_update=false"
    for extra, why in ((["algorithm.use_kl_in_reward=true"], "use_kl_in_reward=true: the advantages read"),
                       ([f"{RC}.rollout_is=token"], "rollout_correction is on"),
                       (["actor_rollout_ref.actor.use_rollout_log_probs=true"], "there is no old-log-prob pass")):
        load_config(None, ["actor_rollout_ref.model.path=/m", key, *extra])
        err = capsys.readouterr().err
        assert "actor_rollout_ref.actor.old_log_prob_from_update" in err and why in err, (extra, err)
    for extra in ([], ["actor_rollout_ref.actor.ppo_epochs=2"]):
        load_config(None, ["actor_rollout_ref.model.path=/m", key, *extra])
        assert "old_log_prob_from_update" not in capsys.readouterr().err, extra
