"""The experts' grouped GEMM: rows grouped by expert, each group times its expert's weight, in one kernel on the GPU.

`grouped_mm(x, weight, counts)`: x (T, K) with the rows of expert 0 first, then expert 1's, ... (`counts[e]` rows
each, sum T), weight (E, N, K) in `nn.Linear`'s (out, in) layout per expert -> (T, N), group e's rows times
`weight[e].T`. Two paths, the same numbers up to summation order:

- `torch._grouped_mm(x, weight.transpose(1, 2), offs=cumsum(counts) as int32)` (torch >= 2.8; one CUTLASS kernel
  on sm90 in bf16; `offs[e]` is the end row of group e), chosen on CUDA in bf16 with at least one row
  (`use_grouped_mm`); it has autograd (gradients to x and to the stacked weight). Zero rows are refused by its
  backward (stride check), so an empty batch takes the loop;
- `looped_mm`: one `F.linear` per expert (any device and dtype; an expert with no rows contributes a zero gradient,
  so every weight still gets one).

Used by the train engine's experts (`rlhf_mcore.models.grouped_experts`) and the native rollout's
(`rlhf_mcore.rollout.native.moe`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def use_grouped_mm(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether `grouped_mm` runs `torch._grouped_mm` on x (CUDA, bf16, at least one row, torch has it; with
    `weight`, its in and out widths multiples of 8: the kernel's 16-byte alignment)."""
    aligned = weight is None or (weight.shape[1] % 8 == 0 and weight.shape[2] % 8 == 0)
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] > 0 and hasattr(torch, "_grouped_mm")
            and aligned)


def group_offsets(counts: torch.Tensor, device) -> torch.Tensor:
    """`torch._grouped_mm`'s offs: the int32 end row of each group."""
    return torch.cumsum(counts.to(device=device), 0, dtype=torch.int32)


def looped_mm(x: torch.Tensor, weight: torch.Tensor, counts) -> torch.Tensor:
    """`grouped_mm` as one GEMM per expert. counts: a tensor or a list of ints."""
    sizes = counts.tolist() if torch.is_tensor(counts) else list(counts)
    parts = torch.split(x, sizes)
    return torch.cat([F.linear(part, weight[e]) for e, part in enumerate(parts)], dim=0)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool | None = None
               ) -> torch.Tensor:
    """(T, N): each expert's rows of x (T, K) times its weight (E, N, K) transposed (module docstring). grouped:
    force a path (None: `use_grouped_mm(x, weight)`; True on a CPU in fp32 runs torch's CPU `_grouped_mm`)."""
    if weight.shape[0] != counts.numel():
        raise ValueError(f"{counts.numel()} group sizes for {weight.shape[0]} experts")
    if grouped is None:
        grouped = use_grouped_mm(x, weight)
    if not grouped or x.shape[0] == 0:
        return looped_mm(x, weight, counts)
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=group_offsets(counts, x.device))
