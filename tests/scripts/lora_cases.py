"""LoRA at TP=2 and PP=2 in one 2-process launch (tests/test_lora.py compares with peft and with TP=1).

For each layout: the actor of a LoRA run starting from the peft-made adapter `--adapter`, its log-probs on the batch
`--out/batch.pt`, its merged export, then one PPO update and the adapters after it (full, PEFT-named); at TP=2 it
saves a checkpoint that the PP=2 layout loads into a fresh actor (adapters resharded). Rank 0 writes
`--out/<layout>.pt`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rlhf_mcore.parallel import destroy_distributed, init_distributed  # noqa: E402


def config(model_dir, adapter):
    from rlhf_mcore.config import load_config

    return load_config(None, [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.lora_rank=4",
                              "actor_rollout_ref.model.lora_alpha=8", "trainer.device=cpu",
                              f"actor_rollout_ref.model.lora_adapter_path={adapter}",
                              "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.train_batch_size=4"])


def run_layout(name: str, tp: int, pp: int, args) -> None:
    from megatron.core import parallel_state as mpu

    from rlhf_mcore.models import export_hf_weights
    from rlhf_mcore.models.lora import adapter_tensors
    from rlhf_mcore.trainer import roles

    state = init_distributed(tp=tp, pp=pp, device="cpu")
    out = Path(args.out)
    cfg = config(args.model_dir, args.adapter)
    batch = torch.load(out / "batch.pt")
    actor = roles.build_actor(cfg, state, total_steps=2)
    res = {}
    res["log_probs"], _ = actor.compute_log_probs(batch)
    res["merged"] = {k: v.clone() for k, v in export_hf_weights(actor.chunks, state)}
    actor.update_policy({**batch, "old_log_probs": res["log_probs"]})
    res["updated"] = adapter_tensors(actor.chunks, state)
    if name == "tp2":
        actor.save_checkpoint(out / "ckpt_tp2")
    else:  # the TP=2 checkpoint into a fresh PP=2 actor: its adapters are the TP=2 run's after its update
        fresh = roles.build_actor(cfg, state, total_steps=2)
        fresh.load_checkpoint(out / "ckpt_tp2")
        res["loaded_from_tp2"] = adapter_tensors(fresh.chunks, state)
    if state.rank == 0:
        torch.save(res, out / f"{name}.pt")
    dist.barrier()
    mpu.destroy_model_parallel()


def main() -> None:
    from rlhf_mcore.startup import pause_gc

    pause_gc()  # the worker's start-up without the cyclic collector, as the launch scripts' (rlhf_mcore/startup.py)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
        run_layout(name, tp, pp, args)
    destroy_distributed()


if __name__ == "__main__":
    main()
