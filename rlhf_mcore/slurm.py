"""Per-node launch commands for Slurm: one `torchrun` per node with a c10d rendezvous on the first node.

`launch/slurm/train.sbatch` runs `srun python launch/slurm/node.py -- <train args>` on every node; this module
turns Slurm's environment into that node's exact `torchrun` command (and, with `--dry-run`, prints every
node's). Nothing sits between the user and torchrun/NCCL: the command is plain torchrun.

Resuming: the run directory is keyed by the job id, which Slurm keeps across `--requeue`, so a requeued job
finds its own checkpoints and `trainer.resume_mode=auto` continues from the newest complete one.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from rlhf_mcore.errors import UserError


class SlurmLaunchError(UserError, ValueError):
    """A node count, node list or GPU count that cannot make the launch asked for; the message says which."""


@dataclass(frozen=True)
class NodeLaunch:
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    job_id: str
    run_dir: str

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, nproc_per_node: Optional[int] = None,
                 master_port: int = 29500, run_root: str = "outputs/slurm") -> "NodeLaunch":
        """Read SLURM_* variables (as srun sets them on each node)."""
        try:
            nnodes = int(env.get("SLURM_JOB_NUM_NODES") or env["SLURM_NNODES"])
            node_rank = int(env["SLURM_NODEID"])
            job_id = env["SLURM_JOB_ID"]
        except KeyError as e:
            raise RuntimeError(f"{e.args[0]} is not set: run this under srun inside an sbatch allocation, or pass "
                               f"--dry-run with --nnodes/--nodelist to see the commands") from None
        nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
        gpus = nproc_per_node or _gpus_per_node(env)
        name = env.get("SLURM_JOB_NAME", "rlhf_mcore")
        return cls(nnodes=nnodes, node_rank=node_rank, nproc_per_node=gpus,
                   master_addr=nodes[0] if nodes else "127.0.0.1",
                   master_port=int(env.get("MASTER_PORT", master_port)), job_id=job_id,
                   run_dir=f"{run_root}/{name}-{job_id}")

    def torchrun(self, train_args: Sequence[str], python: str = "python") -> list[str]:
        """The exact command this node runs."""
        return [python, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}",
                f"--nproc_per_node={self.nproc_per_node}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={self.master_addr}:{self.master_port}", f"--rdzv_id={self.job_id}",
                f"--node_rank={self.node_rank}", "launch/train.py", *train_args,
                f"trainer.nnodes={self.nnodes}", f"trainer.n_gpus_per_node={self.nproc_per_node}",
                f"trainer.default_local_dir={self.run_dir}", "trainer.resume_mode=auto"]


def _gpus_per_node(env: Mapping[str, str]) -> int:
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(key, "")
        digits = value.split(":")[-1].split("(")[0]
        if digits.isdigit():
            return int(digits)
    return 1


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (`node[01-03,07],gpu5`) as host names, via scontrol when available."""
    if not nodelist:
        return []
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return expand_nodelist_locally(nodelist)


_HOST_ITEM = re.compile(r"([^\[\],]+)(?:\[(\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)\])?")


def expand_nodelist_locally(nodelist: str) -> list[str]:
    """`prefix[lo-hi,k,...]` items and plain host names, comma-separated; anything else (an unclosed bracket, an
    empty item, a range running backwards) raises SlurmLaunchError naming the list."""
    hosts, i, n = [], 0, len(nodelist)
    while i < n:
        j = i
        depth = 0
        while j < n and (nodelist[j] != "," or depth):
            depth += nodelist[j] == "["
            depth -= nodelist[j] == "]"
            j += 1
        item = nodelist[i:j]
        if not _HOST_ITEM.fullmatch(item):
            raise SlurmLaunchError(f"node list {nodelist!r}: {item!r} is not a host name or prefix[lo-hi,...] "
                                   f"range (e.g. 'gpu[01-02]' or 'gpu01,gpu02')")
        if "[" in item:
            prefix, ranges = item.split("[", 1)
            for part in ranges.rstrip("]").split(","):
                lo, _, hi = part.partition("-")
                if int(hi or lo) < int(lo):
                    raise SlurmLaunchError(f"node list {nodelist!r}: the range {part!r} runs backwards")
                width = len(lo)
                for k in range(int(lo), int(hi or lo) + 1):
                    hosts.append(f"{prefix}{k:0{width}d}")
        else:
            hosts.append(item)
        i = j + 1
    if nodelist.endswith(","):
        raise SlurmLaunchError(f"node list {nodelist!r} ends with a comma")
    return hosts


def check_launch(train_args: Sequence[str], nnodes: int, nodelist: str, nproc_per_node: int) -> None:
    """Everything the login node can check before a job waits in the queue: the node list parses and has `nnodes`
    hosts, the train arguments load through the project's config loader (the --config file exists, every key is
    known and typed), their command-line trainer.nnodes / n_gpus_per_node do not contradict the layout node.py
    appends, and the config passes `validate_config` at world size nnodes x nproc_per_node, as train.py will see
    it. Raises a UserError (one line)."""
    from rlhf_mcore.cli import parse_args
    from rlhf_mcore.config import load_config, model_max_positions, validate_config

    hosts = expand_nodelist(nodelist)
    if nnodes < 1 or nproc_per_node < 1:
        raise SlurmLaunchError(f"--nnodes {nnodes} and --nproc-per-node {nproc_per_node} must be >= 1")
    if hosts and len(hosts) != nnodes:
        raise SlurmLaunchError(f"--nnodes {nnodes} but the node list {nodelist!r} names {len(hosts)} host(s) "
                               f"({', '.join(hosts)}): make them agree (sbatch --nodes={len(hosts)})")
    args = parse_args(list(train_args))
    cfg = load_config(args.config, args.overrides)
    # node.py appends trainer.nnodes / n_gpus_per_node from the allocation: a YAML's values are replaced by design
    # (one config runs on any allocation), but the same key written on this command line contradicting it is a
    # mistake the appended value would silently overrule
    given = dict(o.lstrip("+").split("=", 1) for o in args.overrides)
    for key, launched, fix in (("nnodes", nnodes, "submit with sbatch --nodes={}"),
                               ("n_gpus_per_node", nproc_per_node, "pass --nproc-per-node {}")):
        value = getattr(cfg.trainer, key)
        if f"trainer.{key}" in given and value is not None and value != launched:
            raise SlurmLaunchError(f"trainer.{key}={value} in the train arguments contradicts the launch's {key} "
                                   f"of {launched} (node.py sets trainer.{key}={launched} from the allocation, "
                                   f"which would silently win): remove the key, or {fix.format(value)}")
    cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node = nnodes, nproc_per_node
    validate_config(cfg, nnodes * nproc_per_node, model_max_positions(cfg.actor_rollout_ref.model.path))


def dry_run(train_args: Sequence[str], nnodes: int, nodelist: str, nproc_per_node: int, job_id: str = "<jobid>",
            job_name: str = "rlhf_mcore") -> str:
    """Every node's command, as the sbatch script would run them."""
    lines = []
    for rank in range(nnodes):
        env = {"SLURM_JOB_NUM_NODES": str(nnodes), "SLURM_NODEID": str(rank), "SLURM_JOB_ID": job_id,
               "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_NAME": job_name}
        node = NodeLaunch.from_env(env, nproc_per_node=nproc_per_node, master_port=int(os.environ.get(
            "MASTER_PORT", 29500)))
        lines.append(f"# node {rank}\n" + " ".join(shlex.quote(a) for a in node.torchrun(train_args)))
    return "\n".join(lines)
