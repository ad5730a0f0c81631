"""Fault injection on trainer checkpoints: planted pickles never run, damaged checkpoints are skipped with the
reason, a run with changed algorithm settings is refused, metrics are not duplicated by a resume, and a
training checkpoint converts to HF on its own.

The unit tests drive CheckpointManager with a stand-in `save_engines` that writes a torch distributed-checkpoint
`.metadata` and some shard bytes; one end-to-end test runs launch/train.py on a tiny random model."""
import hashlib
import json
import math
import os
import pickle
from pathlib import Path

import pytest
import torch
from launcher import QUIET, run

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

pytestmark = pytest.mark.cost(50)

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


# --------------------------------------------------------------------- what a checkpoint's files may hold

RNG_KEY = "rng_state/shard_0.0.0_1.1.1"  # the ShardedObject Megatron stores a rank's RNG states under


def engine_dir(path: Path, rng) -> Path:
    """A distributed checkpoint as Megatron's torch_dist backend lays it out (`.metadata`, a `.distcp` shard with a
    tensor and the RNG object, `common.pt`, `metadata.json`), written by torch's checkpoint writer without Megatron."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class RawBytes(DefaultSavePlanner):  # as Megatron's planner: the object is already serialized
        def transform_object(self, write_item, object):
            return object

    blob = io.BytesIO()
    torch.save([rng], blob)
    dcp.save({"model.w": torch.arange(6.0).reshape(2, 3), RNG_KEY: blob}, checkpoint_id=str(path), no_dist=True,
             planner=RawBytes())
    meta = pickle.loads((path / ".metadata").read_bytes())  # our own file; as Megatron's writer: no storage_meta
    meta.storage_meta = None
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    torch.save({"layout": {"tp": 1, "pp": 1, "dp": 1}, "scheduler": {"num_steps": 3}}, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    return path


def forge_item(path: Path, key: str, payload: bytes, as_bytes: bool = False) -> Path:
    """Append `payload` to the shard and point the index entry of `key` at it (the index re-pickled from the
    checkpoint-metadata classes only, as a forger would, so it passes the `.metadata` check); returns the shard."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from rlhf_mcore.engine.safe_load import read_metadata

    meta = read_metadata(path / ".metadata")
    index = next(i for i in meta.storage_data if i.fqn == key)
    info = meta.storage_data.pop(index)
    shard = path / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(payload)
    with open(shard, "ab") as f:
        f.write(payload)
    if as_bytes:
        meta.state_dict_metadata[key] = BytesStorageMetadata()
        index = MetadataIndex(key)
    meta.storage_data[index] = info
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    return shard


def tensor_keys_and_objects(path: Path) -> list[str]:
    from rlhf_mcore.engine.safe_load import read_metadata

    return list(read_metadata(path / ".metadata").state_dict_metadata)


def _pickled(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_rng_states_load_as_plain_data_new_and_old_format(tmp_path):
    """The RNG object as this version writes it (tensors and numbers) and as older ones did (Python's tuple,
    numpy's array) load without any pickle class beyond those, and restore the generators."""
    import random

    import numpy as np

    from rlhf_mcore.engine import checkpoint as ec
    from rlhf_mcore.engine.safe_load import load_common, read_object, tensor_keys

    for name in ("new", "old"):
        rng = ec._rng_state() if name == "new" else {"random": random.getstate(), "numpy": np.random.get_state(),
                                                     "torch": torch.get_rng_state(), "tracker": {}}
        path = engine_dir(tmp_path / name, rng)
        want = (random.random(), float(np.random.rand()), float(torch.rand(())))
        state = read_object(path, RNG_KEY)
        assert name == "old" or all(not isinstance(v, np.ndarray) for v in state["numpy_mt"])
        ec._set_rng_state(state)
        assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == want, name
        assert tensor_keys(path) == {"model.w"} and load_common(path)["scheduler"] == {"num_steps": 3}


PLANTED_FILES = ["distcp_object", "distcp_tensor", "tensor_declared_object", ".metadata", "common.pt",
                 "metadata.json", "trainer_state", "config.json"]


@pytest.mark.parametrize("kind", PLANTED_FILES)
def test_pickle_planted_in_any_checkpoint_file_fails_with_one_line_and_runs_nothing(tmp_path, kind):
    """Every kind of file under checkpoints/global_step_N/ with a pickle planted in it (and the index rewritten to
    match where needed): loading it runs nothing (no marker) and fails with one line naming the file. The kinds: an
    object item of a `.distcp` shard (the RNG state), a tensor item of one, a tensor declared an object in the
    index, the index `.metadata` itself, `common.pt` (optimizer param groups, scheduler), Megatron's
    `metadata.json`, the trainer state (step, sampler position, KL controller, host RNG) and the run's
    `config.json`; MANIFEST.json and COMPLETE are read as text only. (hf_meta/ holds JSON and tokenizer files that
    no resume reads.)
    Mutation: `load_plain` with weights_only=False -> distcp_object runs the payload (fails); `_index` without the
    bytes-key check -> tensor_declared_object passes unrefused (fails)."""
    import torch.distributed.checkpoint as dcp

    from rlhf_mcore.engine.safe_load import CheckpointLoadError, load_common, read_object, tensor_keys

    marker = tmp_path / "EXECUTED"
    path = engine_dir(tmp_path / "actor", {"torch": torch.get_rng_state()})
    mgr = make_run(tmp_path / "run", steps=(1,), cfg=config())
    step = tmp_path / "run" / "global_step_1"
    error, file = (CheckpointLoadError, path / "__0_0.distcp")
    if kind == "distcp_object":
        forge_item(path, RNG_KEY, _pickled([Planted(marker)]))
        load = lambda: read_object(path, RNG_KEY)  # noqa: E731
    elif kind == "distcp_tensor":  # torch reads tensors with weights_only=True
        forge_item(path, "model.w", _pickled(Planted(marker)))
        error, file = (BaseException, None)  # torch's CheckpointException; load_distributed makes it one line
        load = lambda: dcp.load({"model.w": torch.zeros(2, 3)}, checkpoint_id=str(path), no_dist=True)  # noqa: E731
    elif kind == "tensor_declared_object":
        forge_item(path, "model.w", _pickled(Planted(marker)), as_bytes=True)
        file, load = path / ".metadata", lambda: tensor_keys(path)
    elif kind in (".metadata", "common.pt", "metadata.json"):
        file = path / kind
        file.write_bytes(pickle.dumps(Planted(marker)) if kind != "common.pt" else _pickled({"evil": Planted(marker)}))
        load = (lambda: load_common(path)) if kind == "common.pt" else (lambda: tensor_keys(path))
    elif kind == "trainer_state":
        error, file = CheckpointError, step / "trainer_state_rank0.json"
        file.write_bytes(pickle.dumps(Planted(marker)))
        load = lambda: mgr.load_trainer_state(step)  # noqa: E731
    else:
        error, file = CheckpointError, step / "config.json"
        file.write_bytes(pickle.dumps(Planted(marker)))
        load = lambda: check_resume_config(step, config(), ignore_changes=False)  # noqa: E731
    with pytest.raises(error) as err:
        load()
    assert not marker.exists(), "a planted pickle was executed"
    if file is not None:
        msg = str(err.value)
        assert "\n" not in msg and str(file) in msg and "forged or damaged" in msg, msg


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


def test_resume_puts_the_configs_optimizer_settings_in_effect_at_the_checkpoints_step():
    """The checkpoint's scheduler (constant 1e-6, 4 steps done) and param groups (as torch's load_state_dict leaves
    them) under a new config (lr 0.1 with 10 warm-up steps then linear decay, weight decay 0.1, other betas): the
    config's settings are in effect at step 4, each change named; an unchanged config changes nothing.
    Mutation: drop `group[key] = value` in resume_schedule -> the groups keep max_lr 1e-6 and the old betas (fails)."""
    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine.optim import build_scheduler, group_settings, resume_schedule

    def engine(optim):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=optim.lr, betas=tuple(optim.betas),
                                eps=optim.eps)
        opt.param_groups[0].update(max_lr=optim.lr, min_lr=optim.lr * optim.min_lr_ratio)  # as Megatron's groups
        return opt, build_scheduler(opt, optim)

    old = OptimConfig(lr=1e-6, total_training_steps=20)
    saved_opt, saved_sched = engine(old)
    saved_sched.step(4)
    saved_schedule, saved_group = saved_sched.state_dict(), dict(saved_opt.param_groups[0])
    new = OptimConfig(lr=0.1, lr_warmup_steps=10, lr_scheduler="linear", weight_decay=0.1, betas=[0.8, 0.99],
                      total_training_steps=20)
    for optim, want_changes, want_lr in ((new, 5, 0.1 * 4 / 10), (old, 0, 1e-6)):
        opt, sched = engine(optim)
        config_groups = group_settings(opt)
        opt.param_groups[0].update({k: v for k, v in saved_group.items() if k != "params"})  # the load
        changes = resume_schedule(opt, sched, saved_schedule, config_groups)
        group = opt.param_groups[0]
        assert sched.num_steps == 4 and group["lr"] == pytest.approx(want_lr) and len(changes) == want_changes, changes
        assert group["betas"] == tuple(optim.betas) and group["weight_decay"] == pytest.approx(optim.weight_decay)
    assert changes == []
    opt, sched = engine(new)
    changes = resume_schedule(opt, sched, saved_schedule, group_settings(opt))
    assert "lr: 1e-06 -> 0.1" in changes and "warmup steps: 0 -> 10" in changes
    assert "lr_scheduler: 'constant' -> 'linear'" in changes and "weight_decay: 0.01 -> 0.1" in changes


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


def _train(args, check=True):
    return run("launch/train.py", *args, check=check, timeout=900, env_extra=QUIET)


@pytest.mark.slow
def test_resume_through_train_py_skips_planted_and_damaged_checkpoints(tmp_path):
    """Three steps with a checkpoint each; the newest gets a planted `.metadata` (manifest forged to match), the
    next a planted trainer-state pickle. The rerun, with a new learning rate and schedule, reports both, resumes at
    step 1 without running either, leaves one record per step, trains at the new schedule's LR from the checkpoint's
    step count (logged, and named on one line at resume) to other weights. A pickle then forged into the RNG item of
    global_step_3's `.distcp` (manifest rewritten) fails the next resume with one line naming the shard and runs
    nothing; a changed adv_estimator is refused; global_step_3 converts to HF with nothing else.
    (An unchanged LR resumes to exactly the uninterrupted run: test_trainer.py's SIGKILL-and-resume test.)
    Mutation: `resume_schedule` skipped (the checkpoint's scheduler loaded as before) -> actor/lr stays 3e-4 (fails);
    `load_distributed` replaced by `dist_checkpointing.load` -> the forged pickle runs (fails)."""
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

    from safetensors.torch import load_file

    def final_weights():
        return {k: v for f in sorted((out / "hf_final").glob("*.safetensors")) for k, v in load_file(f).items()}

    uninterrupted = final_weights()
    # the resume changes the optimizer's settings (lr 3e-4 constant -> 1e-2 cosine to 1e-3): they take effect
    new_lr = ["actor_rollout_ref.actor.optim.lr=0.01", "actor_rollout_ref.actor.optim.lr_scheduler=cosine",
              "actor_rollout_ref.actor.optim.min_lr_ratio=0.1"]
    proc = _train([*args, *new_lr])
    assert not marker.exists(), "a planted pickle was executed"
    assert f"checkpoint {ckpts / 'global_step_3'} is unusable (actor/.metadata: not a plain" in proc.stderr
    assert f"checkpoint {ckpts / 'global_step_2'} is unusable (unexpected file trainer_state_rank0.pt" in proc.stderr
    assert f"resumed from {ckpts / 'global_step_1'} at step 1" in proc.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
    # the new schedule at the checkpoint's step count: cosine over 3 steps, the LR of step k is that after k-1
    cosine = [0.001 + 0.009 * 0.5 * (1 + math.cos(math.pi * n / 3)) for n in (1, 2)]
    assert [r["actor/lr"] for r in rows if r["kind"] == "train"] == pytest.approx([3e-4, *cosine], rel=1e-6)
    line = next(x for x in proc.stdout.splitlines() if x.startswith(f"{ckpts / 'global_step_1' / 'actor'}: "))
    assert "optimizer resumed at scheduler step 1, LR in effect 0.00775;" in line, line
    assert "lr: 0.0003 -> 0.01" in line and "lr_scheduler: 'constant' -> 'cosine'" in line and "min_lr" in line
    assert "betas" not in line and "eps" not in line  # unchanged settings are not named
    resumed = final_weights()
    assert any(not torch.equal(resumed[k], uninterrupted[k]) for k in resumed)

    # a forged checkpoint: a pickle in the RNG item of a .distcp shard, the manifest rewritten by our own writer;
    # auto-resume takes it (the manifest is valid), and it fails to load with one line naming the file, running nothing
    rng_key = next(k for k in tensor_keys_and_objects(ckpts / "global_step_3" / "actor") if k.startswith("rng_state/"))
    shard = forge_item(ckpts / "global_step_3" / "actor", rng_key, _pickled([Planted(marker)]))
    write_manifest(ckpts / "global_step_3", 3)
    forged = _train([*args, *new_lr], check=False)
    assert not marker.exists(), "the forged checkpoint's pickle was executed"
    err = [x for x in forged.stderr.splitlines() if x.strip() and "warn" not in x.lower()]
    assert forged.returncode == 2 and "Traceback" not in forged.stderr, forged.stderr[-3000:]
    assert any(x.startswith("input error: checkpoint file") and str(shard) in x and "forged or damaged" in x
               for x in err), err[-5:]

    refused = _train([*args, "algorithm.adv_estimator=rloo"], check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "algorithm.adv_estimator: 'grpo' -> 'rloo'" in refused.stderr

    hf = tmp_path / "hf_step_3"  # the model converts: the forged RNG item is not read
    conv = run("launch/convert_checkpoint.py", "--direction", "mcore2hf", "--mcore-dir", str(ckpts / "global_step_3"),
               "--out-hf-dir", str(hf), "--device", "cpu", check=False, env_extra=QUIET)
    assert conv.returncode == 0, conv.stderr[-4000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(hf)
    assert AutoTokenizer.from_pretrained(hf).chat_template
    final = final_weights()
    state = loaded.state_dict()
    assert final and all(torch.equal(state[k].to(v.dtype), v) for k, v in final.items())
