"""The VLA trainer at data parallelism 2 (tests/test_vla_dp.py starts this under torchrun, two CPU processes, gloo).

    python -m torch.distributed.run --nproc_per_node=2 tests/vla_dp_worker.py LLAVA_DIR OUT_DIR CONFIG_OVERRIDES...

Each rank runs the trainer's own pieces on its share of step 1's initial states: the rollout, the rows, the batch
(old log-probs, advantages; with PPO the critic's values, GAE advantages and returns), then one forward-backward of
the actor (and the critic) without an optimizer step, so the gradients are the DP all-reduced ones of the two ranks'
rows (the test turns the distributed optimizer off: with it each rank's buffer holds only its shard reduced). Rank 0
saves both ranks' batches and their states, the gradients, and then, after two whole `train_step`s, each rank's
parameters (gathered) and the step metrics, to OUT_DIR/dp2.pt. The test compares the gradients with one
process's on the two batches joined, and the ranks' parameters with each other.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


def grads(engine) -> dict[str, torch.Tensor]:
    """The engine's accumulated gradients (Megatron's main_grad buffers), by parameter name."""
    out = {}
    for i, m in enumerate(engine.modules):
        for name, p in m.named_parameters():
            if p.requires_grad:
                out[f"{i}.{name}"] = p.main_grad.detach().float().clone()
    return out


def params(engine) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for m in engine.modules for p in m.parameters()])


def step_batch(run, step: int) -> tuple[dict, np.ndarray]:
    """This rank's batch of `step` as `VLARun.train_step` builds it (no group filter), and its initial states."""
    from rlhf_mcore.trainer.vla import _keyed_generator, episode_advantages
    from rlhf_mcore.vla.rollout import rollout
    from rlhf_mcore.vla.rows import flatten_rollout, repeat_for_groups

    cfg = run.cfg
    states = run.train_states(step)
    ids, group = repeat_for_groups(states, run.n)
    gen = _keyed_generator(cfg.trainer.seed, step, run.state.dp_rank)
    ro = rollout(run.stages, run._policy_fn(gen, cfg.actor_rollout_ref.rollout.temperature), ids, overlap=False)
    rows = flatten_rollout(ro, group)
    sel = np.arange(len(rows.traj))
    adv = None
    if run.critic is None:
        adv = episode_advantages(ro.success.astype(np.float32), group, cfg.algorithm.norm_adv_by_std_in_grpo)
    batch, _ = run.training_batch(rows, sel, adv)
    if run.critic is not None:
        run.gae_targets(batch, rows, sel)
    return batch, states


def main() -> None:
    from rlhf_mcore.config import load_config
    from rlhf_mcore.parallel import destroy_distributed, init_distributed
    from rlhf_mcore.trainer.vla import VLARun

    llava, out, *overrides = sys.argv[1:]
    out = Path(out)
    cfg = load_config(None, [f"actor_rollout_ref.model.path={llava}", f"trainer.default_local_dir={out}", *overrides])
    state = init_distributed(device="cpu", seed=1)
    assert state.dims.dp == 2, state.dims
    run = VLARun(cfg, state, out)
    try:
        batch, states = step_batch(run, 1)
        run.engine.forward_backward(batch)
        result = {"actor_grads": grads(run.engine)}
        if run.critic is not None:
            run.critic.forward_backward(batch)
            result["critic_grads"] = grads(run.critic)
        gathered: list = [None, None]
        dist.all_gather_object(gathered, {"batch": batch, "states": states}, group=state.cpu_group)
        result["batches"] = [g["batch"] for g in gathered]
        result["states"] = [g["states"] for g in gathered]
        result["metrics"] = [run.train_step(1), run.train_step(2)]
        for key, engine in (("actor_params", run.engine), ("critic_params", run.critic)):
            if engine is not None:
                mine = params(engine)
                both = [torch.empty_like(mine), torch.empty_like(mine)]
                dist.all_gather(both, mine, group=state.cpu_group)
                result[key] = both
        if state.rank == 0:
            torch.save(result, out / "dp2.pt")
    finally:
        run.close()
        destroy_distributed()


if __name__ == "__main__":
    main()
