"""Trainer checkpoints: atomic, verified before use, the last ``k`` kept; resume falls back past broken ones.

Layout under ``trainer.default_local_dir``::

    global_step_10/                 a complete checkpoint
        actor/                      the actor engine's distributed checkpoint (model, optimizer, scheduler, RNG)
            hf_meta/                its HF config.json, tokenizer and chat template (for convert_checkpoint.py)
        critic/                     the critic's, when there is one
        trainer_state_rank<r>.json  step, sampler state, KL controller, host RNG states (one file per rank)
        config.json                 the run's resolved config
        MANIFEST.json               size and SHA-256 of every file above (rlhf_mcore.trainer.manifest)
        COMPLETE                    written last, by rank 0, after every rank finished; names the manifest's hash
    global_step_20.tmp-<id>/        a checkpoint being written; never picked up, removed on the next save

A checkpoint is written into a ``.tmp`` directory and renamed into place once every rank has finished, so a
run killed mid-save leaves the previous checkpoint as the newest complete one. Nothing in a checkpoint is
unpickled before its manifest has been checked, and nothing in it is unpickled beyond tensors and plain data
(:mod:`rlhf_mcore.engine.safe_load`); the trainer's own state (step, sampler, KL controller, host RNG) is JSON.

Resuming (``trainer.resume_mode=auto``) takes the newest checkpoint that passes
:func:`rlhf_mcore.trainer.manifest.verify_checkpoint`; each newer one that fails is reported on one line. A
checkpoint saved with different algorithm settings (:data:`ALGORITHM_KEYS`) is refused unless
``trainer.resume_ignore_config_changes=true``.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from rlhf_mcore.config import ConfigError
from rlhf_mcore.trainer.manifest import COMPLETE, verify_checkpoint, write_manifest

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
CONFIG_FILE = "config.json"
IGNORE_CHANGES_KEY = "trainer.resume_ignore_config_changes"

# Config keys (a key or a whole section) whose change alters what is being optimized: a run resumed with a
# different value would continue a different experiment from the old one's weights. Bookkeeping (step counts,
# epochs, save/test frequency, loggers, resume mode, names, output paths), learning rates, micro-batching and
# the parallel layout may change on resume.
ALGORITHM_KEYS = (
    "algorithm", "async_training.mode",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.actor.policy_loss", "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.loss_scale_factor", "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_low", "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c", "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type", "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.use_rollout_log_probs",
    "actor_rollout_ref.rollout.n",
    "critic.enable", "critic.model.path", "critic.cliprange_value", "critic.loss_agg_mode",
    "data.train_batch_size",
    "reward.custom_reward_function", "reward.reward_model",
)


class CheckpointError(ConfigError):
    """No usable checkpoint, or one that this run's config may not resume; the message says what to do."""


# ------------------------------------------------------------------------------------------------ host RNG


def rng_state() -> dict[str, Any]:
    """The host RNG states as JSON values (lists, ints, floats, hex strings)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "torch": torch.get_rng_state().numpy().tobytes().hex()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes().hex()
    return state


def _byte_tensor(hex_str: str) -> torch.Tensor:
    return torch.frombuffer(bytearray.fromhex(hex_str), dtype=torch.uint8).clone()


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_byte_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_byte_tensor(state["cuda"]))


def read_json(file: Path) -> dict:
    """A checkpoint's JSON object (trainer state, config); CheckpointError naming the file if it is anything else."""
    try:
        value = json.loads(file.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not JSON ({type(e).__name__}: {e}); it is forged or damaged: resume from "
                              f"another checkpoint") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file} holds a JSON {type(value).__name__}, not an object; it is forged or damaged: "
                              f"resume from another checkpoint")
    return value


# ------------------------------------------------------------------------------------------------ finding one


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every ``global_step_N`` directory under root, complete or not, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def list_complete(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints under root that have their COMPLETE marker, oldest first (not verified)."""
    return [(s, p) for s, p in list_checkpoints(root) if (p / COMPLETE).is_file()]


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def resolve_resume(root: str | os.PathLike, resume_mode: str,
                   report: Callable[[str], None] = _warn) -> Optional[Path]:
    """The checkpoint to resume from, verified (see :func:`verify_checkpoint`).

    ``auto``: the newest usable checkpoint under root; each newer unusable one is reported through `report`
    (path and reason, one line); None when root has no checkpoint at all; :class:`CheckpointError` when it has
    some but none is usable. ``disable``: None. Anything else: that checkpoint directory, which must be usable.
    """
    if resume_mode == "disable":
        return None
    if resume_mode != "auto":
        path = Path(resume_mode)
        problem = verify_checkpoint(path) if path.is_dir() else "no such directory"
        if problem:
            raise CheckpointError(
                f"trainer.resume_mode={resume_mode!r} is not a usable checkpoint: {problem}. Use "
                f"trainer.resume_mode=auto to pick the newest usable one under {root}.")
        return path
    rejected = []
    for _, path in reversed(list_checkpoints(root)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        report(f"checkpoint {path} is unusable ({problem}); trying the previous one")
        rejected.append(f"{path.name}: {problem}")
    if rejected:
        raise CheckpointError(
            f"no usable checkpoint under {root} ({'; '.join(rejected)}). Remove or repair them, point "
            f"trainer.resume_mode at a good checkpoint, or set trainer.resume_mode=disable to start from step 0.")
    return None


# ------------------------------------------------------------------------------------------------ config check


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _is_algorithm_key(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in ALGORITHM_KEYS)


_ABSENT = "<absent>"


def algorithm_changes(saved: dict, current: dict) -> list[str]:
    """``"key: old -> new"`` for every algorithm-changing key (:data:`ALGORITHM_KEYS`) that differs."""
    old, new = _flatten(saved), _flatten(current)
    keys = sorted(k for k in set(old) | set(new) if _is_algorithm_key(k))
    return [f"{k}: {old.get(k, _ABSENT)!r} -> {new.get(k, _ABSENT)!r}" for k in keys
            if old.get(k, _ABSENT) != new.get(k, _ABSENT)]


def check_resume_config(path: Path, config: dict, ignore_changes: bool,
                        report: Callable[[str], None] = _warn) -> None:
    """Refuse (CheckpointError) to resume `path` under a config whose algorithm settings differ from the saved
    run's, unless `ignore_changes`; then the differences are reported instead."""
    file = path / CONFIG_FILE
    if not file.is_file():
        return
    current = json.loads(json.dumps(config, default=str))  # compared as saved: tuples are lists, keys strings
    changes = algorithm_changes(read_json(file), current)
    if not changes:
        return
    if ignore_changes:
        report(f"resuming {path} with changed algorithm settings ({IGNORE_CHANGES_KEY}=true): {'; '.join(changes)}")
        return
    raise CheckpointError(
        f"refusing to resume {path}: it was saved with different algorithm settings ({'; '.join(changes)}). "
        f"Use another trainer.default_local_dir for a new experiment, set trainer.resume_mode=disable to start "
        f"over here, or set {IGNORE_CHANGES_KEY}=true to resume anyway.")


# ------------------------------------------------------------------------------------------------ the manager


class CheckpointManager:
    """Saves and restores trainer checkpoints; every rank calls :meth:`save`, :meth:`resume_point` and
    :meth:`load_trainer_state` together. The directory must be on a filesystem all ranks share."""

    def __init__(self, root: str | os.PathLike, keep: Optional[int], rank: int, group=None):
        self.root = Path(root)
        self.keep = keep
        self.rank = rank
        self.group = group

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def _from_rank0(self, value):
        box = [value]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _shared_name(self, step: int) -> str:
        return self._from_rank0(f"global_step_{step}.tmp-{int(time.time() * 1000)}-{os.getpid()}")

    def save(self, step: int, trainer_state: dict[str, Any], save_engines: Callable[[Path], None],
             config: Optional[dict] = None) -> Path:
        """Write everything into a temporary directory, hash it into the manifest, then rename it to
        ``global_step_<step>``. `trainer_state` must be JSON-serializable; `config` (the resolved run config)
        is recorded for the resume check."""
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("global_step_*.tmp-*"):  # left by a run killed mid-save
                shutil.rmtree(stale, ignore_errors=True)
        self._barrier()
        tmp = self.root / self._shared_name(step)
        if self.rank == 0:
            tmp.mkdir(parents=True)
        self._barrier()
        save_engines(tmp)
        state_json = json.dumps({**trainer_state, "rng": rng_state()})
        (tmp / f"trainer_state_rank{self.rank}.json").write_text(state_json + "\n")
        if self.rank == 0 and config is not None:
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1, sort_keys=True, default=str) + "\n")
        self._barrier()  # every rank's files are written: rank 0 hashes them all (shared filesystem)
        final = self.root / f"global_step_{step}"
        if self.rank == 0:
            write_manifest(tmp, step)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        self._barrier()
        return final

    def _prune(self) -> None:
        if not self.keep or self.keep <= 0:
            return
        done = list_complete(self.root)
        for _, path in done[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    def resume_point(self, resume_mode: str, config: Optional[dict] = None,
                     ignore_config_changes: bool = False) -> Optional[Path]:
        """The verified checkpoint to resume from (None: start fresh), chosen and checked on rank 0 (which alone
        reports), the same on every rank. Raises CheckpointError on every rank when there is none to use."""
        choice = error = failure = None
        if self.rank == 0:
            try:
                path = resolve_resume(self.root, resume_mode)
                if path is not None and config is not None:
                    check_resume_config(path, config, ignore_config_changes)
                choice = str(path) if path is not None else None
            except Exception as e:  # every rank must leave the broadcast below, then fail too
                failure, error = e, (isinstance(e, CheckpointError), str(e))
        choice, error = self._from_rank0((choice, error))
        if failure is not None:
            raise failure
        if error is not None:
            user_error, message = error
            raise CheckpointError(message) if user_error else RuntimeError(f"rank 0 failed to pick the checkpoint "
                                                                           f"to resume: {message}")
        return Path(choice) if choice is not None else None

    def load_trainer_state(self, path: Path) -> dict[str, Any]:
        """This rank's trainer state (JSON) from a verified checkpoint; restores the host RNGs."""
        file = path / f"trainer_state_rank{self.rank}.json"
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: was the checkpoint written with a different world size? "
                                  "Resume with the saving run's number of processes.")
        state = read_json(file)
        try:
            set_rng_state(state.pop("rng"))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{file}: its host RNG states cannot be restored ({type(e).__name__}: {e}); it is "
                                  f"forged or damaged: resume from another checkpoint") from None
        return state


__all__ = ["CheckpointManager", "CheckpointError", "ALGORITHM_KEYS", "resolve_resume", "list_complete",
           "list_checkpoints", "algorithm_changes", "check_resume_config", "rng_state", "set_rng_state", "COMPLETE"]
