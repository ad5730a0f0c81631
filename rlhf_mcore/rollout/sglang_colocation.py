"""Hosting SGLang's in-process `Engine` inside a training process: what its start-up changes, and keeping it local.

Read from SGLang's sources (0.5.3 and 0.5.23, `sglang/srt/entrypoints/engine.py` and the tokenizer manager):

- `Engine.__init__` runs `_set_envs_and_config`, which writes process-wide environment variables
  (NCCL_CUMEM_ENABLE, NCCL_NVLS_ENABLE, CUDA_DEVICE_MAX_CONNECTIONS, TRTLLM_ENABLE_PDL, SGLANG_RUN_ID, ...),
  installs a SIGQUIT handler that kills the whole process tree, and forces the multiprocessing start method to
  "spawn". 0.5.3 also replaces `threading._register_atexit` when its engine module is imported.
  `ProcessState` snapshots all of that before and restores it after every call into the engine: the
  engine's own processes are spawned inside the call and keep the settings they were started with.
- On its first request the tokenizer manager adds SIGTERM and SIGQUIT handlers to its asyncio event loop
  (`auto_create_handle_loop`); `ProcessState.restore` removes them from that loop again.
- `Engine.shutdown()` calls `kill_process_tree(os.getpid(), include_parent=False)`: every child of the
  training process dies, the reward workers included, and `Engine.__init__` registers that as an `atexit`
  hook. `EngineProcesses` records the child processes the engine started (the children that appeared during
  its construction) and ends only those.
- Ports: without `nccl_port`, SGLang picks one at random (0.5.3: `port` + randint(100, 1000), probed for being
  free; 0.5.23: any free port) — engines started together on one node can race for the same one.
  `engine_ports` gives each engine its own `port` and `nccl_port`, from the node-local rank.
- Memory: SGLang sizes its static pool (weights + KV cache) as `mem_fraction_static` times the GPU memory FREE
  when its scheduler starts (0.5.3 `profile_max_num_token`, 0.5.23 `_profile_available_bytes`: the KV budget is
  free-after-load minus free-before-load × (1 - mem_fraction_static)), i.e. after the actor, critic and
  reference are built. `static_memory_fraction` converts a budget in bytes into that fraction.
Left as SGLang sets it: the raised RLIMIT_NOFILE / RLIMIT_STACK soft limits (`set_ulimit`), which only raise.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import threading
import warnings
from dataclasses import dataclass, field

import torch

GUARDED_SIGNALS = tuple(s for s in (getattr(signal, "SIGQUIT", None), getattr(signal, "SIGTERM", None)) if s)
MAX_STATIC_FRACTION = 0.9  # SGLang needs the rest of the free memory for activations and CUDA graphs
PORTS_PER_ENGINE = 2  # `port` and `nccl_port`


@dataclass
class ProcessState:
    """What SGLang changes in the hosting process: the environment, SIGQUIT/SIGTERM handlers, the
    multiprocessing start method and `threading._register_atexit`."""

    env: dict[str, str] = field(default_factory=dict)
    handlers: dict[int, object] = field(default_factory=dict)
    start_method: str | None = None
    register_atexit: object = None

    @classmethod
    def capture(cls) -> "ProcessState":
        return cls(env=dict(os.environ), handlers={s: signal.getsignal(s) for s in GUARDED_SIGNALS},
                   start_method=mp.get_start_method(allow_none=True),
                   register_atexit=getattr(threading, "_register_atexit", None))

    def restore(self, loop=None) -> None:
        """Put everything back as captured; `loop`: the asyncio loop SGLang may have added signal handlers to."""
        for key in [k for k in os.environ if k not in self.env]:
            del os.environ[key]
        for key, value in self.env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self.handlers.items():
                if loop is not None:
                    try:
                        loop.remove_signal_handler(sig)
                    except (NotImplementedError, RuntimeError, ValueError):
                        pass
                if handler is not None and signal.getsignal(sig) is not handler:
                    signal.signal(sig, handler)
        if mp.get_start_method(allow_none=True) != self.start_method:
            mp.set_start_method(self.start_method, force=True)
        if self.register_atexit is not None and getattr(threading, "_register_atexit", None) is not \
                self.register_atexit:
            threading._register_atexit = self.register_atexit


def engine_event_loop(engine):
    """The asyncio loop SGLang's tokenizer manager runs on: `Engine.loop` (0.5.20 on), else the thread's loop."""
    loop = getattr(engine, "loop", None)
    if loop is not None:
        return loop
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return asyncio.get_event_loop()
        except RuntimeError:
            return None


def child_pids() -> set[int]:
    """Direct children of this process."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=False)}


class EngineProcesses:
    """The processes one engine started: the children of this process that appeared while it was built, and
    their descendants. `terminate()` ends exactly those (SIGTERM, then SIGKILL after `timeout_s`)."""

    def __init__(self, pids: set[int]):
        self.pids = set(pids)

    @classmethod
    def since(cls, before: set[int]) -> "EngineProcesses":
        return cls(child_pids() - before)

    def terminate(self, timeout_s: float = 30.0) -> None:
        import psutil

        procs = []
        for pid in self.pids:
            try:
                p = psutil.Process(pid)
                procs.extend([p, *p.children(recursive=True)])
            except psutil.NoSuchProcess:
                continue
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=timeout_s)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=timeout_s)
        self.pids.clear()


def engine_ports(port_base: int, local_rank: int, tp_size: int) -> tuple[int, int]:
    """(`port`, `nccl_port`) of the engine owned by node-local rank `local_rank` (the first of its TP group):
    engine k on a node gets `port_base + 2k` and `port_base + 2k + 1`."""
    index = local_rank // tp_size
    port = port_base + PORTS_PER_ENGINE * index
    if port_base < 1024 or port + 1 > 65535:
        raise ValueError(f"SGLang port_base={port_base}: engine {index} on this node would use ports {port} and "
                         f"{port + 1}, outside [1024, 65535]; choose a port_base such that port_base + "
                         f"{PORTS_PER_ENGINE} x (engines per node) stays below 65536.")
    return port, port + 1


def device_memory(device_index: int) -> tuple[int, int]:
    """(free, total) bytes of CUDA device `device_index`, after returning this process's cached blocks."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device_index)


def static_memory_fraction(gpu_memory_utilization: float, total_bytes: int, free_bytes: int,
                           weight_bytes_per_gpu: int = 0) -> float:
    """SGLang's `mem_fraction_static` that gives it `gpu_memory_utilization × total_bytes` for weights + KV cache,
    when `free_bytes` are free on the emptiest GPU of its TP group as it starts.

    Raises ValueError naming the config key when the budget does not fit in what is free (at most
    `MAX_STATIC_FRACTION` of it) or leaves nothing for the KV cache after the weights."""
    gib = 2 ** 30
    if not 0.0 < gpu_memory_utilization < 1.0:
        raise ValueError(f"actor_rollout_ref.rollout.gpu_memory_utilization={gpu_memory_utilization!r}: must be in "
                         "(0, 1), the fraction of each GPU's memory the SGLang engine may hold (weights + KV cache).")
    budget = gpu_memory_utilization * total_bytes
    if budget <= weight_bytes_per_gpu:
        raise ValueError(f"actor_rollout_ref.rollout.gpu_memory_utilization={gpu_memory_utilization} gives SGLang "
                         f"{budget / gib:.2f} GiB per GPU, not more than the model's weights "
                         f"({weight_bytes_per_gpu / gib:.2f} GiB per GPU): nothing is left for the KV cache; raise "
                         "it, or raise rollout.tensor_model_parallel_size.")
    fraction = budget / max(free_bytes, 1)
    if fraction > MAX_STATIC_FRACTION:
        most = MAX_STATIC_FRACTION * free_bytes / total_bytes
        raise ValueError(f"actor_rollout_ref.rollout.gpu_memory_utilization={gpu_memory_utilization} asks SGLang for "
                         f"{budget / gib:.2f} GiB per GPU, but only {free_bytes / gib:.2f} GiB of "
                         f"{total_bytes / gib:.2f} GiB are free once the actor/critic/reference are built (SGLang "
                         f"may take at most {MAX_STATIC_FRACTION:.0%} of what is free): set it to at most "
                         f"{most:.3f}, or offload the training engines (megatron.param_offload/optimizer_offload).")
    return round(fraction, 4)


def weight_bytes(model_dir) -> int:
    """Bytes of the model's *.safetensors files (the weights SGLang will load, before TP sharding)."""
    from pathlib import Path

    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


_CPU_GROUPS: dict[int, object] = {}


def rollout_cpu_group(world_size: int, rank: int, size: int):
    """A gloo group of the `size` consecutive ranks holding `rank` (the rollout TP group's control channel);
    every rank must call this, in the same order (each creates every group). Cached per size."""
    import torch.distributed as dist

    if size not in _CPU_GROUPS:
        if world_size % size:
            raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={size} does not divide the "
                             f"world size {world_size}.")
        mine = None
        for start in range(0, world_size, size):
            g = dist.new_group(list(range(start, start + size)), backend="gloo")
            if start <= rank < start + size:
                mine = g
        _CPU_GROUPS[size] = mine
    return _CPU_GROUPS[size]
