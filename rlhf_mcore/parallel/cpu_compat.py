"""Make megatron-core run on CPU (gloo) for development and CI.

megatron-core assumes CUDA in a handful of places. Without a GPU, :func:`enable` answers those assumptions:

- ``torch.cuda.current_device()`` returns ``"cpu"`` so ``torch.empty(..., device=torch.cuda.current_device())``
  allocates on the CPU;
- ``torch.cuda.get_rng_state``/``set_rng_state``/``manual_seed`` and megatron's ``_get_cuda_rng_state``/
  ``_set_cuda_rng_state`` act on the CPU generator (megatron's RNG tracker forks "CUDA" states);
- a :class:`torch.overrides.TorchFunctionMode` rewrites ``device="cuda"`` to ``"cpu"`` in factory calls and
  ``.to("cuda")``/``.cuda()`` (the optimizers hard-code several ``torch.tensor(..., device='cuda')``);
- ``Tensor.type()`` reports ``torch.cuda.*`` names for CPU tensors (the optimizers assert on them);
- stream/synchronize/memory helpers become no-ops;
- ``all_to_all_single``'s split sizes given as tensors (megatron's MoE alltoall dispatcher) become lists.

It is active only in a process that runs on the CPU: without CUDA, or on a GPU machine where this rank was given no
GPU (``enable(hide_gpus=True)``: more processes than GPUs, or ``trainer.device=cpu``; ``torch.cuda.is_available()``
then answers False in this process and ``CUDA_VISIBLE_DEVICES`` is emptied for its children). Nothing else
in the project depends on it: every other module uses ordinary torch/megatron calls. Callers still give the
model an explicit attention mask (megatron's ``get_default_causal_mask`` hard-codes CUDA).
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False
_MODE: "_CudaToCpuMode | None" = None

_FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.arange, torch.rand, torch.randn,
    torch.randint, torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like,
    torch.randn_like, torch.as_tensor, torch.eye, torch.linspace, torch.empty_strided, torch.randperm,
}


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, int):  # a bare ordinal means a CUDA device in torch's API
        return True
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU in tensor factories and device moves."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        elif func in (torch.Tensor.to,):
            args = tuple("cpu" if _is_cuda(a) and not isinstance(a, int) else a for a in args)
            if len(args) >= 2 and isinstance(args[1], int) and not isinstance(args[1], bool):
                args = (args[0], "cpu") + tuple(args[2:])
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
        elif func is torch.Tensor.cuda:
            return args[0]
        elif func is torch.Tensor.pin_memory:
            return args[0]
        elif func == _GRAD_GETTER:
            # Through this mode every `.grad` read is attributed to this file, and torch warns on reads of a
            # non-leaf tensor's .grad, which megatron's CPU path does harmlessly (the value is None either way).
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
                return func(*args, **kwargs)
        return func(*args, **kwargs)


_GRAD_GETTER = torch.Tensor.grad.__get__


def _split_sizes_as_lists(all_to_all_single):
    """megatron's MoE alltoall dispatcher hands `all_to_all_single` its split sizes as host copies of device tensors
    (numpy arrays on CUDA); on the CPU they stay tensors, which the gloo binding refuses: give it lists. (A global
    wrapper, not the torch-function mode: the backward pass calls it too, where the mode is not active.)"""
    @functools.wraps(all_to_all_single)
    def wrapper(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        if torch.is_tensor(output_split_sizes):
            output_split_sizes = output_split_sizes.tolist()
        if torch.is_tensor(input_split_sizes):
            input_split_sizes = input_split_sizes.tolist()
        return all_to_all_single(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)
    return wrapper


_CPU_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor", torch.int32: "torch.cuda.IntTensor", torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor", torch.int8: "torch.cuda.CharTensor",
}


def enable(hide_gpus: bool = False) -> None:
    """Patch torch.cuda and megatron-core for CPU execution. Idempotent.

    On a machine with CUDA this process must give its GPUs up (``hide_gpus=True``), else it raises: a process that
    half uses CUDA and half the CPU stand-ins would mix devices.
    """
    global _ENABLED, _MODE
    if _ENABLED:
        return
    cuda = torch.cuda
    if cuda.is_available():
        if not hide_gpus:
            raise RuntimeError("cpu_compat.enable() on a machine with CUDA: pass hide_gpus=True to run this process "
                               "on the CPU (what init_distributed does for a rank without a GPU of its own).")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # helpers this process starts stay on the CPU too
        cuda.is_available = lambda: False

    cuda.current_device = lambda: "cpu"
    cuda.device_count = lambda: 0
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.get_rng_state_all = lambda: [torch.get_rng_state()]
    cuda.set_rng_state_all = lambda states: torch.set_rng_state(states[0])
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.set_device = lambda device: None
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.Stream = _NullStream
    cuda.stream = lambda s=None: contextlib.nullcontext()
    cuda.Event = _NullEvent
    cuda.is_current_stream_capturing = lambda: False
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None

    original_type = torch.Tensor.type

    @functools.wraps(original_type)
    def _type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and self.device.type == "cpu" and self.dtype in _CPU_TYPE_NAMES:
            return _CPU_TYPE_NAMES[self.dtype]
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = dtype.replace("torch.cuda.", "torch.")
        return original_type(self, dtype, non_blocking, **kwargs) if dtype is not None else original_type(self)

    torch.Tensor.type = _type
    torch.distributed.all_to_all_single = _split_sizes_as_lists(torch.distributed.all_to_all_single)

    try:
        from megatron.core.tensor_parallel import random as mrandom

        mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
            torch.get_rng_state().clone() if clone else torch.get_rng_state())
        mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    except ImportError:  # megatron-core not installed: torch patches alone still help plain torch code
        pass

    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _ENABLED = True


class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return _NullEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0
