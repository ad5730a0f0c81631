"""Run (or print) this Slurm node's torchrun command; called by train.sbatch through srun on every node.

    srun python launch/slurm/node.py -- --config configs/X.yaml key=value ...       # exec on each node
    python launch/slurm/node.py --dry-run --nnodes 2 --nodelist 'gpu[01-02]' --nproc-per-node 8 -- --config ...
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlhf_mcore.cli import report_user_errors  # noqa: E402
from rlhf_mcore.slurm import NodeLaunch, check_launch, dry_run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="print every node's command and exit")
    ap.add_argument("--nnodes", type=int, default=None, help="with --dry-run (default: SLURM_JOB_NUM_NODES or 1)")
    ap.add_argument("--nodelist", default=None, help="with --dry-run (default: SLURM_JOB_NODELIST or localhost)")
    ap.add_argument("--nproc-per-node", type=int, default=None, help="default: GPUs Slurm gave this node")
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then launch/train.py's arguments")
    a = ap.parse_args()
    train_args = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    return report_user_errors(lambda: launch(a, train_args))


def launch(a: argparse.Namespace, train_args: list[str]) -> int:
    """Check the node list, node and GPU counts and the train arguments (config file, keys, values) first, so
    that a mistake fails here on the login node (--dry-run) or before torchrun starts, as one line."""
    if a.dry_run:
        nnodes = a.nnodes or int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
        nodelist = a.nodelist or os.environ.get("SLURM_JOB_NODELIST", "localhost")
        check_launch(train_args, nnodes, nodelist, a.nproc_per_node or 8)
        print(dry_run(train_args, nnodes, nodelist, a.nproc_per_node or 8,
                      job_id=os.environ.get("SLURM_JOB_ID", "<jobid>")))
        return 0
    node = NodeLaunch.from_env(os.environ, nproc_per_node=a.nproc_per_node)
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    check_launch(train_args, node.nnodes, nodelist, node.nproc_per_node)
    cmd = node.torchrun(train_args, python=sys.executable)
    print(f"[node {node.node_rank}/{node.nnodes}] " + " ".join(cmd), flush=True)
    os.execvp(cmd[0], cmd)  # torchrun replaces this process: signals from Slurm reach it directly


if __name__ == "__main__":
    sys.exit(main())
