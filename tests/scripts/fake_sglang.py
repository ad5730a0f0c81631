"""A stand-in for the `sglang` package that enforces the contract rlhf_mcore's SGLang backend relies on.

What it enforces, as read in SGLang's sources (see tests/test_sglang_contract.py for the names themselves):
- keyword arguments: only those listed in `sglang_backend.SGLANG_CALLS` (ServerArgs fields, SamplingParams
  fields, method keywords), so the backend cannot start sending a name the contract test did not check;
- from 0.5.21 (`version >= "0.5.21"`): `begin_weight_update()` / `end_weight_update()` exist and
  `update_weights_from_tensor` outside such a session returns `(False, message)` (as SGLang's scheduler does);
  before 0.5.21 the two methods do not exist;
- every update returns `(success, message)`; `fail_next_update` makes the next one fail;
- `flush_cache()` returns an object with `.success`; it is counted, as is every other call (`calls`);
- `Engine.shutdown()` must never be called (SGLang's kills every child process of the trainer);
- construction changes the hosting process as SGLang's `_set_envs_and_config` does (environment, SIGQUIT
  handler, multiprocessing start method), and the first `generate` adds a SIGTERM handler to the engine's
  asyncio loop as SGLang's tokenizer manager does; `spawn_child=True` starts a child process (its "scheduler").

Answers: request i of a `generate` call gets tokens [100 + i, 200] plus 959 (a stop id) when i is even; each
token's log-prob is SGLang's: `log_softmax(logits / T)` over the full vocabulary, T = 1 when greedy, for the
logits `fake_logits(previous token)`.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import types
from dataclasses import dataclass

import torch

from rlhf_mcore.rollout.sglang_backend import SGLANG_CALLS

VOCAB = 1000
SESSIONS_SINCE = (0, 5, 21)


def fake_logits(prev_token: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(prev_token))
    return torch.randn(VOCAB, generator=g, dtype=torch.float64) * 3


def full_vocab_logprob(prev_token: int, token: int, temperature: float) -> float:
    t = 1.0 if temperature == 0 else temperature
    return float(torch.log_softmax(fake_logits(prev_token) / t, -1)[token])


def _check(name: str, kwargs: dict) -> None:
    unknown = set(kwargs) - set(SGLANG_CALLS[name])
    if unknown:
        raise TypeError(f"{name}: keyword(s) {sorted(unknown)} are not in sglang_backend.SGLANG_CALLS[{name!r}]")


@dataclass
class FlushCacheReqOutput:
    success: bool


class FakeEngine:
    """SGLang before 0.5.21: no weight-update sessions."""

    instances: list["FakeEngine"] = []
    spawn_child = False

    def __init__(self, **kwargs):
        _check("ServerArgs", kwargs)
        self.kwargs, self.calls = kwargs, []
        self.fail_next_update: str | None = None
        self.flush_ok = True
        self.loop = asyncio.new_event_loop()
        self._loop_handlers = False
        # what SGLang's _set_envs_and_config does to the hosting process
        os.environ["NCCL_CUMEM_ENABLE"] = "0"
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
        os.environ["SGLANG_RUN_ID"] = "sglang-run-fake"
        signal.signal(signal.SIGQUIT, lambda *a: os._exit(99))
        mp.set_start_method("spawn", force=True)
        self.child = None
        if self.spawn_child:
            self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        FakeEngine.instances.append(self)

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False):
        _check("Engine.generate", dict(input_ids=input_ids, sampling_params=sampling_params,
                                       return_logprob=return_logprob))
        if not self._loop_handlers:  # the tokenizer manager's auto_create_handle_loop
            self.loop.add_signal_handler(signal.SIGTERM, lambda: None)
            self._loop_handlers = True
        self.calls.append(("generate", input_ids, sampling_params, return_logprob))
        outs = []
        for i, (prompt, sp) in enumerate(zip(input_ids, sampling_params)):
            _check("SamplingParams", sp)
            ids = ([100 + i, 200] + ([959] if i % 2 == 0 else []))[:sp["max_new_tokens"]]
            prev = [prompt[-1]] + ids[:-1]
            lps = [full_vocab_logprob(p, t, sp["temperature"]) for p, t in zip(prev, ids)]
            outs.append({"output_ids": ids, "meta_info": {
                "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, ids)],
                "finish_reason": {"type": "stop", "matched": 959} if ids[-1] == 959 else {"type": "length",
                                                                                         "length": len(ids)},
                "completion_tokens": len(ids)}})
        return outs

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", [n for n, _ in named_tensors], load_format, flush_cache))
        if self.fail_next_update is not None:
            message, self.fail_next_update = self.fail_next_update, None
            return False, message
        return True, "Succeeded to update model weights."

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))

    def flush_cache(self):
        self.calls.append(("flush",))
        return FlushCacheReqOutput(success=self.flush_ok)

    def shutdown(self):
        raise AssertionError("Engine.shutdown() kills every child process of the trainer; the backend must not call it")

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class FakeSessionEngine(FakeEngine):
    """SGLang 0.5.21 on: weight updates only inside begin_weight_update() ... end_weight_update()."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.session = False

    def begin_weight_update(self):
        self.calls.append(("begin",))
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end",))
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if not self.session:
            self.calls.append(("update-refused", [n for n, _ in named_tensors]))
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        return super().update_weights_from_tensor(named_tensors, load_format, flush_cache)

    def _idle(self, op: str):
        if self.session:
            raise AssertionError(f"{op} while a weight-update session is open")

    def generate(self, **kwargs):
        self._idle("generate")
        return super().generate(**kwargs)

    def release_memory_occupation(self, tags=None):
        self._idle("release_memory_occupation")
        return super().release_memory_occupation(tags)

    def resume_memory_occupation(self, tags=None):
        self._idle("resume_memory_occupation")
        return super().resume_memory_occupation(tags)


def make_module(version: str = "0.5.23") -> types.ModuleType:
    """A `sglang` module advertising `version`, whose Engine follows that version's weight-update contract."""
    mod = types.ModuleType("sglang")
    mod.__version__ = version
    parts = tuple(int(x) for x in version.split(".")[:3])
    mod.Engine = FakeSessionEngine if parts >= SESSIONS_SINCE else FakeEngine
    return mod
