"""The CUDA caching allocator's expandable segments in a training process (`trainer.cuda_expandable_segments`).

With expandable segments the allocator grows one mapped range per stream instead of keeping many fixed-size
`cudaMalloc` blocks, so the blocks a phase frees can serve the next phase's requests of other sizes. In the
colocated GSM8K PPO step (generation, three forward passes, two updates over one device) the step ran faster with them
(BENCHMARKS.md, session 50). torchtitan's launcher sets the same default.

`auto` turns them on for the trainer's process when the rollout engine runs inside it (the native engine, Hugging
Face), and leaves the allocator alone with SGLang, whose weight updates open CUDA IPC handles of the trainer's
tensors (IPC of expandable segments is newer than that of plain blocks and has had regressions), and wherever
`PYTORCH_CUDA_ALLOC_CONF` already names `expandable_segments` (the user's choice). `true` / `false` set them either
way. Only this process is changed: processes it starts (an SGLang server) keep their own environment.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional, Union

import torch

ENV_KEYS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the second: torch >= 2.9's device-generic name
OUT_OF_PROCESS_ROLLOUTS = ("sglang",)  # rollout engines that take IPC handles of the trainer's tensors


def expandable_segments_wanted(setting: Union[bool, str], rollout_name: str,
                               environ: Mapping[str, str] = os.environ) -> Optional[bool]:
    """True / False: set the allocator's expandable segments on / off; None: leave the allocator as it is.
    `setting`: `trainer.cuda_expandable_segments` (true, false or "auto", see the module docstring)."""
    if isinstance(setting, bool):
        return setting
    if setting != "auto":
        raise ValueError(f"trainer.cuda_expandable_segments={setting!r}: choose auto, true or false")
    if any("expandable_segments" in environ.get(k, "") for k in ENV_KEYS):
        return None
    return None if rollout_name in OUT_OF_PROCESS_ROLLOUTS else True


def expandable_segments_for(cfg) -> Optional[bool]:
    """`expandable_segments_wanted` for a run config (`trainer.cuda_expandable_segments`, the rollout engine)."""
    return expandable_segments_wanted(cfg.trainer.cuda_expandable_segments, cfg.actor_rollout_ref.rollout.name)


def set_expandable_segments(on: bool) -> None:
    """The allocator's expandable segments on or off for this process's later allocations (CUDA only)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.13; older: the CUDA one
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(f"expandable_segments:{'True' if on else 'False'}")
