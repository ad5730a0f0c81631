"""Fault injection on trainer checkpoints: planted pickles never run, damaged checkpoints are skipped with the
reason, a run with changed algorithm settings is refused, metrics are not duplicated by a resume, and a
training checkpoint converts to HF on its own.

The unit tests drive CheckpointManager with a stand-in `save_engines` that writes a torch distributed-checkpoint
`.metadata` and some shard bytes; one end-to-end test runs launch/train.py on a tiny random model."""
import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from subprocess_env import child_env

from rlhf_mcore.config import ConfigError, load_config, to_dict
from rlhf_mcore.trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    algorithm_changes,
    check_resume_config,
    list_complete,
    resolve_resume,
)
from rlhf_mcore.trainer.logging import MetricLogger
from rlhf_mcore.trainer.manifest import MANIFEST, verify_checkpoint, write_manifest

ROOT = Path(__file__).resolve().parents[1]


class Planted:
    """Unpickling this creates the file `marker`: proof that a loader executed the pickle."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def fake_engines(path: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    (path / "actor").mkdir()
    (path / "actor" / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
    (path / "actor" / "__0_0.distcp").write_bytes(os.urandom(3000))


def config(*overrides: str) -> dict:
    return to_dict(load_config(None, ["actor_rollout_ref.model.path=/models/m", *overrides]))


def make_run(root: Path, steps=(1, 2, 3), cfg=None) -> CheckpointManager:
    mgr = CheckpointManager(root, keep=None, rank=0)
    for step in steps:
        mgr.save(step, {"step": step, "sampler": {"position": step}}, fake_engines, config=cfg)
    return mgr


def test_trainer_state_is_json_and_manifest_covers_every_file(tmp_path):
    make_run(tmp_path, steps=(1,), cfg=config())
    ckpt = tmp_path / "global_step_1"
    state = json.loads((ckpt / "trainer_state_rank0.json").read_text())  # plain JSON, RNG states included
    assert state["step"] == 1 and set(state["rng"]) >= {"python", "numpy", "torch"}
    assert not list(ckpt.rglob("*.pt"))
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert sorted(files) == ["actor/.metadata", "actor/__0_0.distcp", "config.json", "trainer_state_rank0.json"]
    data = (ckpt / "actor" / "__0_0.distcp").read_bytes()
    assert files["actor/__0_0.distcp"] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(ckpt) is None


def test_planted_pickles_are_never_executed(tmp_path):
    marker = tmp_path / "EXECUTED"
    mgr = make_run(tmp_path / "run")
    step3, step2 = tmp_path / "run" / "global_step_3", tmp_path / "run" / "global_step_2"
    # newest: a malicious .metadata, with the manifest and marker rewritten to match (a forger with write access)
    (step3 / "actor" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    write_manifest(step3, 3)
    # next: the old pickle trainer state planted next to the JSON one, manifest left alone
    torch.save({"evil": Planted(marker)}, step2 / "trainer_state_rank0.pt")
    reports = []
    path = resolve_resume(tmp_path / "run", "auto", report=reports.append)
    assert path.name == "global_step_1"
    assert len(reports) == 2
    assert str(step3) in reports[0] and "actor/.metadata: not a plain checkpoint-metadata pickle" in reports[0]
    assert str(step2) in reports[1] and "unexpected file trainer_state_rank0.pt" in reports[1]
    assert mgr.load_trainer_state(path)["step"] == 1
    # a JSON trainer state can hold no code: one replaced by a pickle (manifest forged too) fails to parse
    (step2 / "trainer_state_rank0.pt").unlink()
    (step2 / "trainer_state_rank0.json").write_bytes(pickle.dumps(Planted(marker)))
    write_manifest(step2, 2)
    with pytest.raises(ValueError):
        mgr.load_trainer_state(step2)
    assert not marker.exists(), "a planted pickle was executed"


@pytest.mark.parametrize("damage,reason", [
    ("truncate_shard", "actor/__0_0.distcp has 1000 bytes, MANIFEST.json says 3000"),
    ("truncate_state", "trainer_state_rank0.json has"),
    ("flip_byte", "actor/__0_0.distcp does not match its SHA-256"),
    ("edit_manifest", "MANIFEST.json does not match the hash in COMPLETE"),
    ("no_marker", "incomplete: no COMPLETE marker"),
])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage, reason):
    make_run(tmp_path)
    newest = tmp_path / "global_step_3"
    shard, state = newest / "actor" / "__0_0.distcp", newest / "trainer_state_rank0.json"
    if damage == "truncate_shard":
        shard.write_bytes(shard.read_bytes()[:1000])
    elif damage == "truncate_state":
        state.write_text(state.read_text()[:50])
    elif damage == "flip_byte":
        data = bytearray(shard.read_bytes())
        data[1234] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "edit_manifest":  # a hash changed to match a swapped file, the marker left alone
        manifest = json.loads((newest / MANIFEST).read_text())
        manifest["files"]["actor/__0_0.distcp"]["sha256"] = "0" * 64
        (newest / MANIFEST).write_text(json.dumps(manifest))
    else:
        (newest / "COMPLETE").unlink()
    reports = []
    assert resolve_resume(tmp_path, "auto", report=reports.append).name == "global_step_2"
    assert len(reports) == 1 and str(newest) in reports[0] and reason in reports[0], reports
    with pytest.raises(CheckpointError, match="not a usable checkpoint"):  # named explicitly: no fallback
        resolve_resume(tmp_path, str(newest))


def test_no_usable_checkpoint_is_a_one_line_user_error(tmp_path, monkeypatch, capsys):
    from rlhf_mcore import cli

    mgr = make_run(tmp_path, steps=(1, 2), cfg=config())
    (tmp_path / "global_step_2" / "actor" / "__0_0.distcp").unlink()
    (tmp_path / "global_step_1" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as err:
        mgr.resume_point("auto")
    assert isinstance(err.value, ConfigError)
    msg = str(err.value)
    assert "no usable checkpoint under" in msg and "trainer.resume_mode=disable" in msg
    assert "global_step_2: missing file actor/__0_0.distcp" in msg and "global_step_1: config.json has" in msg
    # through the launch scripts' front end: exit code 2, one line, no traceback
    monkeypatch.setattr(cli, "load_and_validate", lambda args: None)
    capsys.readouterr()
    assert cli.main(lambda cfg: mgr.resume_point("auto"), argv=[]) == 2
    err_lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("config error:")]
    assert len(err_lines) == 1 and "no usable checkpoint" in err_lines[0]
    assert resolve_resume(tmp_path / "empty", "auto") is None  # no checkpoint at all: a fresh start


def test_resume_with_changed_algorithm_is_refused_unless_forced(tmp_path):
    saved = config("algorithm.adv_estimator=grpo", "trainer.total_training_steps=10")
    mgr = make_run(tmp_path, steps=(2,), cfg=saved)
    # bookkeeping may change
    same = config("algorithm.adv_estimator=grpo", "trainer.total_training_steps=50", "trainer.save_freq=5",
                  "trainer.logger=[jsonl]", "trainer.resume_mode=auto", "trainer.experiment_name=again")
    assert mgr.resume_point("auto", same).name == "global_step_2"
    changed = config("algorithm.adv_estimator=rloo", "actor_rollout_ref.actor.kl_loss_coef=0.5",
                     "trainer.total_training_steps=10")
    with pytest.raises(CheckpointError) as err:
        mgr.resume_point("auto", changed)
    msg = str(err.value)
    assert "algorithm.adv_estimator: 'grpo' -> 'rloo'" in msg
    assert "actor_rollout_ref.actor.kl_loss_coef: 0.001 -> 0.5" in msg
    assert "trainer.resume_ignore_config_changes=true" in msg and "total_training_steps" not in msg
    reports = []
    path = tmp_path / "global_step_2"
    check_resume_config(path, changed, ignore_changes=True, report=reports.append)
    assert len(reports) == 1 and "algorithm.adv_estimator: 'grpo' -> 'rloo'" in reports[0]
    assert mgr.resume_point("auto", changed, ignore_config_changes=True) == path
    assert algorithm_changes(config(), config("actor_rollout_ref.rollout.n=4", "data.train_batch_size=8")) == [
        "actor_rollout_ref.rollout.n: 1 -> 4", "data.train_batch_size: 1024 -> 8"]


def test_metrics_jsonl_is_cut_back_to_the_resumed_step(tmp_path):
    log = MetricLogger(["jsonl"], tmp_path, total_steps=5)
    log.log(0, {"val/acc": 0.1}, kind="val")
    for step in (1, 2, 3):
        log.log(step, {"actor/pg_loss": float(step)})
    log.log(2, {"val/acc": 0.2}, kind="val")
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "kind": "tr')  # the record a kill cut short
    log = MetricLogger(["jsonl"], tmp_path, total_steps=5, start_step=2)  # resumed from global_step_2
    for step in (3, 4, 5):
        log.log(step, {"actor/pg_loss": 10.0 + step})
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["actor/pg_loss"]) for r in rows if r["kind"] == "train"]
    assert train == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    assert [r["step"] for r in rows if r["kind"] == "val"] == [0, 2]
    MetricLogger(["jsonl"], tmp_path, total_steps=5, start_step=0).close()  # a fresh start in the same directory
    assert (tmp_path / "metrics.jsonl").read_text() == ""


# ------------------------------------------------------------------------------------------------ end to end


def _env():
    return child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")


def _train(args, check=True):
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


@pytest.mark.slow
def test_resume_through_train_py_skips_planted_and_damaged_checkpoints(tmp_path):
    """Three steps with a checkpoint each; the newest gets a planted `.metadata` (manifest forged to match), the
    next a planted trainer-state pickle. The rerun reports both, resumes at step 1 without running either, leaves
    one record per step, refuses a changed adv_estimator, and global_step_3 converts to HF with nothing else."""
    from rlhf_mcore.data import write_synthetic_parquet
    from rlhf_mcore.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", arch="qwen2", layers=1, hidden=64, heads=2, kv_heads=1, seed=0)
    write_synthetic_parquet(tmp_path / "syn", n=64, difficulty=0, seed=0, n_test=4)
    out = tmp_path / "run"
    args = ["--config", str(ROOT / "configs" / "demo_cpu.yaml"), f"actor_rollout_ref.model.path={model}",
            f"data.train_files=[{tmp_path / 'syn' / 'train.parquet'}]", "data.val_files=[]",
            f"trainer.default_local_dir={out}", "trainer.total_training_steps=3", "trainer.logger=[jsonl]",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=1",
            "trainer.max_actor_ckpt_to_keep=null", "trainer.n_gpus_per_node=1", "data.train_batch_size=2",
            "data.max_response_length=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_epochs=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]
    _train(args)
    ckpts = out / "checkpoints"
    assert [s for s, _ in list_complete(ckpts)] == [1, 2, 3]
    assert (ckpts / "global_step_3" / "actor" / "hf_meta" / "config.json").is_file()
    marker = tmp_path / "EXECUTED"
    (ckpts / "global_step_3" / "actor" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    write_manifest(ckpts / "global_step_3", 3)
    torch.save({"evil": Planted(marker)}, ckpts / "global_step_2" / "trainer_state_rank0.pt")

    proc = _train(args)
    assert not marker.exists(), "a planted pickle was executed"
    assert f"checkpoint {ckpts / 'global_step_3'} is unusable (actor/.metadata: not a plain" in proc.stderr
    assert f"checkpoint {ckpts / 'global_step_2'} is unusable (unexpected file trainer_state_rank0.pt" in proc.stderr
    assert f"resumed from {ckpts / 'global_step_1'} at step 1" in proc.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]

    refused = _train([*args, "algorithm.adv_estimator=rloo"], check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "algorithm.adv_estimator: 'grpo' -> 'rloo'" in refused.stderr

    hf = tmp_path / "hf_step_3"
    conv = subprocess.run([sys.executable, str(ROOT / "launch" / "convert_checkpoint.py"), "--direction", "mcore2hf",
                           "--mcore-dir", str(ckpts / "global_step_3"), "--out-hf-dir", str(hf), "--device", "cpu"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert conv.returncode == 0, conv.stderr[-4000:]
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(hf)
    assert AutoTokenizer.from_pretrained(hf).chat_template
    final = {k: v for f in sorted((out / "hf_final").glob("*.safetensors")) for k, v in load_file(f).items()}
    state = loaded.state_dict()
    assert final and all(torch.equal(state[k].to(v.dtype), v) for k, v in final.items())
