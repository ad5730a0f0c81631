"""The log-prob/entropy backends the engine scores tokens with, chosen by name (`logprob_backend`).

- "torch": :func:`rlhf_mcore.kernels.logprob_reference.vocab_parallel_logprobs`, the chunked torch reference;
- "triton": :func:`rlhf_mcore.kernels.fused_logprob.fused_vocab_parallel_logprobs`, the fused Triton kernel,
  registered when first asked for (so `triton` is imported only by runs that use it);
- "auto": the Triton kernel for CUDA logits when triton is installed, else the torch reference.

Every backend has the reference's signature and outputs; another one plugs in with
:func:`register_logprob_backend`.
"""
from __future__ import annotations

import functools
import warnings

import torch

from rlhf_mcore.kernels.logprob_reference import LogprobFn, vocab_parallel_logprobs
from rlhf_mcore.registry import Registry

__all__ = ["LOGPROB_BACKENDS", "register_logprob_backend", "get_logprob_backend", "LogprobFn"]

LOGPROB_BACKENDS: Registry[LogprobFn] = Registry(
    "logprob backend", "Built in: torch, triton, auto; another one registers itself with "
    "rlhf_mcore.engine.logprobs.register_logprob_backend(name, fn).")


def register_logprob_backend(name: str, fn: LogprobFn, *, override: bool = False) -> None:
    """Make `fn` (same signature as :func:`vocab_parallel_logprobs`) selectable as `logprob_backend=<name>`."""
    LOGPROB_BACKENDS.add(name, fn, override=override)


def _register_triton() -> None:
    from rlhf_mcore.kernels.fused_logprob import fused_vocab_parallel_logprobs

    LOGPROB_BACKENDS.add("triton", fused_vocab_parallel_logprobs)


def get_logprob_backend(name: str = "torch") -> LogprobFn:
    """The log-prob/entropy implementation registered as `name` (see the module docstring)."""
    if name == "triton" and name not in LOGPROB_BACKENDS:
        _register_triton()
    return LOGPROB_BACKENDS.get(name, key="logprob_backend")


@functools.cache
def _triton_usable() -> bool:
    """Whether the "triton" backend can run: the kernel module imports and the `triton` package is installed."""
    try:
        from rlhf_mcore.kernels.fused_logprob import triton_available
    except ImportError as e:
        warnings.warn(f"logprob_backend=auto: the Triton kernel does not import ({e}); using the torch reference",
                      stacklevel=3)
        return False
    return triton_available()


def _auto_logprobs(logits: torch.Tensor, labels: torch.Tensor, **kwargs):
    """`logprob_backend=auto`: the Triton kernel for CUDA logits when it is usable, else the torch reference."""
    if logits.is_cuda and _triton_usable():
        return get_logprob_backend("triton")(logits, labels, **kwargs)
    return vocab_parallel_logprobs(logits, labels, **kwargs)


register_logprob_backend("torch", vocab_parallel_logprobs)
register_logprob_backend("auto", _auto_logprobs)
