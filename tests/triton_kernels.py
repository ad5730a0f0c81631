"""Importing a Triton kernel module for tests: compiled on a GPU, under the Triton interpreter on CPU.

`TRITON_INTERPRET=1` must be set before the `@triton.jit` decorators run (triton decides interpreted vs compiled
at decoration time), so without CUDA it is set before triton is imported; a test file whose session imported
triton earlier without it skips itself (run it in its own pytest process).
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch


def import_kernel_module(name: str):
    """`rlhf_mcore.kernels.<name>`; without CUDA, with its kernels (and triton's own jit functions) interpreted."""
    reason = f"rlhf_mcore.kernels.{name} needs `triton` (pip install '.[dev]')"
    if not torch.cuda.is_available():
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton was imported earlier in this session without TRITON_INTERPRET=1, and the interpreter "
                        "is chosen when @triton.jit functions are defined: run this file in its own pytest process",
                        allow_module_level=True)
        # Left set for the rest of the session: triton reads it again when it lazily imports parts of itself.
        # (Without CUDA no compiled triton kernel could run anyway.)
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton", reason=reason)
    return importlib.import_module(f"rlhf_mcore.kernels.{name}")
