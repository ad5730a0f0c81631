"""SGLang as a colocated rollout engine: one in-process `sglang.Engine` per rollout TP group.

Checked against SGLang's real sources, not run: `SGLANG_CALLS` lists every SGLang name this backend uses, and
tests/test_sglang_contract.py checks each (with its arity) in the wheels of `SGLANG_MIN_VERSION` and
`SGLANG_NEWEST_CHECKED`, parsed, never imported. No GPU run has been made here (SGLang needs its own torch
and CUDA kernel wheels).

Layout: the rollout TP group is `tp_size` consecutive ranks on one node, holding consecutive GPUs. Its first
rank (the owner) builds the engine on GPUs [its device, its device + tp_size), sized and given its ports by
`sglang_colocation`. Every rank of the group calls every method (as with the native engine); the others send
their prompts to the owner over the group (a gloo group: `sglang_colocation.rollout_cpu_group`) and get their
results back. A failure on the owner is raised on every rank of the group.

Semantics, by SGLang's design (verified in its sources):
  - log-probs: `log_softmax(logits / T)` over the FULL vocabulary, also when top-k / top-p are on (the
    sampler takes the log of the temperature-scaled softmax before filtering, and does not return the kept
    mass needed to renormalise). This equals what the actor recomputes, so the rollout-vs-trainer log-prob
    difference stays a measure of numerics; the native engine instead reports the renormalised value
    (`logprobs_renormalised`). Greedy reports `log_softmax(logits)`, as every backend does.
    The environment variables RETURN_ORIGINAL_LOGPROB (0.5.3) / SGLANG_RETURN_ORIGINAL_LOGPROB (later) drop
    the temperature and are refused.
  - the model's eos ids always stop a sample unless stop_token_ids=() or ignore_eos (then none does);
  - `seed` becomes a per-sample `sampling_seed` (31 bits: 0.5.3 holds seeds in int32), derived from
    (seed, request id, sample) as in the native engine; SGLang honours it only with
    `enable_deterministic_inference=True` in `engine_kwargs` (which also switches it to torch sampling).
  - weight updates: `update_weights` is called once per bucket. The buckets of one sync form one SGLang
    weight-update session (`begin_weight_update` ... `end_weight_update` from 0.5.21, which refuses updates
    outside one), each bucket is sent with flush_cache=False, its CUDA IPC handles are released after it
    (`torch.cuda.ipc_collect`), and the session is closed, and the prefix cache flushed once, before the
    engine's next use (generate / sleep / wake). Every returned `(success, message)` is checked.
  - after sleep(level=2) the weights are gone: call update_weights() after wake() before generating.
"""

from __future__ import annotations

import atexit
import os
import socket
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from . import sglang_colocation as coloc
from .base import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    RolloutEngine,
    Sample,
    SamplingParams,
    read_eos_token_ids,
    validate_sleep_level,
)

SGLANG_MIN_VERSION = "0.5.3"  # the first with SamplingParams.sampling_seed and torch_memory_saver as a dependency
SGLANG_NEWEST_CHECKED = "0.5.23"
# Every SGLang name this backend uses, with the keyword arguments it passes (the contract test checks them).
SGLANG_CALLS: dict[str, tuple[str, ...]] = {
    "ServerArgs": ("model_path", "tp_size", "mem_fraction_static", "enable_memory_saver", "base_gpu_id",
                   "skip_tokenizer_init", "random_seed", "context_length", "port", "nccl_port"),
    "Engine.generate": ("input_ids", "sampling_params", "return_logprob"),
    "Engine.update_weights_from_tensor": ("named_tensors", "load_format", "flush_cache"),
    "Engine.begin_weight_update": (),
    "Engine.end_weight_update": (),
    "Engine.release_memory_occupation": ("tags",),
    "Engine.resume_memory_occupation": ("tags",),
    "Engine.flush_cache": (),
    "Engine.shutdown": (),  # not called: referenced to take SGLang's atexit hook (which kills every child) off
    "SamplingParams": ("max_new_tokens", "temperature", "top_p", "top_k", "skip_special_tokens", "no_stop_trim",
                       "ignore_eos", "stop_token_ids", "sampling_seed"),
}
SGLANG_OPTIONAL_SINCE = {"Engine.begin_weight_update": "0.5.21", "Engine.end_weight_update": "0.5.21"}
ORIGINAL_LOGPROB_ENV = ("RETURN_ORIGINAL_LOGPROB", "SGLANG_RETURN_ORIGINAL_LOGPROB")

SLEEP_TAGS = {1: ["kv_cache"], 2: ["kv_cache", "weights", "cuda_graph"]}
_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH}
SEED_MASK = 0x7FFFFFFF


def to_sglang_sampling_params(params: SamplingParams, sample_seed: int | None = None) -> dict:
    """One SGLang sampling_params dict for one sample (n is expanded into separate requests)."""
    out = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": 0.0 if params.greedy else float(params.temperature),
        "top_p": float(params.top_p) if params.top_p_active else 1.0,
        "top_k": int(params.top_k) if params.top_k_active else -1,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    stop = list(params.stop_token_ids or ())
    if params.ignore_eos or not stop:
        out["ignore_eos"] = True
    else:
        out["stop_token_ids"] = stop
    if sample_seed is not None:
        out["sampling_seed"] = int(sample_seed) & SEED_MASK
    return out


def parse_sglang_output(ret: dict) -> Sample:
    """One SGLang result dict -> Sample. Raises RuntimeError on an aborted request."""
    meta = ret["meta_info"]
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason not in _FINISH:
        raise RuntimeError(f"SGLang finished a request with finish_reason={meta.get('finish_reason')!r}; "
                           "expected 'stop' or 'length' (was it aborted, e.g. for exceeding context_length?).")
    entries = meta["output_token_logprobs"]
    token_ids = [int(e[1]) for e in entries]
    if "output_ids" in ret and list(ret["output_ids"]) != token_ids:
        raise RuntimeError("SGLang output_ids disagree with output_token_logprobs; cannot align log-probs.")
    return Sample(token_ids=token_ids, logprobs=[float(e[0]) for e in entries], finish_reason=_FINISH[reason])


def check_status(op: str, ret: Any) -> None:
    """Raise RuntimeError with SGLang's message when `ret` reports a failure: a `(success, message)` tuple
    (update_weights_from_tensor, begin/end_weight_update) or an object with `.success` (flush_cache)."""
    if isinstance(ret, tuple) and ret and isinstance(ret[0], bool):
        ok, message = ret[0], (ret[1] if len(ret) > 1 else "")
    elif hasattr(ret, "success"):
        ok, message = bool(ret.success), getattr(ret, "message", "")
    else:
        return
    if not ok:
        raise RuntimeError(f"SGLang {op} failed: {message or '(no message)'}")


def sglang_version(module) -> str:
    """The installed SGLang's version; ImportError when older than `SGLANG_MIN_VERSION`."""
    from packaging.version import Version

    version = getattr(module, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("sglang")
    if Version(version) < Version(SGLANG_MIN_VERSION):
        raise ImportError(f"rollout engine 'sglang' needs sglang>={SGLANG_MIN_VERSION} (found {version}): "
                          f"pip install 'sglang>={SGLANG_MIN_VERSION}' (or the rlhf_mcore[sglang] extra).")
    return version


class SGLangRolloutEngine(RolloutEngine):
    """Drive one in-process SGLang engine per rollout TP group; see the module docstring.

    gpu_memory_utilization: the fraction of each GPU's total memory SGLang may hold (weights + KV cache);
      converted into SGLang's `mem_fraction_static` from the memory free when the engine starts
      (`sglang_colocation.static_memory_fraction`). `engine_kwargs["mem_fraction_static"]` bypasses that.
    tp_group: the rollout TP group (a gloo group, `sglang_colocation.rollout_cpu_group`); None: TP 1.
    port_base: engine k on a node (k = node-local rank // tp_size) uses ports port_base + 2k and + 2k + 1.
    base_gpu_id: the owner's first GPU (default: its current CUDA device).
    """

    logprobs_renormalised = False

    def __init__(self, model_dir, *, tp_size: int = 1, gpu_memory_utilization: float = 0.5,
                 base_gpu_id: int | None = None, enable_memory_saver: bool = True, max_model_len: int | None = None,
                 random_seed: int = 0, tp_group=None, port_base: int = 30000, engine_kwargs: dict | None = None):
        try:
            import sglang
        except ImportError as e:
            raise ImportError("rollout engine 'sglang' needs the sglang package (pip install "
                              f"'sglang>={SGLANG_MIN_VERSION}'); or use actor_rollout_ref.rollout.name=native.") from e
        self.version = sglang_version(sglang)
        for name in ORIGINAL_LOGPROB_ENV:
            if os.environ.get(name, "").lower() in ("1", "true", "yes"):
                raise ValueError(f"{name}={os.environ[name]} makes SGLang report log-probs without the temperature; "
                                 "unset it (the trainer compares log-probs of the temperature-scaled distribution).")
        group_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        if group_size != tp_size:
            raise ValueError(f"SGLangRolloutEngine(tp_size={tp_size}) but its tp_group has {group_size} ranks; pass "
                             "the rollout TP group (sglang_colocation.rollout_cpu_group) of that size.")
        self.model_dir = str(model_dir)
        self.tp_group = tp_group
        self.owner = dist.get_global_rank(tp_group, 0) if tp_group is not None else None
        self.is_owner = tp_group is None or dist.get_rank(tp_group) == 0
        self._stop_ids_default = read_eos_token_ids(model_dir)
        self._needs_weights = False
        self._updating = False
        self._sleep_level = 0
        self.engine = None
        self.processes: coloc.EngineProcesses | None = None

        # every rank reports where it runs; the owner checks the layout and sizes the engine
        cuda = torch.cuda.is_available()
        device = torch.cuda.current_device() if cuda else None
        here = (socket.gethostname(), device, *(coloc.device_memory(device) if cuda else (None, None)))
        reports = self._gather(here)

        def build():
            hosts = {r[0] for r in reports}
            if len(hosts) > 1:
                raise ValueError(f"rollout TP group spans hosts {sorted(hosts)}; an SGLang engine runs on one node: "
                                 "lower rollout.tensor_model_parallel_size to at most the GPUs per node.")
            first = base_gpu_id if base_gpu_id is not None else (device if device is not None else 0)
            devices = [r[1] for r in reports]
            if cuda and devices != list(range(first, first + tp_size)):
                raise ValueError(f"the rollout TP group's ranks use GPUs {devices}; SGLang runs on GPUs "
                                 f"{list(range(first, first + tp_size))} (from base_gpu_id={first}): launch one "
                                 "rank per GPU with consecutive LOCAL_RANKs, all GPUs visible to every rank.")
            kwargs = dict(model_path=self.model_dir, tp_size=tp_size, enable_memory_saver=enable_memory_saver,
                          base_gpu_id=first, skip_tokenizer_init=True, random_seed=random_seed)
            local_rank = int(os.environ.get("LOCAL_RANK", first))
            kwargs["port"], kwargs["nccl_port"] = coloc.engine_ports(port_base, local_rank, tp_size)
            if max_model_len is not None:
                kwargs["context_length"] = max_model_len
            extra = dict(engine_kwargs or {})
            if "mem_fraction_static" not in extra:
                if not cuda:
                    raise RuntimeError("SGLang needs CUDA GPUs; none is visible to this process.")
                free = min(r[2] for r in reports)
                kwargs["mem_fraction_static"] = coloc.static_memory_fraction(
                    gpu_memory_utilization, reports[0][3], free, coloc.weight_bytes(self.model_dir) // tp_size)
            kwargs.update(extra)
            self.engine_kwargs = kwargs
            self._start_engine(sglang, kwargs)

        self._on_owner(build, "start")

    # --- the engine's own process -----------------------------------------------------------------------
    def _start_engine(self, sglang, kwargs: dict) -> None:
        state = coloc.ProcessState.capture()
        before = coloc.child_pids()
        try:
            self.engine = sglang.Engine(**kwargs)
        finally:
            self.processes = coloc.EngineProcesses.since(before)
            state.restore(None)
            if self.engine is None:  # a failed start: end what it had launched
                self.processes.terminate()
        self._state = state
        atexit.unregister(self.engine.shutdown)  # SGLang's hook kills every child of this process
        atexit.register(self.shutdown)

    def _call(self, method: str, *args, **kwargs):
        """Call an engine method; what SGLang changes in this process during the call is undone after."""
        try:
            return getattr(self.engine, method)(*args, **kwargs)
        finally:
            self._state.restore(coloc.engine_event_loop(self.engine))

    # --- the TP group ------------------------------------------------------------------------------------
    def _gather(self, obj) -> list | None:
        """Every rank's `obj`, in group order, on the owner (None elsewhere)."""
        if self.tp_group is None:
            return [obj]
        out = [None] * dist.get_world_size(self.tp_group) if self.is_owner else None
        dist.gather_object(obj, out, dst=self.owner, group=self.tp_group)
        return out

    def _on_owner(self, fn: Callable[[], Any], what: str, per_rank: bool = False):
        """Run `fn` on the owner and hand its result (or its failure) to every rank of the group.
        per_rank: `fn` returns one result per rank of the group, and each rank gets its own."""
        status = None
        if self.is_owner:
            try:
                status = ("ok", fn())
            except Exception as e:  # raised on every rank; the owner keeps its own traceback
                if self.tp_group is None:
                    raise
                status = ("error", f"{type(e).__name__}: {e}")
                error = e
        if self.tp_group is None:
            return status[1][0] if per_rank else status[1]
        size = dist.get_world_size(self.tp_group)
        if per_rank:
            send = [("ok", r) for r in status[1]] if self.is_owner and status[0] == "ok" else \
                [status] * size if self.is_owner else None
            box = [None]
            dist.scatter_object_list(box, send, src=self.owner, group=self.tp_group)
            status = box[0]
        else:
            box = [status]
            dist.broadcast_object_list(box, src=self.owner, group=self.tp_group)
            status = box[0]
        if status[0] == "error":
            if self.is_owner:
                raise error
            raise RuntimeError(f"SGLang {what} failed on rank {self.owner}, which owns this rollout TP group's "
                               f"engine: {status[1]}")
        return status[1]

    # --- RolloutEngine ----------------------------------------------------------------------------------
    @property
    def default_stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_ids_default

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 request_ids: Sequence[int] | None = None) -> list[GenerationOutput]:
        if self._needs_weights:
            raise RuntimeError("SGLang weights were released by sleep(level=2); call update_weights() after wake().")
        params = params.with_stop_ids(self._stop_ids_default)
        rids = list(range(len(prompts))) if request_ids is None else list(request_ids)
        requests = self._gather(([list(p) for p in prompts], params, rids))

        def run():
            self._finish_weight_update(flush=True)
            distinct: list = []  # ranks of one group usually send the same requests: generate them once
            which = []
            for req in requests:
                if req not in distinct:
                    distinct.append(req)
                which.append(distinct.index(req))
            results = self._generate_batch(distinct)
            return [results[k] for k in which]

        return self._on_owner(run, "generate", per_rank=True)

    def _generate_batch(self, requests: list) -> list[list[GenerationOutput]]:
        from .native.sampling import sequence_key

        input_ids, sps = [], []
        for prompts, params, rids in requests:
            for i, p in enumerate(prompts):
                for j in range(params.n):
                    input_ids.append(p)
                    seed = None if params.seed is None else sequence_key(params.seed, rids[i], j)
                    sps.append(to_sglang_sampling_params(params, seed))
        if not input_ids:
            return [[] for _ in requests]
        rets = self._call("generate", input_ids=input_ids, sampling_params=sps, return_logprob=True)
        if isinstance(rets, dict):
            rets = [rets]
        if len(rets) != len(input_ids):
            raise RuntimeError(f"SGLang returned {len(rets)} results for {len(input_ids)} requests.")
        out, k = [], 0
        for prompts, params, _ in requests:
            outs = []
            for p in prompts:
                outs.append(GenerationOutput(prompt_ids=list(p),
                                             samples=[parse_sglang_output(rets[k + j]) for j in range(params.n)]))
                k += params.n
            out.append(outs)
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send one bucket of full HF-named tensors to SGLang (which shards them over its own TP workers). The
        buckets of one sync share one weight-update session, closed before the engine's next use."""
        named = list(named_tensors) if self.is_owner else None

        def run():
            if not self._updating:
                if hasattr(self.engine, "begin_weight_update"):
                    check_status("begin_weight_update", self._call("begin_weight_update"))
                self._updating = True
            ret = self._call("update_weights_from_tensor", named_tensors=named, load_format=None, flush_cache=False)
            check_status("update_weights_from_tensor", ret)
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()  # SGLang's workers have loaded the bucket: release its IPC handles

        self._on_owner(run, "update_weights")
        self._needs_weights = False

    def _finish_weight_update(self, flush: bool) -> None:
        """Owner only: close an open weight-update session, then flush the prefix cache once (if `flush`)."""
        if not self._updating:
            return
        self._updating = False
        if hasattr(self.engine, "end_weight_update"):
            check_status("end_weight_update", self._call("end_weight_update"))
        if flush:
            check_status("flush_cache", self._call("flush_cache"))

    def sleep(self, level: int = 1) -> int:
        validate_sleep_level(level)
        cuda = torch.cuda.is_available()
        if self.tp_group is not None:
            dist.barrier(group=self.tp_group)  # every rank measures before the owner releases
        free_before = torch.cuda.mem_get_info()[0] if cuda else 0

        def run():
            self._finish_weight_update(flush=True)
            self._call("release_memory_occupation", tags=SLEEP_TAGS[level])

        self._on_owner(run, "sleep")
        self._sleep_level = level
        if level == 2:
            self._needs_weights = True
        return max(0, torch.cuda.mem_get_info()[0] - free_before) if cuda else 0

    def wake(self) -> None:
        level = self._sleep_level

        def run():
            self._finish_weight_update(flush=not level)
            if level:
                self._call("resume_memory_occupation", tags=SLEEP_TAGS[level])
                check_status("flush_cache", self._call("flush_cache"))

        self._on_owner(run, "wake")
        self._sleep_level = 0

    def shutdown(self) -> None:
        """End this engine's processes only (never SGLang's `Engine.shutdown`, which ends every child of this
        process). Local to the owner: no collective, so it is safe at interpreter exit."""
        if self.engine is None:
            return
        atexit.unregister(self.shutdown)
        watchdog = getattr(getattr(self.engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
        if watchdog is not None:  # 0.5.20 on: it would SIGQUIT this process when the engine's children end
            watchdog.stop()
        self.processes.terminate()
        self.engine = None
