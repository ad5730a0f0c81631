"""Slurm launch helpers: host-list expansion, the per-node torchrun command, the dry run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_mcore.slurm import NodeLaunch, dry_run, expand_nodelist_locally

ROOT = Path(__file__).resolve().parents[1]


def test_expand_nodelist():
    assert expand_nodelist_locally("gpu[01-03,07],login5") == ["gpu01", "gpu02", "gpu03", "gpu07", "login5"]
    assert expand_nodelist_locally("node7") == ["node7"]
    assert expand_nodelist_locally("a[8-10]") == ["a8", "a9", "a10"]


def test_node_command_from_slurm_env():
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "grpo",
           "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_GPUS_ON_NODE": "8", "MASTER_PORT": "29600"}
    node = NodeLaunch.from_env(env)
    cmd = node.torchrun(["--config", "c.yaml", "data.train_batch_size=8"], python="py")
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    for flag in ("--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d", "--rdzv_endpoint=gpu01:29600",
                 "--rdzv_id=77", "--node_rank=1"):
        assert flag in cmd
    i = cmd.index("launch/train.py")
    assert cmd[i + 1:i + 4] == ["--config", "c.yaml", "data.train_batch_size=8"]
    assert cmd[-4:] == ["trainer.nnodes=2", "trainer.n_gpus_per_node=8",
                        "trainer.default_local_dir=outputs/slurm/grpo-77", "trainer.resume_mode=auto"]


def test_missing_slurm_env_says_what_to_do():
    with pytest.raises(RuntimeError, match="run this under srun"):
        NodeLaunch.from_env({})


def test_dry_run_prints_every_node():
    text = dry_run(["--config", "x.yaml"], nnodes=3, nodelist="n[1-3]", nproc_per_node=4, job_id="9")
    assert text.count("torch.distributed.run") == 3 and "--node_rank=2" in text and "n1:" in text
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "slurm" / "node.py"), "--dry-run", "--nnodes", "2",
                           "--nodelist", "gpu[01-02]", "--nproc-per-node", "8", "--", "--config", "c.yaml"],
                          capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "MASTER_PORT"})
    assert proc.returncode == 0, proc.stderr
    assert "# node 1" in proc.stdout and "--rdzv_endpoint=gpu01:29500" in proc.stdout
