"""The VLA trainer scores the distribution its rollout sampled from (issue 37's first suspect for the PPO KL of ~3
at the first mini-batch): a multi-chunk rollout of a behaviour-cloned policy at T=1.5 through the trainer's own
path (`VLARun.train_states` -> `rollout` -> `flatten_rollout` -> `VLARun.training_batch`), its rows scored by the
train engine in fp32, equal the log-probs the rollout drew with, within 1e-5; and the update's own forward (train
mode) sees the same: the PPO KL at its first mini-batch against the rollout's log-probs is ~0. One process, CPU."""
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.cost(12)

CFG = ["vla.enable=true", "trainer.device=cpu", "vla.num_envs=8", "actor_rollout_ref.rollout.n=2",
       "vla.held_out_states=2", "vla.demo_episodes=32", "vla.tasks=[reach]", "vla.max_steps=10", "vla.chunk=4",
       "vla.num_bins=16", "vla.bc_lr=3e-3", "actor_rollout_ref.rollout.temperature=1.5", "trainer.logger=[jsonl]",
       "trainer.total_training_steps=1"]


@pytest.fixture(scope="module")
def run(vla_llava, cpu_only, tmp_path_factory):
    from rlhf_mcore.config import load_config
    from rlhf_mcore.parallel import destroy_distributed, init_distributed
    from rlhf_mcore.trainer.vla import VLARun

    out = tmp_path_factory.mktemp("vla_lp_run")
    cfg = load_config(None, [f"actor_rollout_ref.model.path={vla_llava}", f"trainer.default_local_dir={out}", *CFG])
    state = init_distributed(device="cpu", seed=1)
    r = VLARun(cfg, state, out)
    r.behaviour_cloning(8, 16)  # away from the near-uniform init: a mismatch of distributions shows more
    yield r
    r.close()
    destroy_distributed()


def test_trainer_log_probs_equal_the_rollouts_over_multi_chunk_episodes(run):
    """Mutations: the engine built without the action range (`token_range=None` in build_engine: the softmax over
    the whole vocabulary on the trainer's side only) -> 1.6 apart; the engine at temperature 1.0 while the rollout
    samples at 1.5 -> 2.0 apart; the response mask one chunk step short (`<` for `<=` in flatten_rollout's
    step_valid) -> the mask check fails."""
    from rlhf_mcore.vla.rollout import rollout
    from rlhf_mcore.vla.rows import first_done_step, flatten_rollout, repeat_for_groups

    ids, group = repeat_for_groups(run.train_states(1), run.n)
    gen = torch.Generator().manual_seed(5)
    ro = rollout(run.stages, run._policy_fn(gen, run.cfg.actor_rollout_ref.rollout.temperature), ids, overlap=False)
    rows = flatten_rollout(ro, group)
    assert rows.chunk.max() >= 2, "want episodes of several chunk steps"
    # the mask: every action step up to and including the episode's first done, per row (a naive loop)
    first = first_done_step(ro)
    c, a = run.cfg.vla.chunk, 2
    for i in range(len(rows)):
        want = [int(rows.chunk[i] * c + k <= first[rows.traj[i]]) for k in range(c) for _ in range(a)]
        assert rows.response_mask[i].tolist() == want
    assert (rows.response_mask == 0).any(), "want an episode ending inside a chunk (max_steps 10, chunks of 4)"

    sel = np.arange(len(rows))
    batch, gap = run.training_batch(rows, sel, np.zeros(len(ids), np.float32))
    m = batch["response_mask"].bool()
    rollout_lp = torch.as_tensor(rows.outputs["log_probs"], dtype=torch.float32)
    assert rollout_lp[m].max() < -1e-3 and rollout_lp[m].min() > -10  # sampled, not forced
    torch.testing.assert_close(batch["old_log_probs"][m], rollout_lp[m], atol=1e-5, rtol=0)
    assert gap < 1e-5

    # the update's forward: old = the rollout's log-probs, one mini-batch -> its first-mini-batch KL is ~0
    saved = [p.detach().clone() for p in run.engine.chunks[0].parameters()]
    batch = dict(batch, old_log_probs=rollout_lp * batch["response_mask"],
                 advantages=torch.ones_like(batch["response_mask"]))
    metrics = run.engine.update(batch)
    assert abs(metrics["actor/ppo_kl_first_minibatch"]) < 1e-5, metrics
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert any(not torch.equal(p, q) for p, q in zip(run.engine.chunks[0].parameters(), saved))  # it trained


def test_greedy_validation_and_sampling_use_the_action_range_only(run):
    """Every token the policy emits, greedy or sampled, lies in the action range (decode's restriction). Mutation:
    decode without `token_range` -> tokens outside it."""
    from rlhf_mcore.vla.envs.reach_push import ReachPush

    env = ReachPush(4, image_size=16, tasks=("reach",))
    obs = env.reset(np.arange(4) + 3)
    for temperature, gen in ((0.0, None), (1.5, torch.Generator().manual_seed(0))):
        out = run.policy.act(obs, gen, temperature)
        assert ((out["tokens"] >= run.policy.lo) & (out["tokens"] < run.policy.hi)).all()


def test_behaviour_cloning_leaves_fresh_adam_moments(run):
    """The RL steps start from fresh Adam moments (`vla.bc_reset_optimizer`): after BC every torch optimizer's
    state is empty and the next update is Adam's step 1. Mutation: the reset skipped -> the step count is BC's."""
    from rlhf_mcore.engine.offload import torch_optimizers
    from rlhf_mcore.vla.envs.reach_push import ReachPush

    run.behaviour_cloning(2, 8)
    opts = torch_optimizers(run.engine.optimizer)
    assert opts and all(len(o.state) == 0 for o in opts)
    env = ReachPush(2, image_size=16, tasks=("reach",))
    obs = env.reset(np.arange(2))
    out = run.policy.act(obs, torch.Generator().manual_seed(1), 1.5)
    batch = run.policy.batch(obs["image"], obs["instruction"], out["tokens"], np.ones_like(out["tokens"]))
    batch.update(old_log_probs=torch.as_tensor(out["log_probs"]), advantages=torch.ones(out["tokens"].shape))
    run.engine.update(batch)
    steps = {float(s["step"]) for o in opts for s in o.state.values()}
    assert steps == {1.0}, steps
