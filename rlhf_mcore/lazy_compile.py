"""megatron-core's fused functions compile on their first call, not at import.

megatron/core/jit.py sets `jit_fuser = torch.compile`, and about 40 functions of megatron-core (bias + GeLU/SwiGLU,
the fused cross entropy's pieces, ...) are decorated with it as their modules import. The first `torch.compile`
call imports TorchInductor: about 1.7 CPU-seconds in every process that imports megatron-core (each training rank,
each rollout and reward worker, launch/convert_checkpoint.py), also in those that never call one of them, e.g. every
CPU run (measured on this project's CPU machines: megatron-core + transformers imported in 3.7 s, 1.9 s with the
hook). `install()` (called by `rlhf_mcore/__init__.py`, before anything imports megatron) replaces `jit_fuser` as
megatron/core/jit.py loads with `compile_on_first_call`: the same `torch.compile(fn)` object, made when the function
first runs. Nothing here imports torch or megatron.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys

MODULE = "megatron.core.jit"


def compile_on_first_call(fn=None, **options):
    """`torch.compile(fn, **options)`, made on `fn`'s first call; `@compile_on_first_call(**options)` works too."""
    if fn is None:
        return functools.partial(compile_on_first_call, **options)
    compiled = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not compiled:
            import torch

            compiled.append(torch.compile(fn, **options))
        return compiled[0](*args, **kwargs)

    return call


class _JitFuserHook(importlib.abc.MetaPathFinder):
    """Finds megatron/core/jit.py through the other finders and swaps its `jit_fuser` right after the module runs,
    before the modules that import it decorate anything."""

    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)  # once, and not to find ourselves
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import torch

            if module.jit_fuser is torch.compile:  # not where megatron chose the no-op or torch.jit.script
                module.jit_fuser = compile_on_first_call

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Put the hook first on sys.meta_path, unless megatron/core/jit.py is already loaded or the hook is there."""
    if MODULE not in sys.modules and not any(isinstance(f, _JitFuserHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _JitFuserHook())
