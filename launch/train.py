"""Train with PPO/GRPO:  torchrun --nproc_per_node=N launch/train.py --config configs/X.yaml [key=value ...]

`python launch/train.py ...` runs as a single process. `--print-config` prints the resolved config and exits
(checked against the layout it names: no process launched, no model or data file read).
"""
import sys

from rlhf_mcore.cli import main


def run(cfg):
    from rlhf_mcore.trainer import train

    train(cfg)


if __name__ == "__main__":  # the guard matters: dist_checkpointing's writer spawns processes
    sys.exit(main(run, description=__doc__))
