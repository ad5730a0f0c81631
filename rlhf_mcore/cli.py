"""Command-line front end shared by the launch scripts: ``--config X.yaml [key=value ...] [--print-config]``.

Every entry script runs its body through :func:`report_user_errors`: a problem with the user's input (config,
files, data, reward function; :class:`rlhf_mcore.errors.UserError`) ends with one line on stderr and exit code 2,
without a traceback; config mistakes before any process group or model is created.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable, Optional

from rlhf_mcore.config import RLConfig, load_config, model_max_positions, parallel_layout, to_yaml, validate_config
from rlhf_mcore.errors import UserError
from rlhf_mcore.lifetime import bind_rank_to_launcher
from rlhf_mcore.quiet import silence_known_warnings
from rlhf_mcore.startup import pause_gc, resume_gc

# How long a rank other than 0 waits, after a user error, for rank 0 to report it (torchrun stops every worker
# as soon as one exits, so a rank that exited first could stop rank 0 before its line is out).
PEER_REPORT_WAIT_S = 15.0


def parse_args(argv: Optional[list[str]] = None, description: str = "") -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description,
                                 epilog="Overrides use the config's dotted keys, e.g. data.train_batch_size=256.")
    ap.add_argument("--config", help="YAML run config (configs/*.yaml); omitted: the schema defaults")
    ap.add_argument("--print-config", action="store_true",
                    help="print the resolved config and exit: checked against the process layout it names, with no "
                         "process launched and no model or data file read")
    ap.add_argument("overrides", nargs="*", help="key=value overrides")
    return ap.parse_args(argv)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def config_world_size(cfg: RLConfig) -> int:
    """The process count the config's own layout names, to check it without a launch (`--print-config`):
    trainer.nnodes x trainer.n_gpus_per_node, plus rollout.nnodes x rollout.n_gpus_per_node under async_training.
    A training world the config leaves to the launch counts the fewest processes its layout fits: a multiple of
    trainer.nnodes and of TP x PP (and of the colocated rollout's TP)."""
    t, rp = cfg.trainer, cfg.rollout
    colocated = cfg.async_training.mode == "off"
    if t.n_gpus_per_node is not None:
        train = (t.nnodes or 1) * t.n_gpus_per_node
    else:
        tp, pp, _ = parallel_layout(cfg)
        sizes = [t.nnodes or 1, tp * pp]
        if colocated:
            sizes.append(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)
        train = math.lcm(*(max(s, 1) for s in sizes))  # a bad size (< 1) is validate_config's to report
    rollout = 0 if colocated or rp.n_gpus_per_node is None else (rp.nnodes or 1) * rp.n_gpus_per_node
    return train + rollout


def load_and_validate(args: argparse.Namespace) -> RLConfig:
    """The config of `args`, validated against the launched processes and the model (a launch) or, with
    `--print-config`, against the layout it names, reading no model file (printing needs neither)."""
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        validate_config(cfg, config_world_size(cfg), read_model=False)
    else:
        validate_config(cfg, world_size_from_env(), model_max_positions(cfg.actor_rollout_ref.model.path))
    return cfg


def report_user_errors(fn: Callable[[], Optional[int]]) -> int:
    """Run an entry point's body: a :class:`~rlhf_mcore.errors.UserError` (or a missing file) becomes one line on
    stderr from rank 0 (``<kind>: <message>``) and exit code 2 on every rank; anything else is a bug and keeps
    its traceback. Under torchrun, torchrun then adds its own failure summary (no traceback of ours in it).

    The other ranks wait `PEER_REPORT_WAIT_S` first: rank 0, meeting the same problem, prints and exits, and
    torchrun stops them. One still running after the wait (rank 0 did not meet the problem: it may be waiting
    for this rank in a collective) prints the line itself, prefixed with `[rank N]`, and exits.

    Start-up runs without the cyclic garbage collector (rlhf_mcore/startup.py): the body turns it back on when its
    models are built, or a timer does."""
    pause_gc()
    bind_rank_to_launcher()  # under torchrun: this rank dies with the agent (no orphaned ranks)
    silence_known_warnings()
    try:
        return fn() or 0
    except (UserError, FileNotFoundError) as e:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        kind = getattr(e, "kind", "input error")
        if rank == 0:
            print(f"{kind}: {e}", file=sys.stderr, flush=True)
            return 2
        if world > 1:
            time.sleep(PEER_REPORT_WAIT_S)
        print(f"[rank {rank}] {kind}: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        resume_gc()


def main(run: Callable[[RLConfig], None], argv: Optional[list[str]] = None, description: str = "") -> int:
    args = parse_args(argv, description)

    def body() -> int:
        cfg = load_and_validate(args)
        if args.print_config:
            if int(os.environ.get("RANK", "0")) == 0:
                print(to_yaml(cfg), end="")
            return 0
        run(cfg)
        return 0

    return report_user_errors(body)
