"""Worker for tests/test_prime.py: several PRIME runs of the synchronous trainer one after another in one torchrun
launch (the process group is kept between runs; each run builds its own models and parallel state), each observed
by a hook that records what the test recomputes offline.

Usage: torchrun --nproc_per_node=2 tests/scripts/prime_runs.py --spec spec.json --out DIR

spec.json: {"base": [train.py overrides], "runs": [{"name", "overrides", "resume_from": name or absent}]}; a run
with `resume_from` starts from a copy of that run's directory less its last checkpoint (so it resumes from the one
before). Each rank writes DIR/<name>.rank<r>.json: per step {"step", "rows": [...], "calls", "metrics"}, a row
being {"ids" (prompt + response, unpadded), "index", "mask", "length" (its response tokens), "ref", "prm" (the
PRM's log-probs the process rewards were computed from), "prm_end" (the PRM's log-probs at the step's end, after
its update), "acc" (the label: the summed token_level_scores), "adv", "ret"}; "calls": the order of the PRM's
update and log-prob passes within the step.
"""
import argparse
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf_mcore.trainer.hooks import StepHooks


class PrimeRecorder(StepHooks):
    """Reads the step's batch and the PRM's passes; the PRM's two methods are wrapped to record, not changed."""

    def __init__(self, path: Path):
        self.path, self.steps, self.calls, self.prm_lp, self.wrapped = path, [], [], None, False

    def step_start(self, parts, step) -> None:
        self.calls = []
        if self.wrapped:
            return
        engine = parts.prime.engine
        log_probs, update = engine.compute_log_probs, engine.update

        def recorded_log_probs(*a, **k):
            out = log_probs(*a, **k)
            self.calls.append("log_probs")
            self.prm_lp = out[0].detach().clone()
            return out

        def recorded_update(*a, **k):
            self.calls.append("update")
            return update(*a, **k)

        engine.compute_log_probs, engine.update, self.wrapped = recorded_log_probs, recorded_update, True
        self.original_log_probs = log_probs

    def step_end(self, parts, step, batch, metrics, timer) -> None:
        prm_end, _ = self.original_log_probs(batch, with_entropy=False)  # the PRM as the step leaves it
        mask = batch["response_mask"].float()
        rows = []
        for i in range(mask.shape[0]):
            keep = batch["attention_mask"][i].bool()
            n = int(mask[i].sum())
            rows.append({"ids": batch["input_ids"][i][keep].tolist(), "index": int(batch["index"][i]),
                         "mask": mask[i].tolist(), "ref": batch["ref_log_prob"][i].tolist(),
                         "prm": self.prm_lp[i].tolist(), "prm_end": prm_end[i].tolist(),
                         "acc": float(batch["token_level_scores"][i].sum()), "adv": batch["advantages"][i].tolist(),
                         "ret": batch["returns"][i].tolist(), "length": n})
        self.steps.append({"step": step, "rows": rows, "calls": list(self.calls),
                           "metrics": {k: v for k, v in metrics.items()
                                       if k.startswith(("prime", "actor/pg_loss", "critic/score"))}})
        self.path.write_text(json.dumps(self.steps))


def close(trainer) -> None:
    """RunContext.close less the process group's end: the next run reuses it."""
    from megatron.core import parallel_state as mpu

    run = trainer.run
    run.logger.close()
    run.scorer.close()
    dist.barrier(group=run.state.cpu_group)
    mpu.destroy_model_parallel()
    run.run_lock.release()


def main() -> None:
    from rlhf_mcore.startup import pause_gc

    pause_gc()  # the worker's start-up without the cyclic collector, as the launch scripts' (rlhf_mcore/startup.py)
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from rlhf_mcore.cli import load_and_validate, parse_args
    from rlhf_mcore.trainer.rl_trainer import RLTrainer

    spec, out = json.loads(Path(args.spec).read_text()), Path(args.out)
    dist.init_process_group("gloo")
    for run in spec["runs"]:
        run_dir = out / run["name"]
        if run.get("resume_from") and dist.get_rank() == 0:
            shutil.copytree(out / run["resume_from"], run_dir)
            last = max((run_dir / "checkpoints").glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
            shutil.rmtree(last)
        dist.barrier()
        cfg = load_and_validate(parse_args(spec["base"] + run["overrides"] + [f"trainer.default_local_dir={run_dir}"]))
        trainer = RLTrainer(cfg, hooks=PrimeRecorder(out / f"{run['name']}.rank{dist.get_rank()}.json"))
        try:
            trainer.fit()
        finally:
            close(trainer)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
