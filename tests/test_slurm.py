"""Slurm launch helpers: host-list expansion, the per-node torchrun command, the dry run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_mcore.config import ConfigError
from rlhf_mcore.slurm import NodeLaunch, SlurmLaunchError, check_launch, dry_run, expand_nodelist_locally

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "gsm8k_grpo_qwen2.5_7b_8gpu.yaml")  # sets trainer.nnodes=1, n_gpus_per_node=8


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
                           "--nodelist", "gpu[01-02]", "--nproc-per-node", "8", "--", "--config", CONFIG],
                          capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "MASTER_PORT"})
    assert proc.returncode == 0, proc.stderr
    assert "# node 1" in proc.stdout and "--rdzv_endpoint=gpu01:29500" in proc.stdout


def test_malformed_nodelist_is_refused():
    """Mutation: drop the `_HOST_ITEM.fullmatch` check in `expand_nodelist_locally` -> fails (gpu[01- expanded to
    gpu01)."""
    for bad in ("gpu[01-", "gpu[01-02", "gpu[a-b]", "gpu01,,gpu02", "gpu01,", "gpu[03-01]", "gpu[]"):
        with pytest.raises(SlurmLaunchError, match=r"node list '.*'"):
            expand_nodelist_locally(bad)


def test_dry_run_checks_what_the_login_node_can():
    """Each mistake is one UserError before any command is printed: node count against the node list, a malformed
    list, a command-line trainer.n_gpus_per_node against --nproc-per-node, a missing config file, a misspelt key,
    a batch that the launched world cannot split. The YAML's own trainer.nnodes=1 is replaced by the allocation's,
    as train.sbatch documents (no error). Mutations: drop the `len(hosts) != nnodes` check -> fails; in `check_launch`
    load the config without the --config file and with only the trainer.* overrides -> fails; drop the
    `validate_config` call -> fails."""
    good = ["--config", CONFIG]
    check_launch(good, 2, "gpu[01-02]", 8)
    check_launch(good + ["trainer.n_gpus_per_node=8", "trainer.nnodes=2"], 2, "gpu[01-02]", 8)
    cases = [
        ((good, 3, "gpu[01-02]", 8), SlurmLaunchError, r"--nnodes 3 but the node list 'gpu\[01-02\]' names 2 host"),
        ((good, 2, "gpu[01-", 8), SlurmLaunchError, r"node list 'gpu\[01-': 'gpu\[01-' is not a host name"),
        ((good + ["trainer.n_gpus_per_node=4"], 2, "gpu[01-02]", 8), SlurmLaunchError,
         r"trainer.n_gpus_per_node=4 in the train arguments contradicts the launch's n_gpus_per_node of 8 .*"
         r"remove the key, or pass --nproc-per-node 4"),
        ((good + ["trainer.nnodes=1"], 2, "gpu[01-02]", 8), SlurmLaunchError,
         r"trainer.nnodes=1 .* contradicts .* or submit with sbatch --nodes=1"),
        ((["--config", "missing.yaml"], 2, "gpu[01-02]", 8), ConfigError, r"config file 'missing.yaml' does not exist"),
        ((good + ["data.train_bach_size=64"], 2, "gpu[01-02]", 8), ConfigError,
         r"unknown config key 'data.train_bach_size'.*Did you mean 'data.train_batch_size'"),
        ((good + ["data.train_batch_size=100"], 2, "gpu[01-02]", 8), ConfigError,
         r"data.train_batch_size=100 is not divisible by the data-parallel size 8 \(world 16"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            check_launch(*args)


def test_dry_run_mistake_is_one_line_before_any_command(monkeypatch, capsys):
    """node.py --dry-run with a misspelt key: exit 2, one line, no command printed (it used to print the commands,
    and the job failed after the queue). In this process (runpy), no interpreter start. Mutation: drop the
    `check_launch` call in node.py's dry-run branch -> fails."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["node.py", "--dry-run", "--nnodes", "2", "--nodelist", "gpu[01-02]",
                                      "--nproc-per-node", "8", "--", "--config", CONFIG,
                                      "actor_rollout_ref.rollout.tempreature=0.7"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "launch" / "slurm" / "node.py"), run_name="__main__")
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert e.value.code == 2 and out == "", (e.value.code, out[-2000:], err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("config error: unknown config key "
                                                   "'actor_rollout_ref.rollout.tempreature'"), err
