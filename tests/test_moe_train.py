"""GRPO end to end through launch/train.py with a tiny Qwen3-MoE at expert parallelism 2 (2 processes): the experts
split over the two ranks in training, the native engine generating, the weights synced (and verified) from the
EP-sharded actor every step, the load-balancing and z-losses on and logged."""
import math

import pytest

pytestmark = pytest.mark.cost(30)

TINY = dict(arch="qwen3_moe", layers=2, hidden=32, heads=4, kv_heads=2, vocab=1000, experts=4, top_k=2,
            tie_word_embeddings=False)


def test_grpo_with_a_moe_actor_at_ep2_through_train_py(tmp_path, tiny_model_dir):
    """Two steps finish with the weights verified after each sync; the MoE losses are logged. Mutation: engine/
    builder.py without **moe_overrides(megatron) -> no actor/moe_* keys -> fails."""
    from e2e_helpers import parity_task, records
    from launcher import run

    out = tmp_path / "run"
    a = "actor_rollout_ref.actor.megatron."
    args = parity_task(tmp_path, tiny_model_dir(**TINY)) + [
        "algorithm.adv_estimator=grpo", "trainer.total_training_steps=2", f"trainer.default_local_dir={out}",
        f"{a}expert_model_parallel_size=2", f"{a}override_transformer_config.moe_aux_loss_coeff=0.01",
        f"{a}override_transformer_config.moe_z_loss_coeff=0.001", "actor_rollout_ref.rollout.sync_verify=true"]
    run("launch/train.py", *args, nproc=2)
    logged = records(out)
    assert [r["step"] for r in logged] == [1, 2]
    for r in logged:
        for key in ("actor/moe_load_balancing_loss", "actor/moe_z_loss"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r.get(key))
