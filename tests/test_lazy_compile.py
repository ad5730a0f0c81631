"""megatron-core's `jit_fuser` compiles on first call (rlhf_mcore/lazy_compile.py): importing megatron-core after
rlhf_mcore does not import TorchInductor, and a wrapped function gives torch.compile's result, compiling once."""
import json
import subprocess
import sys

import torch
from subprocess_env import child_env

PROBE = r"""
import json, sys
import rlhf_mcore
import megatron.core
from megatron.core.fusions import fused_bias_swiglu
from megatron.core import jit
from rlhf_mcore.lazy_compile import compile_on_first_call
print(json.dumps({"inductor": "torch._inductor.compile_fx" in sys.modules,
                  "hooked": jit.jit_fuser is compile_on_first_call,
                  "wrapped": fused_bias_swiglu.swiglu.__wrapped__.__name__}))
"""


def test_megatron_imports_without_inductor_and_its_fuser_is_deferred():
    """Mutation: drop `_lazy_compile.install()` from rlhf_mcore/__init__.py -> fails (TorchInductor imported, the
    fuser is torch.compile)."""
    out = subprocess.run([sys.executable, "-c", PROBE], env=child_env(PYTHONWARNINGS="ignore"), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"inductor": False, "hooked": True, "wrapped": "swiglu"}, got


def test_compile_on_first_call_compiles_once_and_matches(monkeypatch):
    """Mutation: compile on every call (drop the cache) -> fails (two compiles)."""
    from rlhf_mcore.lazy_compile import compile_on_first_call

    calls, real = [], torch.compile

    def counting(fn, **options):
        calls.append(options)
        return real(fn, **options)

    monkeypatch.setattr(torch, "compile", counting)

    @compile_on_first_call(backend="eager")
    def f(x):
        return torch.nn.functional.silu(x) * 2

    assert calls == []  # nothing compiled at decoration
    x = torch.randn(5)
    assert torch.equal(f(x), torch.nn.functional.silu(x) * 2) and torch.equal(f(x), f(x))
    assert calls == [{"backend": "eager"}] and f.__name__ == "f"
