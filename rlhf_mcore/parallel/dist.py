"""Process-group setup: torchrun's environment (or a plain single process) -> torch.distributed -> Megatron-Core.

Every component receives a :class:`ParallelState` explicitly (its groups, ranks and device) instead of looking
process groups up deep inside; Megatron modules get ``state.pg_collection``. NCCL on GPU, gloo on CPU, where
:mod:`rlhf_mcore.parallel.cpu_compat` answers megatron-core's CUDA assumptions.
"""
from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelDims:
    """The training layout: world = TP × PP × DP (context parallelism: later). Expert parallelism (EP, MoE
    models) splits each expert layer's experts over `ep` of the DP ranks (Megatron's layout: EP divides DP; the
    expert layers' own data parallelism is DP / EP, their tensor parallelism TP)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: Optional[int] = None
    ep: int = 1

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, vpp: Optional[int] = None,
                   ep: int = 1) -> "ParallelDims":
        if world_size % (tp * pp):
            raise ValueError(f"world size {world_size} is not divisible by TP×PP = {tp}×{pp}")
        dp = world_size // (tp * pp)
        if ep < 1 or dp % ep:
            raise ValueError(f"expert_model_parallel_size={ep} must divide the data-parallel size {dp} (world "
                             f"{world_size} / TP×PP {tp}×{pp}); launch a multiple of TP×PP×EP processes.")
        return cls(tp=tp, pp=pp, dp=dp, vpp=vpp, ep=ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass
class ParallelState:
    """What a rank needs to know about the layout; passed explicitly to every component."""

    dims: ParallelDims
    rank: int
    local_rank: int
    device: torch.device
    backend: str
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup  # TP × PP: the ranks that hold one model replica
    world_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup  # gloo over all ranks, for small control messages (the coordinator's plan)
    pg_collection: object  # megatron.core.process_groups_config.ProcessGroupCollection
    ep_rank: int = 0  # this rank's place in its expert-parallel group (0 without EP)
    ep_group: Optional[dist.ProcessGroup] = None  # the ranks whose experts together make every expert layer

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1


def collective_device(group=None) -> torch.device:
    """Where a tensor must live to go through a collective on `group`: the current CUDA device for NCCL, the
    CPU for gloo (the default group is NCCL-only on GPU: a CPU tensor there fails with "No backend type
    associated with device type cpu")."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pick_device(requested: str = "auto") -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` when every process on this node gets a GPU of its own, else the
    CPU (gloo). ``requested``: "auto" (that rule), "cuda" (a GPU per process, or an error that says why not),
    "cpu". Counting GPUs goes through NVML where it can, so CUDA is not initialised in a rank that ends on the CPU.
    """
    if requested not in ("auto", "cuda", "cpu"):
        raise ValueError(f"trainer.device={requested!r}: choose auto, cuda or cpu.")
    if requested == "cpu":
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    if gpus >= max(local_world, local_rank + 1):
        return torch.device("cuda", local_rank)
    if requested == "cuda":
        if gpus == 0:
            raise RuntimeError("trainer.device=cuda but CUDA is not available; use trainer.device=auto or cpu.")
        raise RuntimeError(f"trainer.device=cuda: {local_world} processes on this node but {gpus} GPU(s) visible "
                           f"(LOCAL_RANK={local_rank}); launch at most {gpus} processes a node "
                           "(torchrun --nproc_per_node), or use trainer.device=auto or cpu (gloo on the CPU).")
    return torch.device("cpu")


def init_distributed(tp: int = 1, pp: int = 1, vpp: Optional[int] = None, device: str = "auto",
                     seed: int = 1, timeout_minutes: int = 30, ep: int = 1,
                     expandable_segments: Optional[bool] = None) -> ParallelState:
    """Initialise torch.distributed (from torchrun's env, or as a single process) and Megatron's parallel state.
    ep: expert parallel size (MoE models; see `ParallelDims`). expandable_segments (a GPU rank): the CUDA allocator's
    expandable segments on / off before the first allocation (`allocator.expandable_segments_wanted`); None: as
    the environment leaves them."""
    from rlhf_mcore.quiet import silence_known_warnings

    silence_known_warnings()
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rlhf_mcore.lifetime import tie_helpers_to_this_process

    # a world of one (plain `python launch/x.py`, or torchrun with one process) rendezvouses in-process: no port
    # to pick (a free port can be taken by another job between the pick and the bind), and no RANK/MASTER_* left
    # in the environment for other libraries in this process (accelerate) to mistake for a launcher's
    alone = int(os.environ.get("WORLD_SIZE", "1")) == 1
    tie_helpers_to_this_process()  # helpers that Megatron / multiprocessing start die with this process
    dev = pick_device(device)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        if expandable_segments is not None:
            from rlhf_mcore.parallel.allocator import set_expandable_segments

            set_expandable_segments(expandable_segments)
        torch.cuda.set_device(dev)
    else:
        from rlhf_mcore.parallel import cpu_compat
        cpu_compat.enable(hide_gpus=torch.cuda.device_count() > 0)  # too few GPUs for the world, or device=cpu
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if alone:
            dist.init_process_group(backend=backend, timeout=timeout, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    world = dist.get_world_size()
    dims = ParallelDims.from_world(world, tp, pp, vpp, ep)
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=True, expert_model_parallel_size=ep)
    state = ParallelState(
        dims=dims, rank=dist.get_rank(), local_rank=int(os.environ.get("LOCAL_RANK", "0")), device=dev,
        backend=backend, tp_rank=mpu.get_tensor_model_parallel_rank(), pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(), tp_group=mpu.get_tensor_model_parallel_group(),
        pp_group=mpu.get_pipeline_model_parallel_group(), dp_group=mpu.get_data_parallel_group(),
        mp_group=mpu.get_model_parallel_group(), world_group=dist.group.WORLD,
        cpu_group=dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        ep_rank=mpu.get_expert_model_parallel_rank(), ep_group=mpu.get_expert_model_parallel_group())
    seed_everything(state, seed)
    model_parallel_cuda_manual_seed(seed)
    return state


def seed_everything(state: ParallelState, seed: int) -> int:
    """Per-rank seeds: PP stages differ (megatron's convention), TP ranks share the host RNGs; returns the seed."""
    rank_seed = seed + 100 * state.pp_rank + 10007 * state.dp_rank
    random.seed(rank_seed)
    np.random.seed(rank_seed % (2**32))
    torch.manual_seed(rank_seed)
    return rank_seed


def destroy_distributed() -> None:
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
