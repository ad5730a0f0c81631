"""Trainer checkpoints: atomic, complete-or-invisible, the last ``k`` kept.

Layout under ``trainer.default_local_dir``::

    global_step_10/            a complete checkpoint (has COMPLETE)
        actor/                 the actor engine's distributed checkpoint (model, optimizer, scheduler, RNG)
        critic/                the critic's, when there is one
        trainer_state.pt       step, sampler state, KL controller, host RNG states (one file per rank)
        COMPLETE               written last, by rank 0, after every rank finished
    global_step_20.tmp-<id>/   a checkpoint being written; never picked up, removed on the next save

A checkpoint is written into a ``.tmp`` directory and renamed into place once every rank has finished, so a
run killed mid-save leaves the previous checkpoint as the newest complete one.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
COMPLETE = "COMPLETE"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def list_complete(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of complete checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / COMPLETE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def resolve_resume(root: str | os.PathLike, resume_mode: str) -> Optional[Path]:
    """``auto``: the newest complete checkpoint under root (None if there is none); ``disable``: None;
    anything else: that checkpoint directory, which must be complete."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        done = list_complete(root)
        return done[-1][1] if done else None
    path = Path(resume_mode)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(
            f"trainer.resume_mode={resume_mode!r}: no complete checkpoint there (a complete one has a {COMPLETE} "
            f"file). Use trainer.resume_mode=auto to pick the newest complete one under {root}.")
    return path


class CheckpointManager:
    """Saves and restores trainer checkpoints; every rank calls :meth:`save` and :meth:`load` together."""

    def __init__(self, root: str | os.PathLike, keep: Optional[int], rank: int, group=None):
        self.root = Path(root)
        self.keep = keep
        self.rank = rank
        self.group = group

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def _shared_name(self, step: int) -> str:
        token = [f"global_step_{step}.tmp-{int(time.time() * 1000)}-{os.getpid()}"]
        if dist.is_initialized():
            dist.broadcast_object_list(token, src=0, group=self.group)
        return token[0]

    def save(self, step: int, trainer_state: dict[str, Any],
             save_engines: Callable[[Path], None]) -> Path:
        """Write everything into a temporary directory, then rename it to ``global_step_<step>``."""
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
        torch.save({**trainer_state, "rng": rng_state()}, tmp / f"trainer_state_rank{self.rank}.pt")
        self._barrier()
        final = self.root / f"global_step_{step}"
        if self.rank == 0:
            (tmp / COMPLETE).write_text(f"step {step}\n")
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

    def load_trainer_state(self, path: Path) -> dict[str, Any]:
        file = path / f"trainer_state_rank{self.rank}.pt"
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing: was the checkpoint written with a different world size?")
        state = torch.load(file, weights_only=False)
        set_rng_state(state.pop("rng"))
        return state
