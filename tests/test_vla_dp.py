"""The VLA trainer at data parallelism 2: two CPU processes (gloo) against one process on the same rows.

tests/vla_dp_worker.py runs, on each of two ranks, the trainer's pieces on its share of step 1's initial states and
one forward-backward of the actor and the critic (PPO with a value head, so both engines' DP paths run), then two
whole `train_step`s. Here: the ranks drew disjoint halves of one process's initial states; the DP gradients equal one
process's on the two ranks' batches joined (the loss is normalised by the tokens of both ranks, the gradients
averaged over them); after two steps both ranks hold the same parameters, bit for bit. Megatron's DDP all-reduce is
what runs here (`use_distributed_optimizer=false`, for whole gradients on every rank).
"""
import pytest
import torch
from launcher import run as launch

pytestmark = pytest.mark.cost(45)

ARGS = ["vla.enable=true", "trainer.device=cpu", "vla.num_envs=8", "actor_rollout_ref.rollout.n=2",
        "vla.held_out_states=2", "vla.demo_episodes=4", "vla.tasks=[reach,push]", "vla.max_steps=8", "vla.chunk=2",
        "vla.num_bins=8", "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.temperature=1.0",
        "trainer.logger=[jsonl]", "trainer.total_training_steps=2", "algorithm.adv_estimator=gae",
        "critic.enable=true", "critic.optim.lr=1e-3", "algorithm.gamma=0.99", "algorithm.lam=0.95",
        # the gradients compared whole: with the distributed optimizer each rank's buffer has only its shard reduced
        "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false",
        "critic.megatron.use_distributed_optimizer=false"]


@pytest.fixture(scope="module")
def dp2(vla_llava, cpu_only, tmp_path_factory):
    out = tmp_path_factory.mktemp("vla_dp")
    launch("tests/vla_dp_worker.py", str(vla_llava), str(out), *ARGS, nproc=2, timeout=600)
    return vla_llava, out, torch.load(out / "dp2.pt", weights_only=False)


def _joined(batches: list[dict]) -> dict:
    assert batches[0].keys() == batches[1].keys()
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def test_dp2_gradients_equal_one_process_on_both_ranks_rows(dp2, tmp_path):
    """Mutations: the engine's loss scale without the DP size (`scale=len(mbs)`: gradients halved) fails it;
    `VLARun.train_states` giving every rank the first half of the states fails the states check (run once each)."""
    from rlhf_mcore.config import load_config
    from rlhf_mcore.parallel import destroy_distributed, init_distributed
    from rlhf_mcore.trainer.vla import VLARun

    llava, _, res = dp2
    cfg = load_config(None, [f"actor_rollout_ref.model.path={llava}", f"trainer.default_local_dir={tmp_path}", *ARGS])
    state = init_distributed(device="cpu", seed=1)
    run = VLARun(cfg, state, tmp_path)
    try:
        ranks = res["states"]
        assert len(ranks[0]) == len(ranks[1]) == 2
        assert list(ranks[0]) + list(ranks[1]) == list(run.train_states(1)), "the ranks' states are not one " \
                                                                            "process's, split in two"
        batch = _joined(res["batches"])
        for key, engine in (("actor_grads", run.engine), ("critic_grads", run.critic)):
            engine.forward_backward(batch)
            ref = {f"{i}.{n}": p.main_grad.detach().float() for i, m in enumerate(engine.modules)
                   for n, p in m.named_parameters() if p.requires_grad}
            got = res[key]
            assert got.keys() == ref.keys()
            total = torch.cat([g.reshape(-1) for g in ref.values()])
            assert total.norm() > 0, f"{key}: no gradient"
            err = _rel(torch.cat([got[k].reshape(-1) for k in ref]), total)
            assert err < 1e-5, f"{key}: DP=2 gradients are {err:.2e} (relative) from one process's on the same rows"
    finally:
        run.close()
        destroy_distributed()


def test_dp2_ranks_hold_the_same_parameters_after_two_steps(dp2):
    """Both engines' parameters gathered from the two ranks after two whole train_steps: equal bit for bit (each
    rank's update uses the same all-reduced gradients), and the steps reported the critic's and actor's metrics."""
    _, _, res = dp2
    for key in ("actor_params", "critic_params"):
        a, b = res[key]
        assert torch.equal(a, b), f"{key}: the ranks' parameters differ after two steps"
    m1, m2 = res["metrics"]
    for m in (m1, m2):
        assert {"train/success", "actor/pg_loss", "critic/vf_loss", "critic/vf_explained_var"} <= m.keys(), sorted(m)
