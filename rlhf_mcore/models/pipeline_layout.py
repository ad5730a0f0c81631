"""Which decoder layers each pipeline stage holds: the one place the layer-to-stage map is derived.

Megatron-Core places a model's L decoder layers on PP stages from two `TransformerConfig` fields,
`num_layers_in_first_pipeline_stage` and `num_layers_in_last_pipeline_stage`: the first (last) stage holds the
given count, the stages between split the rest evenly; with neither set every stage holds L / PP. Stages are
contiguous: stage p holds the layers after those of stages 0..p-1. With virtual pipeline stages (VPP) the
model is walked in VPP rounds of L / VPP layers; round v is split over the stages in the same proportions
(every count divided by VPP), and chunk v of stage p holds that stage's share of round v.

When PP (× VPP) does not divide L and no split is given, `resolve_split` chooses one: every middle stage
holds ceil(L / PP) layers and the first and last stages share the rest, the first taking the larger half.
First and last are the lighter stages because they also run the embedding (first) and the LM head and loss
(last, the heavier of the two). Qwen2.5-7B's 28 layers at PP=8 become 2, 4, 4, 4, 4, 4, 4, 2; 3 layers at PP=2
become 2, 1.

`build_model` passes the split to Megatron and checks that Megatron's layers (`layer_number`) are exactly the
ones `chunk_layers` gives, so the HF loader, the exporter, the weight sync and the checkpoints, which all name
layers by these global indices, follow one map.
"""
from __future__ import annotations

from typing import Optional

from rlhf_mcore.errors import UserError

FIRST_KEY = "num_layers_in_first_pipeline_stage"
LAST_KEY = "num_layers_in_last_pipeline_stage"


class PipelineLayoutError(UserError, ValueError):
    """A TP/PP/VPP layout or stage split that cannot hold the model; the message names the values and the fix."""

    kind = "config error"


def stage_sizes(num_layers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None,
                vpp: Optional[int] = None) -> list[int]:
    """Layers per PP stage under Megatron's rules, or PipelineLayoutError naming what is inconsistent."""
    vpp = vpp or 1
    if num_layers < 1 or pp < 1:
        raise PipelineLayoutError(f"num_layers={num_layers} and PP={pp} must both be >= 1")
    if pp == 1:
        if first is not None or last is not None:
            raise PipelineLayoutError(
                f"{FIRST_KEY}={first} / {LAST_KEY}={last} apply to pipeline parallelism only; at PP=1 the one stage "
                "holds every layer: remove them.")
        return [num_layers]
    for key, value in ((FIRST_KEY, first), (LAST_KEY, last)):
        if value is not None and (value < 1 or value % vpp):
            raise PipelineLayoutError(
                f"{key}={value} must be >= 1" + (f" and a multiple of the virtual pipeline size {vpp}" if vpp > 1
                                                 else "") + f" (the model has {num_layers} layers, PP={pp}).")
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    given = ", ".join(f"{k}={v}" for k, v in ((FIRST_KEY, first), (LAST_KEY, last)) if v is not None)
    if first is None and last is None:
        if num_layers % (pp * vpp):
            raise PipelineLayoutError(
                f"num_hidden_layers={num_layers} is not divisible by PP×VPP = {pp}×{vpp}: "
                f"{_suggest(num_layers, pp, vpp)}, or choose a PP that divides it.")
        return [num_layers // pp] * pp
    if middle_stages == 0:
        if rest != 0:
            raise PipelineLayoutError(
                f"{given}: at PP={pp} the first and last stages are all the stages, so they must add up to the "
                f"model's {num_layers} layers: {_suggest(num_layers, pp, vpp)}.")
    elif rest < middle_stages * vpp or rest % (middle_stages * vpp):
        raise PipelineLayoutError(
            f"{given} leave {rest} of the model's {num_layers} layers for the {middle_stages} other stage(s) of "
            f"PP={pp}, which need an equal number each, at least 1"
            + (f" and a multiple of VPP={vpp}" if vpp > 1 else "") + f": {_suggest(num_layers, pp, vpp)}.")
    per_middle = rest // middle_stages if middle_stages else 0
    return [first if p == 0 and first is not None else last if p == pp - 1 and last is not None else per_middle
            for p in range(pp)]


def choose_split(num_layers: int, pp: int, vpp: Optional[int] = None) -> tuple[Optional[int], Optional[int]]:
    """(first, last) stage sizes for a model that PP×VPP does not divide (None, None when it does): middle stages
    ceil(L/PP), first and last share the rest (first the larger half). Raises when no split exists."""
    vpp = vpp or 1
    if pp == 1 or num_layers % (pp * vpp) == 0:
        return None, None
    if num_layers % vpp:
        raise PipelineLayoutError(f"num_hidden_layers={num_layers} is not divisible by the virtual pipeline size "
                                  f"VPP={vpp}: every virtual stage holds the same number of layers; choose a VPP "
                                  "that divides it, or none.")
    rounds = num_layers // vpp  # layers per virtual round, split over the PP stages
    if rounds < pp:
        raise PipelineLayoutError(f"num_hidden_layers={num_layers} gives fewer than one layer per stage at "
                                  f"PP={pp}" + (f"×VPP={vpp}" if vpp > 1 else "") + ": use a smaller PP.")
    middle = -(-rounds // pp)
    while pp > 2 and middle > 1 and rounds - (pp - 2) * middle < 2:
        middle -= 1
    ends = rounds - (pp - 2) * middle
    first = -(-ends // 2)
    return first * vpp, (ends - first) * vpp


def resolve_split(num_layers: int, pp: int, vpp: Optional[int] = None, first: Optional[int] = None,
                  last: Optional[int] = None) -> tuple[Optional[int], Optional[int]]:
    """The (first, last) to give Megatron: the user's, checked, or `choose_split`'s when neither is given."""
    if first is None and last is None:
        first, last = choose_split(num_layers, pp, vpp)
    stage_sizes(num_layers, pp, first, last, vpp)
    return first, last


def stage_layers(num_layers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None) -> list[range]:
    """The global (0-based) layer indices of each PP stage, without virtual stages."""
    out, start = [], 0
    for n in stage_sizes(num_layers, pp, first, last):
        out.append(range(start, start + n))
        start += n
    return out


def chunk_layers(num_layers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None,
                 vpp: Optional[int] = None) -> list[list[range]]:
    """[pp_rank][vp_stage] -> the global layer indices of that model chunk (one chunk per stage without VPP)."""
    vpp = vpp or 1
    stage_sizes(num_layers, pp, first, last, vpp)
    if vpp == 1:
        return [[r] for r in stage_layers(num_layers, pp, first, last)]
    per_round = stage_layers(num_layers // vpp, pp, None if first is None else first // vpp,
                             None if last is None else last // vpp)
    step = num_layers // vpp
    return [[range(v * step + r.start, v * step + r.stop) for v in range(vpp)] for r in per_round]


def describe(num_layers: int, pp: int, first: Optional[int], last: Optional[int], vpp: Optional[int] = None) -> str:
    """One line for the log: the layers of every stage."""
    stages = chunk_layers(num_layers, pp, first, last, vpp)
    parts = ["+".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in chunks)
             for chunks in stages]
    return (f"{num_layers} layers over PP={pp}" + (f"×VPP={vpp}" if vpp else "") + ": "
            + ", ".join(f"stage {p}: {s}" for p, s in enumerate(parts))
            + f" ({FIRST_KEY}={first}, {LAST_KEY}={last})")


def _suggest(num_layers: int, pp: int, vpp: int) -> str:
    """A fix for a bad split: the one `choose_split` would pick."""
    try:
        first, last = choose_split(num_layers, pp, vpp)
    except PipelineLayoutError:
        return "use a smaller PP"
    if first is None:
        return f"leave {FIRST_KEY} and {LAST_KEY} unset (PP divides the layers)"
    return f"e.g. set {FIRST_KEY}={first} and {LAST_KEY}={last}, or leave both unset for that split"
