"""GRPO end to end through launch/train.py with a tiny Qwen3-MoE at expert parallelism 2 (2 processes): the experts
split over the two ranks in training, the native engine generating and recording every token's routes, routing
replay R3 in the old-log-prob and update passes, the weights synced (and verified) from the EP-sharded actor every
step, the load-balancing and z-losses on and logged; then the run resumed from its step-1 checkpoint (a second
2-process launch) against the uninterrupted one."""
import math
import shutil

import pytest

pytestmark = pytest.mark.cost(75)  # two 2-process launches, then two side by side

TINY = dict(arch="qwen3_moe", layers=2, hidden=32, heads=4, kv_heads=2, vocab=1000, experts=4, top_k=2,
            tie_word_embeddings=False)


@pytest.fixture(scope="module")
def task(tmp_path_factory, tiny_model_dir):
    from e2e_helpers import parity_task

    tmp = tmp_path_factory.mktemp("moe_grpo")
    a = "actor_rollout_ref.actor.megatron."
    base = parity_task(tmp, tiny_model_dir(**TINY)) + [
        "algorithm.adv_estimator=grpo", "trainer.total_training_steps=2", "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=2", f"{a}expert_model_parallel_size=2",
        f"{a}override_transformer_config.moe_aux_loss_coeff=0.01",
        f"{a}override_transformer_config.moe_z_loss_coeff=0.001", "actor_rollout_ref.rollout.sync_verify=true",
        "actor_rollout_ref.actor.router_replay.mode=R3"]
    return tmp, base


@pytest.fixture(scope="module")
def uninterrupted(task):
    from launcher import run

    tmp, base = task
    out = tmp / "full"
    run("launch/train.py", *base, f"trainer.default_local_dir={out}", nproc=2)
    return out


def test_grpo_with_a_moe_actor_at_ep2_and_r3_through_train_py(uninterrupted):
    """Two steps finish with the weights verified after each sync; the MoE losses and the routing metrics are
    logged: on the same weights the trainer's own routes are the rollout's for (nearly) every token, and the
    expert load is a ratio >= 1. Mutations: engine/builder.py without **moe_overrides(megatron) -> no actor/moe_*
    loss keys -> fails; roles.build_rollout without record_routes -> the R3 passes find no routed_experts -> the
    run fails."""
    from e2e_helpers import records

    logged = records(uninterrupted)
    assert [r["step"] for r in logged] == [1, 2]
    for r in logged:
        for key in ("actor/moe_load_balancing_loss", "actor/moe_z_loss"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r.get(key))
        assert 0.0 <= r["actor/moe_routing_mismatch/mean"] <= r["actor/moe_routing_mismatch/max"] <= 0.02, r
        assert 1.0 <= r["actor/moe_expert_load/mean"] <= r["actor/moe_expert_load/max"] <= 4.0, r


def test_moe_resume_equals_the_uninterrupted_run(task, uninterrupted, tmp_path):
    """The step-1 checkpoint (EP-sharded experts in Megatron's distributed checkpoint) resumed in a second launch:
    step 2's metrics and the final weights equal the uninterrupted run's."""
    from launcher import run
    from test_trainer import deterministic, hf_weights, train_metrics

    _, base = task
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(uninterrupted / "checkpoints" / "global_step_1", part / "checkpoints" / "global_step_1")
    proc = run("launch/train.py", *base, f"trainer.default_local_dir={part}", nproc=2)
    assert "resumed from" in proc.stdout + proc.stderr
    got, want = train_metrics(part), train_metrics(uninterrupted)
    assert sorted(got) == [2] and want[1]["actor/grad_norm"] > 0
    assert deterministic(got[2]) == deterministic(want[2])
    a, b = hf_weights(uninterrupted / "hf_final"), hf_weights(part / "hf_final")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


ASYNC = {"one_step_off": ["async_training.mode=one_step_off"],
         "fully_async": ["async_training.mode=fully_async", "async_training.require_batches=1",
                         "async_training.staleness_threshold=1", "async_training.partial_rollout=true"]}


@pytest.fixture(scope="module")
def async_runs(task, tmp_path_factory):
    """Both asynchronous trainers with R3 on the tiny MoE (no EP: 1 training + 1 rollout process each, side by side),
    two steps each."""
    from launcher import start, wait_all

    _, base = task
    root = tmp_path_factory.mktemp("moe_async")
    args = [a for a in base if "expert_model_parallel_size" not in a and "save_freq" not in a]
    wait_all({mode: start("launch/train.py", *args, *extra, "rollout.n_gpus_per_node=1", "trainer.save_freq=-1",
                          f"trainer.default_local_dir={root / mode}", nproc=2) for mode, extra in ASYNC.items()},
             timeout=600)
    return root


@pytest.mark.parametrize("mode", sorted(ASYNC))
def test_the_asynchronous_trainers_carry_the_rollouts_routes_to_r3(async_runs, mode):
    """The routes the rollout pool records reach the trainer's R3 passes through the asynchronous trainers (the
    rollout worker's results, the data bus, partial rollouts continued after a sync): both runs finish their steps,
    and every step logs the routing mismatch (computed only from routes that came with the rows). On the first
    step's samples the rollout had the trainer's weights, so (nearly) no token's routes differ. Mutations:
    sample_streams.SampleStream.step building its Row without routes=s.routes -> fully_async's R3 pass finds no
    routed_experts -> that run fails; rollout_phase's streaming Row without routes=f.sample.routes (the path
    one_step_off's rollout worker generates through) -> one_step_off fails."""
    from e2e_helpers import records

    logged = records(async_runs / mode)
    assert [r["step"] for r in logged] == [1, 2]
    for r in logged:
        assert 0.0 <= r["actor/moe_routing_mismatch/mean"] <= r["actor/moe_routing_mismatch/max"] <= 1.0, r
        assert 1.0 <= r["actor/moe_expert_load/mean"] <= r["actor/moe_expert_load/max"] <= 4.0, r
    assert logged[0]["actor/moe_routing_mismatch/max"] <= 0.02, logged[0]
