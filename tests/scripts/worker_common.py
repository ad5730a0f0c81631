"""What the multi-process test scripts share (imported as a sibling module: a worker runs as a script, so its own
directory is first on sys.path)."""
from __future__ import annotations

import json
import sys
from typing import Any, Callable


def write_results(results: Any, path: str, indent: int | None = None) -> None:
    """Rank 0 writes the worker's results as JSON (every rank holds the same; the test reads one file)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(results, f, indent=indent)


def pop_flag(flag: str) -> str | None:
    """Take `flag VALUE` out of the command line (sys.argv); returns VALUE, or None when the flag is absent."""
    if flag not in sys.argv:
        return None
    at = sys.argv.index(flag)
    value = sys.argv[at + 1]
    del sys.argv[at:at + 2]
    return value


def run_async_trainer(flag: str, make_hooks: Callable[[str], Any]) -> None:
    """launch/train.py's asynchronous run with step hooks: `flag VALUE` is taken out of the command line and
    `make_hooks(VALUE)` observes the training pool; the rest are train.py's arguments. Exits with its code."""
    from rlhf_mcore.cli import main

    argv = sys.argv[1:]
    at = argv.index(flag)
    value = argv[at + 1]
    del argv[at:at + 2]

    def run(cfg):
        from rlhf_mcore.trainer.loops import train_async

        train_async(cfg, hooks=make_hooks(value))

    sys.exit(main(run, argv))


def run_reference(step: Callable[[Any, Any], tuple[dict, dict]]) -> None:
    """A synchronous reference run built from the synchronous trainer's parts, in one process: the config from the
    command line, the rollout given the actor's initial weights (w0), then per step `step(trainer, timer)` -- run
    inside the step's "step" timer, returning (batch, metrics) -- and finish_step. The one-step-off and fully
    asynchronous references differ only in their step bodies."""
    from rlhf_mcore.config import load_config
    from rlhf_mcore.trainer.rl_trainer import PhaseTimer, RLTrainer

    tr = RLTrainer(load_config(None, sys.argv[1:]))
    run, learner, rollout = tr.run, tr.learner, tr.rollout
    try:
        run.open_logger()
        rollout.sync_weights()  # w0
        while run.step < run.total_steps:
            run.step += 1
            t = PhaseTimer()
            with t("step"):
                batch, metrics = step(tr, t)
            run.finish_step(batch, metrics, t, kl_coef=learner.kl_ctrl.value, validate=rollout.validate,
                            save=lambda: run.save_checkpoint(learner), renormalised=rollout.logprobs_renormalised)
    finally:
        tr.close()
