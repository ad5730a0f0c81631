"""Command-line front end shared by the launch scripts: ``--config X.yaml [key=value ...] [--print-config]``.

Config mistakes end with the message of :class:`rlhf_mcore.config.ConfigError` on stderr and exit code 2,
without a traceback, before any process group or model is created.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

from rlhf_mcore.config import ConfigError, RLConfig, load_config, model_max_positions, to_yaml, validate_config
from rlhf_mcore.lifetime import bind_rank_to_launcher


def parse_args(argv: Optional[list[str]] = None, description: str = "") -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description,
                                 epilog="Overrides use the config's dotted keys, e.g. data.train_batch_size=256.")
    ap.add_argument("--config", help="YAML run config (configs/*.yaml); omitted: the schema defaults")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    ap.add_argument("overrides", nargs="*", help="key=value overrides")
    return ap.parse_args(argv)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def load_and_validate(args: argparse.Namespace) -> RLConfig:
    cfg = load_config(args.config, args.overrides)
    path = cfg.actor_rollout_ref.model.path
    validate_config(cfg, world_size_from_env(), model_max_positions(path))
    return cfg


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "fix your input" (bad config, missing files, malformed data rows): shown without a
    traceback. Anything else is a bug and keeps its traceback."""
    from rlhf_mcore.data import DataError

    return (ConfigError, FileNotFoundError, DataError)


def main(run: Callable[[RLConfig], None], argv: Optional[list[str]] = None, description: str = "") -> int:
    bind_rank_to_launcher()  # under torchrun: this rank dies with the agent (no orphaned ranks)
    args = parse_args(argv, description)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        cfg = load_and_validate(args)
        if args.print_config:
            if rank0:
                print(to_yaml(cfg), end="")
            return 0
        run(cfg)
    except _user_errors() as e:
        if rank0:
            kind = "config error" if isinstance(e, ConfigError) else "input error"
            print(f"{kind}: {e}", file=sys.stderr)
        return 2
    return 0
