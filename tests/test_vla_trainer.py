"""The VLA trainer (rlhf_mcore/trainer/vla.py): its config section's refusals, rows with images through the train
engine (log-probs equal the colocated decode's), GRPO's per-group advantages and DAPO's group filter, one step, and
a resumed run equal to the uninterrupted one. One process, fp32 on CPU, a tiny LLaVA."""
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


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from rlhf_mcore.models.vision.tiny import make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("vla_llava"), image_size=16, patch_size=4)


def cfg_of(llava, *extra):
    from rlhf_mcore.config import load_config

    return load_config(None, [f"actor_rollout_ref.model.path={llava}", *TINY, *extra])


# ------------------------------------------------------------------ the config section


@pytest.mark.parametrize("override, words", [
    ("data.train_batch_size=8", ["'data.train_batch_size' has value 8", "initial states from the env"]),
    ("data.train_files=[a.parquet]", ["'data.train_files'", "remove it"]),
    ("critic.optim.lr=0.1", ["'critic.optim.lr' has value 0.1", "without a critic"]),
    ("actor_rollout_ref.rollout.name=sglang", ["'actor_rollout_ref.rollout.name' has value 'sglang'",
                                               "only rollout.n and rollout.temperature apply"]),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", ["ppo_max_token_len_per_gpu instead"]),
    ("algorithm.adv_estimator=gae", ["'algorithm.adv_estimator' has value 'gae'", "set algorithm.adv_estimator=grpo"]),
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
    """Each refusal names the key, its value and the fix. Mutation: dropping the refusal loop in check_vla_keys (the
    text keys accepted) -> the data/critic/rollout cases fail."""
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
def vla_run(llava, tmp_path_factory):
    from rlhf_mcore.parallel import destroy_distributed, init_distributed
    from rlhf_mcore.trainer.vla import VLARun

    if torch.cuda.is_available():
        pytest.skip("a CPU engine would hide the GPUs from this whole process (cpu_compat)")
    out = tmp_path_factory.mktemp("vla_run")
    state = init_distributed(device="cpu", seed=1)
    run = VLARun(cfg_of(llava, f"trainer.default_local_dir={out}"), state, out)
    yield run
    run.close()
    destroy_distributed()


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


# ------------------------------------------------------------------ resume


def test_resume_equals_the_uninterrupted_run(llava, tmp_path):
    """Two steps straight, against one step, a checkpoint, then the second step resumed: the same step-2 metrics and
    held-out success, bit for bit. Mutation: resume not loading the engine's checkpoint -> differs."""
    from rlhf_mcore.trainer.vla import run_vla

    if torch.cuda.is_available():
        pytest.skip("a CPU engine would hide the GPUs from this whole process (cpu_compat)")
    common = ["vla.bc_steps=1", "vla.bc_batch_size=8", "trainer.save_freq=1", "trainer.test_freq=2",
              "trainer.val_before_train=false"]
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
