"""The environment of every process a test starts: the caller's, with this checkout first on PYTHONPATH.

Replacing PYTHONPATH by the checkout (``dict(os.environ, PYTHONPATH=ROOT)``) drops what the caller put there: on
machines whose packages come through PYTHONPATH (cluster module systems, ``pip install --target``) the children
then cannot import omegaconf or megatron. Every test builds its children's environment here instead.
"""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_path() -> str:
    """The checkout, then the caller's PYTHONPATH entries (the checkout's own entry not repeated)."""
    caller = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    return os.pathsep.join([str(ROOT), *caller])


def child_env(**extra: str) -> dict[str, str]:
    """The caller's environment with :func:`python_path` as PYTHONPATH and `extra` set on top."""
    return {**os.environ, "PYTHONPATH": python_path(), **extra}
