"""The VLA trainer (rlhf_mcore/trainer/vla.py): its config section's refusals, rows with images through the train
engine (log-probs equal the colocated decode's), GRPO's per-group advantages and DAPO's group filter, one step, and
a resumed run equal to the uninterrupted one; PPO with a value head (the critic's values where they belong, a step
with the critic's metrics, the critic learning a fixed batch, resume with a critic). One process, fp32 on CPU, a tiny
LLaVA."""
import json

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.cost(40)

TINY = ["vla.enable=true", "trainer.device=cpu", "vla.num_envs=4", "actor_rollout_ref.rollout.n=2",
        "vla.held_out_states=2", "vla.demo_episodes=4", "vla.tasks=[reach,push]", "vla.max_steps=8", "vla.chunk=2",
        "vla.num_bins=8",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.temperature=1.0",
        "trainer.logger=[jsonl]", "trainer.total_training_steps=1"]
PPO = ["algorithm.adv_estimator=gae", "critic.enable=true", "critic.optim.lr=1e-3", "algorithm.gamma=0.99",
       "algorithm.lam=0.95"]


@pytest.fixture(scope="module")
def llava(vla_llava):
    return vla_llava


def cfg_of(llava, *extra):
    from rlhf_mcore.config import load_config

    return load_config(None, [f"actor_rollout_ref.model.path={llava}", *TINY, *extra])


# ------------------------------------------------------------------ the config section


@pytest.mark.parametrize("override, words", [
    ("data.train_batch_size=8", ["'data.train_batch_size' has value 8", "initial states from the env"]),
    ("data.train_files=[a.parquet]", ["'data.train_files'", "remove it"]),
    ("critic.optim.lr=0.1", ["'critic.optim.lr' has value 0.1", "set algorithm.adv_estimator=gae"]),
    ("critic.enable=true", ["'critic.enable' has value True", "only PPO with a value head reads"]),
    ("algorithm.gamma=0.9", ["'algorithm.gamma' has value 0.9", "set algorithm.adv_estimator=gae"]),
    ("algorithm.adv_estimator=gae critic.enable=false", ["'critic.enable' has value False",
                                                         "set critic.enable=true or algorithm.adv_estimator=grpo"]),
    ("algorithm.adv_estimator=gae vla.filter_groups=true", ["'vla.filter_groups' has value True", "gae has no groups",
                                                            "set vla.filter_groups=false"]),
    ("algorithm.adv_estimator=gae algorithm.norm_adv_by_std_in_grpo=false",
     ["'algorithm.norm_adv_by_std_in_grpo' has value False", "only grpo reads"]),
    ("algorithm.adv_estimator=gae critic.ppo_micro_batch_size_per_gpu=2", ["critic.ppo_max_token_len_per_gpu instead"]),
    ("algorithm.adv_estimator=gae critic.model.lora_rank=8", ["'critic.model.lora_rank' has value 8", "no LoRA"]),
    ("algorithm.adv_estimator=gae critic.use_dynamic_bsz=true", ["'critic.use_dynamic_bsz'",
                                                                 "the VLA critic reads only"]),
    ("actor_rollout_ref.rollout.name=sglang", ["'actor_rollout_ref.rollout.name' has value 'sglang'",
                                               "only rollout.n and rollout.temperature apply"]),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", ["ppo_max_token_len_per_gpu instead"]),
    ("algorithm.adv_estimator=rloo", ["'algorithm.adv_estimator' has value 'rloo'", "grpo", "gae"]),
    ("vla.num_envs=5", ["'vla.num_envs' has value 5", "multiple of actor_rollout_ref.rollout.n=2"]),
    ("vla.tasks=[reach,grasp]", ["'vla.tasks'", "from ['reach', 'push']"]),
    ("vla.colors=[red,red]", ["'vla.colors'", "distinct"]),
    ("vla.filter_low=0.95", ["'vla.filter_low' has value 0.95", "<= vla.filter_high"]),
    ("vla.demo_stop_short=1.5", ["'vla.demo_stop_short'", "in [0, 1]"]),
    ("vla.demo_stop_short=0.6 vla.demo_wrong_target=0.5", ["'vla.demo_stop_short' has value 0.6",
                                                           "sum to more than 1"]),
    ("vla.demo_stop_short=0.5 vla.tasks=[push]", ["'vla.demo_stop_short' has value 0.5", "no reach"]),
    ("vla.demo_wrong_target=0.5 vla.colors=[red]", ["'vla.demo_wrong_target' has value 0.5", "has one"]),
    ("trainer.total_training_steps=null", ["'trainer.total_training_steps' has value None", "set trainer.total"]),
])
def test_vla_config_refusals_name_key_value_and_fix(override, words):
    """Each refusal names the key, its value and the fix. Mutations: dropping the refusal loop in check_vla_keys (the
    text keys accepted) -> the data/critic/rollout cases fail; dropping _check_estimator_keys (run once) -> the
    critic-with-grpo, gamma, critic.enable=false, filter_groups and norm_adv cases fail."""
    from rlhf_mcore.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["actor_rollout_ref.model.path=/m", *TINY, *override.split()])
    assert all(w in str(e.value) for w in words), str(e.value)


def test_vla_keys_without_vla_enable_are_refused():
    from rlhf_mcore.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="'vla.num_envs' has value 8, but vla.enable=false"):
        load_config(None, ["actor_rollout_ref.model.path=/m", "vla.num_envs=8"])
    cfg = load_config(None, ["actor_rollout_ref.model.path=/m", *TINY])  # the keys a VLA run reads: accepted
    assert cfg.vla.enable and cfg.vla.num_envs == 4
    assert cfg.algorithm.adv_estimator == "grpo"  # unset: the VLA default (the text trainer's is gae)
    cfg = load_config(None, ["actor_rollout_ref.model.path=/m", *TINY, *PPO, "critic.cliprange_value=0.3"])
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.optim.lr == 1e-3 and cfg.algorithm.lam == 0.95


def test_config_colours_are_the_envs():
    """The config lists the env's colours itself (it imports no numpy module); they must stay the same."""
    from rlhf_mcore.config.vla import COLORS
    from rlhf_mcore.vla.envs.reach_push import COLORS as ENV_COLORS

    assert COLORS == tuple(ENV_COLORS)


# ------------------------------------------------------------------ GRPO and the group filter


def test_episode_advantages_and_group_filter_against_a_naive_loop():
    """Mutations: the filter's bounds exclusive (`<` for `<=`) -> the 0.25-group case fails; advantages normalised
    over the whole batch instead of per group -> fails."""
    from rlhf_mcore.trainer.vla import episode_advantages, group_filter

    success = np.array([1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0], np.float32)
    group = np.repeat(np.arange(4), 4)
    adv = episode_advantages(success, group, norm_by_std=True)
    for g in range(4):
        s = success[group == g]
        want = (s - s.mean()) / (s.std(ddof=1) + 1e-6)
        np.testing.assert_allclose(adv[group == g], want, atol=1e-5)
    keep = group_filter(success, group, 0.25, 0.5)
    assert keep.tolist() == [True] * 4 + [False] * 8 + [True] * 4


# ------------------------------------------------------------------ rows with images through the engine


@pytest.fixture(scope="module")
def cpu_state(cpu_only):
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    yield init_distributed(device="cpu", seed=1)
    destroy_distributed()


def _run(llava, state, out, *extra):
    from rlhf_mcore.trainer.vla import VLARun

    return VLARun(cfg_of(llava, f"trainer.default_local_dir={out}", *extra), state, out)


@pytest.fixture(scope="module")
def vla_run(llava, cpu_state, tmp_path_factory):
    run = _run(llava, cpu_state, tmp_path_factory.mktemp("vla_run"))
    yield run
    run.close()


@pytest.fixture(scope="module")
def ppo_run(llava, cpu_state, tmp_path_factory):
    run = _run(llava, cpu_state, tmp_path_factory.mktemp("ppo_run"), *PPO)
    yield run
    run.close()


def test_engine_log_probs_equal_the_decodes_for_rows_with_their_own_images(vla_run):
    """The rollout's log-probs (decode.py: restricted to the action ids, T=1.3) are what the train engine scores
    for the same rows (each row its own image), packed and padded. Mutations: the forward step not passing
    pixel_values -> 3.5 apart; token_range dropped (softmax over the whole vocabulary) -> 6.0 apart; the
    micro-batch's images not selected by its rows (`batch["pixel_values"][:len(rows)]`) -> 0.48 apart at
    micro-batches of 3 rows."""
    import dataclasses

    from rlhf_mcore.vla.envs.reach_push import ReachPush

    policy, engine = vla_run.policy, vla_run.engine
    env = ReachPush(6, image_size=16, tasks=("reach", "push"))
    obs = env.reset(np.arange(6) + 11)
    out = policy.act(obs, torch.Generator().manual_seed(3), temperature=1.3)
    assert len({img.tobytes() for img in obs["image"]}) == 6
    batch = policy.batch(obs["image"], list(obs["instruction"]), out["tokens"], np.ones_like(out["tokens"]))
    saved = engine.cfg
    try:
        for packed, micro in ((True, 6), (False, 3)):
            engine.cfg = dataclasses.replace(saved, temperature=1.3, use_remove_padding=packed, use_dynamic_bsz=False,
                                             micro_batch_size=micro, forward_use_dynamic_bsz=False)
            logp, _ = engine.compute_log_probs(batch, with_entropy=False)
            torch.testing.assert_close(logp, torch.as_tensor(out["log_probs"]), atol=2e-5, rtol=0)
        swapped = dict(batch, pixel_values=batch["pixel_values"].roll(1, 0))  # each row another row's image
        logp, _ = engine.compute_log_probs(swapped, with_entropy=False)
        assert (logp - torch.as_tensor(out["log_probs"])).abs().max() > 1e-3
    finally:
        engine.cfg = saved


def test_a_response_token_outside_the_action_range_is_refused(vla_run):
    policy = vla_run.policy
    obs = {"image": np.zeros((1, 16, 16, 3), np.uint8), "instruction": ["reach the red block"]}
    tokens = np.full((1, policy.actions.tokens_per_chunk), policy.lo - 1)
    batch = policy.batch(obs["image"], obs["instruction"], tokens, np.ones_like(tokens))
    with pytest.raises(ValueError, match="outside token_range"):
        vla_run.engine.compute_log_probs(batch, with_entropy=False)


def test_one_step_and_behaviour_cloning_run(vla_run):
    """A GRPO step trains on its rows (old log-probs = the rollout's: ppo_kl ~ 0 before the update) and reports
    the metrics; behaviour cloning lowers the expert tokens' loss."""
    m = vla_run.train_step(1)
    for key in ("train/success", "train/episode_length", "perf/env_steps_per_s", "perf/env_s", "perf/policy_s"):
        assert key in m
    assert m["train/rows"] > 0 and abs(m["actor/ppo_kl_first_minibatch"]) < 1e-5
    losses = vla_run.behaviour_cloning(6, 16)
    assert losses[-1] < losses[0]


# ------------------------------------------------------------------ PPO with a value head


def _rows(run, step: int):
    from rlhf_mcore.vla.rollout import rollout
    from rlhf_mcore.vla.rows import flatten_rollout, repeat_for_groups

    ids, group = repeat_for_groups(run.train_states(step), run.n)
    ro = rollout(run.stages, run._policy_fn(torch.Generator().manual_seed(step), 1.0), ids, overlap=False)
    return flatten_rollout(ro, group)


def test_critic_values_advantages_and_returns_sit_where_they_belong(ppo_run):
    """The critic is the LLaVA with a value head, built from the actor's path; the batch's old values are the
    critic's outputs at the positions predicting each action token (a direct dense forward of the critic chunk with
    each row's own image), and GAE runs on each row's value at its first action token (the observation's value):
    advantages and returns equal chunk_gae's on those values and the rows' rewards, spread over each row's masked
    tokens. Mutations (run once each): the observation's value taken at the last action token (`values[:, -1]`) ->
    48/64 returns differ; the critic's pass without the rows' images (`pixel_values` dropped) -> every value differs."""
    from rlhf_mcore.vla.gae import chunk_gae

    run = ppo_run
    chunk = run.critic.chunks[0]
    assert type(chunk.output_layer).__name__ == "ValueHead" and chunk.vision_model is not None
    rows = _rows(run, 7)
    sel = np.arange(len(rows))
    batch, _ = run.training_batch(rows, sel, None)
    run.gae_targets(batch, rows, sel)
    ids, m = batch["input_ids"], batch["response_mask"]
    (b, s), r = ids.shape, m.shape[1]
    causal = ~torch.ones(s, s, dtype=torch.bool).tril()[None, None].expand(b, 1, s, s)  # True: masked out
    chunk.eval()
    with torch.no_grad():
        out = chunk(ids, torch.arange(s)[None].expand(b, s), causal, pixel_values=batch["pixel_values"])  # (b, s, 1)
    direct = out[:, s - r - 1:s - 1, 0]  # (b, R): the positions predicting each action token
    torch.testing.assert_close(batch["values"], direct * m, atol=1e-5, rtol=0)
    adv, ret = chunk_gae(direct[:, 0], torch.as_tensor(rows.token_rewards.sum(1)), rows.traj, rows.chunk,
                         gamma=0.99, lam=0.95)
    torch.testing.assert_close(batch["returns"], ret[:, None] * m, atol=1e-5, rtol=0)
    torch.testing.assert_close(batch["advantages"], adv[:, None] * m, atol=1e-4, rtol=0)
    assert (m[:, 0] == 1).all() and len(set(rows.traj.tolist())) < len(rows)  # multi-row episodes


def test_a_ppo_step_updates_the_critic_then_the_actor(ppo_run):
    """A PPO step reports the critic's metrics next to the actor's (old log-probs the rollout's: ppo_kl ~ 0).
    Mutation: VLARun.update not calling update_critic -> the critic/vf_loss key is missing (run once)."""
    m = ppo_run.train_step(1)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/values/mean",
                "critic/returns/mean", "critic/vf_explained_var", "actor/pg_loss", "actor/grad_norm"):
        assert key in m, key
    assert m["train/rows"] > 0 and abs(m["actor/ppo_kl_first_minibatch"]) < 1e-5


def test_the_critic_fits_a_fixed_batch(ppo_run):
    """Six trainer updates (critic then actor) on one batch whose returns are fixed targets: the critic's value loss
    falls by more than half. Mutation: VLARun.update not calling update_critic -> no critic/vf_loss (run once)."""
    run = ppo_run
    rows = _rows(run, 3)
    sel = np.arange(len(rows))
    batch, _ = run.training_batch(rows, sel, None)
    run.gae_targets(batch, rows, sel)
    m = batch["response_mask"]
    batch["returns"] = torch.as_tensor(rows.chunk % 2, dtype=torch.float32)[:, None] * m  # 0/1 targets
    losses = []
    for _ in range(6):
        batch["values"] = run.critic.compute_values(batch) * m
        losses.append(run.update(batch)["critic/vf_loss"])
    assert losses[-1] < 0.5 * losses[0], losses


# ------------------------------------------------------------------ resume


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_resume_equals_the_uninterrupted_run(llava, cpu_only, tmp_path, algorithm):
    """Two steps straight, against one step, a checkpoint, then the second step resumed: the same step-2 metrics and
    held-out success, bit for bit; with PPO the critic's too. Mutations: resume not loading the engine's checkpoint
    -> differs; (ppo) resume not loading the critic's -> differs (run once)."""
    from rlhf_mcore.trainer.vla import run_vla

    common = ["vla.bc_steps=1", "vla.bc_batch_size=8", "trainer.save_freq=1", "trainer.test_freq=2",
              "trainer.val_before_train=false", *(PPO if algorithm == "ppo" else [])]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_vla(cfg_of(llava, *common, f"trainer.default_local_dir={straight}", "trainer.total_training_steps=2"))
    run_vla(cfg_of(llava, *common, f"trainer.default_local_dir={split}", "trainer.total_training_steps=1"))
    run_vla(cfg_of(llava, *common, f"trainer.default_local_dir={split}", "trainer.total_training_steps=2"))

    def step2(d):
        recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        (rec,) = [r for r in recs if r["step"] == 2 and r["kind"] == "train"]
        return {k: v for k, v in rec.items() if not k.startswith("perf/") and k != "val/seconds"}

    a, b = step2(straight), step2(split)
    assert a == b and "val/success" in a and "actor/grad_norm" in a
    assert ("critic/vf_loss" in a) == (algorithm == "ppo")
    assert (split / "checkpoints").is_dir()
