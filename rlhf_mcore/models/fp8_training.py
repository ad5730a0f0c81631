"""FP8 GEMMs in the decoder's linear layers of a Megatron `GPTModel` (`<role>.megatron.fp8`), without Transformer
Engine.

Each `ColumnParallelLinear` / `RowParallelLinear` inside `model.decoder` (QKV, attention output, MLP fc1 and fc2)
gets its `_forward_impl` replaced by :func:`rlhf_mcore.kernels.fp8_linear.fp8_linear_train` (forward e4m3,
gradients e4m3 or e5m2, current scaling per row and channel), or under `<role>.megatron.fp8_recipe=tensorwise` by
:func:`rlhf_mcore.kernels.fp8_linear.fp8_linear_train_tensorwise` (one scale per tensor; each layer keeps its
weight's amax between optimizer steps), or under `fp8_recipe=delayed` by the same with the activations' and
gradients' scales from the amaxes of the last `fp8_amax_history_len` optimizer steps (one `ActivationAmaxes` per
chunk, `chunk.fp8_activation_amaxes`, rolled by the train engine after each step: `roll_activation_amaxes`), where
each dense SwiGLU MLP also runs as one Function whose SwiGLU kernels write fc2's input and fc1's output gradient as
FP8 codes (`_fuse_swiglu_mlp`, `kernels/fp8_mlp.py`; the same numbers as the two linears). The embedding, the LM
head (`model.output_layer`, outside the decoder), norms and attention stay in the model's dtype; parameters,
gradients and the optimizer are untouched.

Mixture-of-experts models are refused (their experts are `grouped_experts.GroupedExperts`, grouped bf16 GEMMs
with no FP8 path).

Formats follow Megatron / Transformer Engine's names: "e4m3" (everything e4m3) and "hybrid" (e5m2 gradients).
"""

from __future__ import annotations

import os

from rlhf_mcore.kernels.fp8 import E4M3, E5M2, Fp8Unsupported, check_fp8_device
from rlhf_mcore.kernels.fp8_linear import (
    PER_TENSOR,
    RECIPES,
    ActivationAmaxes,
    DelayedSites,
    WeightAmax,
    fp8_linear_train,
    fp8_linear_train_tensorwise,
)

FORMATS = {"e4m3": E4M3, "hybrid": E5M2}  # format -> gradient dtype (the forward is e4m3 in both)
# The delayed recipe runs SwiGLU MLPs as one Function (`_fuse_swiglu_mlp`); RLHF_MCORE_FP8_FUSED_MLP=0 keeps the two
# linears (the same numbers: for A/B measurements, read when FP8 is enabled; tests set this flag instead).
FUSE_SWIGLU_MLP = True


def enable_fp8_training(chunks, fmt: str, key: str, recipe: str = "rowwise", weight_cache: bool | str = False,
                        amax_history: int = 16) -> int:
    """Switch the decoder linears of every model chunk to FP8 GEMMs under `recipe` (rowwise, tensorwise or delayed);
    returns how many layers were switched. weight_cache (tensorwise and delayed, `<role>.megatron.fp8_weight_cache`):
    each layer keeps its weight's FP8 codes (true: and their transpose; "forward": the codes only) from the first
    forward after an optimizer step to the next (`WeightAmax.keep_codes`). amax_history (delayed,
    `<role>.megatron.fp8_amax_history_len`): how many optimizer steps' amaxes a scale is the maximum of.
    Refused (Fp8Unsupported, one line naming `key`) for MoE models, without an FP8 GPU, with sequence parallelism,
    dims not multiples of 16, a weight cache under the rowwise recipe, or no Megatron local-spec linears to switch.
    Under Megatron's gradient-accumulation fusion the FP8 weight gradients accumulate into main_grad
    (`kernels.fp8_wgrad`)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if fmt not in FORMATS:
        raise Fp8Unsupported(f"{key}={fmt!r}: choose e4m3 or hybrid (e5m2 gradients), or null (off).")
    if recipe not in RECIPES:
        raise Fp8Unsupported(f"{key}_recipe={recipe!r}: choose one of {', '.join(RECIPES)}.")
    if weight_cache and recipe not in PER_TENSOR:
        raise Fp8Unsupported(f"{key}_weight_cache={str(weight_cache).lower()} needs {key}_recipe=tensorwise or "
                             f"delayed (the {recipe} recipe casts the weight per channel along each axis, which is not "
                             "kept); set it to false.")
    grad_dtype, switched = FORMATS[fmt], 0
    _refuse_grouped_experts(chunks, fmt, key)
    for chunk in chunks:
        decoder = getattr(chunk, "decoder", None)
        linears = [(name, mod) for name, mod in (decoder.named_modules() if decoder is not None else ())
                   if isinstance(mod, (ColumnParallelLinear, RowParallelLinear))]
        amaxes = None
        if recipe == "delayed" and linears:
            amaxes = chunk.fp8_activation_amaxes = ActivationAmaxes(2 * len(linears), amax_history,
                                                                    linears[0][1].weight.device)
        for name, mod in linears:
            check_fp8_device(mod.weight.device, key)
            why = ("sequence_parallel=true" if mod.sequence_parallel else
                   f"weight shape {tuple(mod.weight.shape)} (FP8 GEMM dims must be multiples of 16)"
                   if any(d % 16 for d in mod.weight.shape) else None)
            if why is not None:
                raise Fp8Unsupported(f"{key}={fmt}: decoder layer {name} cannot run FP8 GEMMs with {why}; set {key} "
                                     "to null for this run.")
            mod._forward_impl = _fp8_impl(mod, grad_dtype, recipe, weight_cache, amaxes)
            if recipe in PER_TENSOR:  # kept on the chunk too, for invalidate_weight_amaxes (no module walk)
                chunk.fp8_weight_amaxes = [*getattr(chunk, "fp8_weight_amaxes", ()), mod.fp8_weight_amax]
            switched += 1
        if amaxes is not None and FUSE_SWIGLU_MLP and os.environ.get("RLHF_MCORE_FP8_FUSED_MLP", "1") != "0":
            chunk.fp8_fused_mlps = sum(_fuse_swiglu_mlp(mlp, grad_dtype) for mlp in _mlps(decoder))
    if switched == 0:
        raise Fp8Unsupported(f"{key}={fmt}: no Megatron local-spec linear layers in the decoder to switch (a "
                             "Transformer Engine spec has its own FP8); set it to null.")
    return switched


def _refuse_grouped_experts(chunks, fmt: str, key: str) -> None:
    """MoE models are refused: their experts (`grouped_experts.GroupedExperts`, bf16 grouped GEMMs) have no FP8
    path, and switching only attention would be a different recipe than `{key}` promises."""
    from rlhf_mcore.models.grouped_experts import GroupedExperts

    for chunk in chunks:
        if any(isinstance(m, GroupedExperts) for m in chunk.modules()):
            raise Fp8Unsupported(f"{key}={fmt}: FP8 training of mixture-of-experts models is not supported (their "
                                 "experts run as bf16 grouped GEMMs, which have no FP8 path here); set it to null.")


def invalidate_weight_amaxes(chunks) -> int:
    """Forget every tensorwise layer's kept weight amax and codes (after the weights changed: an optimizer step, a
    load; and at an offload, so that kept codes do not hold GPU memory); returns how many. A no-op for rowwise or
    no FP8."""
    caches = [c for chunk in chunks for c in getattr(chunk, "fp8_weight_amaxes", ())]
    for cache in caches:
        cache.invalidate()
    return len(caches)


def roll_activation_amaxes(chunks) -> int:
    """After an optimizer step: each "delayed" chunk's activation and gradient amaxes of the step enter its history
    (`ActivationAmaxes.roll`); returns how many chunks rolled. A no-op for the other recipes or no FP8."""
    rolled = [c.fp8_activation_amaxes for c in chunks if getattr(c, "fp8_activation_amaxes", None) is not None]
    for amaxes in rolled:
        amaxes.roll()
    return len(rolled)


def _mlps(decoder):
    from megatron.core.transformer.mlp import MLP

    return [m for m in decoder.modules() if type(m) is MLP] if decoder is not None else []


def _fuse_swiglu_mlp(mlp, grad_dtype) -> bool:
    """Under the delayed recipe, run a dense SwiGLU MLP whose two linears were switched as one
    `fp8_mlp.Fp8SwiGLUMLPFunction` (the SwiGLU kernels write fc2's input and fc1's output gradient as FP8 codes:
    the same codes as the two linears around the activation, without the bf16 tensors between). Megatron's
    plain layout only (no biases, no gathered or scattered activations, no activation clamp or offset, no deferred
    embedding wgrad); any other MLP keeps the two linears (the same numbers, one bf16 round trip more). Returns
    whether it was fused."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    from rlhf_mcore.kernels.fp8_mlp import EAGER_SWIGLU, TRITON_SWIGLU, LinearState, fp8_swiglu_mlp
    from rlhf_mcore.models.fused_layers import FusedSwiGLU

    fc1, fc2, cfg = mlp.linear_fc1, mlp.linear_fc2, mlp.config
    states = [getattr(fc, "fp8_delayed", None) for fc in (fc1, fc2)]
    eager = (cfg.gated_linear_unit and cfg.activation_func is F.silu and not cfg.use_te_activation_func
             and not cfg.bias_activation_fusion and cfg.activation_func_clamp_value is None
             and not cfg.glu_linear_offset)
    act = TRITON_SWIGLU if isinstance(mlp.activation_func, FusedSwiGLU) else EAGER_SWIGLU if eager else None
    plain = (act is not None and None not in states and fc1.bias is None and fc2.bias is None
             and not fc1.gather_output and fc2.input_is_parallel and not fc1.explicit_expert_comm
             and not fc2.explicit_expert_comm and not getattr(fc1, "disable_grad_reduce", False)
             and not cfg.defer_embedding_wgrad_compute)
    if not plain:
        return False
    fc1_state = LinearState(fc1.fp8_weight_amax, fc1.fp8_delayed)
    fc2_state = LinearState(fc2.fp8_weight_amax, fc2.fp8_delayed)

    def forward(hidden_states, per_token_scale=None, **_unused):
        if per_token_scale is not None:
            raise ValueError("the FP8 SwiGLU MLP has no per_token_scale (a mixture-of-experts input; FP8 refuses MoE)")
        group = fc1.tp_group if fc1.allreduce_dgrad else None
        out = fp8_swiglu_mlp(hidden_states, fc1.weight, fc2.weight, fc1_state, fc2_state, act, grad_dtype, group,
                             bool(fc1.gradient_accumulation_fusion))
        return reduce_from_tensor_model_parallel_region(out, group=fc2.tp_group), None

    mlp.forward = forward
    return True


def _fp8_impl(mod, grad_dtype, recipe: str, weight_cache: bool | str = False, amaxes: ActivationAmaxes | None = None):
    """A `_forward_impl` with Megatron's keyword arguments (linear_with_grad_accumulation_and_async_allreduce).
    Tensorwise and delayed: the layer's weight amax (with weight_cache, also its codes) lives on the layer
    (`mod.fp8_weight_amax`) between calls; delayed: its two sites of the chunk's `amaxes` too (`mod.fp8_delayed`)."""
    if recipe in PER_TENSOR:
        mod.fp8_weight_amax = WeightAmax(keep_codes=weight_cache)
        mod.fp8_delayed = DelayedSites(amaxes) if amaxes is not None else None

    def impl(input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
             sequence_parallel=False, **_unused):
        group = getattr(mod, "tp_group", None) if allreduce_dgrad else None
        fuse = bool(gradient_accumulation_fusion) and weight.requires_grad
        if recipe in PER_TENSOR:
            return fp8_linear_train_tensorwise(input, weight, bias, grad_dtype, group, mod.fp8_weight_amax, fuse,
                                               mod.fp8_delayed)
        return fp8_linear_train(input, weight, bias, grad_dtype, group, fuse)

    return impl
