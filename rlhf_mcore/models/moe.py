"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE): their HF config fields, Megatron's MoE settings and layer specs.

The HF routing that Megatron's `TopKRouter` reproduces exactly:

- `probs = softmax(x @ gate.T)` over all experts, the top `num_experts_per_tok` taken; with `norm_topk_prob` the
  k weights are renormalised to sum to 1. Megatron: `moe_router_pre_softmax=False` (top-k of the logits, softmax over
  those k: the same numbers) when `norm_topk_prob`, else `moe_router_pre_softmax=True` (softmax, then top-k);
  the router runs in fp32 (`moe_router_dtype="fp32"`, HF's softmax is in fp32 too);
- a layer is sparse when it is not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`
  (Megatron: `moe_layer_freq` as a 0/1 list), dense layers keep `intermediate_size`;
- Qwen2-MoE's shared expert (`shared_expert_intermediate_size`) is added to the routed output scaled by
  `sigmoid(x @ shared_expert_gate.T)`: Megatron's `SharedExpertMLP` with `moe_shared_expert_gate=True`.

Experts are sharded by expert parallelism (EP): EP rank r holds the experts `r * E / EP .. (r + 1) * E / EP - 1`,
each one TP-sharded like a dense MLP (expert TP = TP), stacked in `grouped_experts.GroupedExperts` (one grouped GEMM
per projection; it replaces Megatron's `SequentialMLP`, whose names and checkpoint layout it keeps). Tokens move
between EP ranks through Megatron's alltoall dispatcher. The load-balancing loss and the z-loss are Megatron's
(`moe_aux_loss_coeff`, `moe_z_loss_coeff`; both off by default, as in veRL).
"""
from __future__ import annotations

import copy

MOE_DISPATCHER = "alltoall"
# the train engine's experts on the local specs: "grouped" (`grouped_experts.GroupedExperts`) or Megatron's
# "sequential" `SequentialMLP`. Not a config key (grouped computes the same numbers, faster): the switch is for the
# side-by-side benchmark (launch/bench/bench_moe.py --train-experts) and tests.
TRAIN_EXPERTS = "grouped"


def sparse_layers(cfg: dict, num_layers: int, num_experts: int) -> tuple:
    """The global indices of the MoE layers, by HF's rule (`Qwen3MoeDecoderLayer` / `Qwen2MoeDecoderLayer`)."""
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    return tuple(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)


def moe_shape_fields(cfg: dict, arch: str, num_layers: int, UnsupportedModelError=ValueError) -> dict:
    """The MoE fields of `ModelShape` from a Qwen3-MoE / Qwen2-MoE config.json; raises `UnsupportedModelError`
    (hf_config's, passed in: this module does not import hf_config) on what is not supported."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not experts:
        raise UnsupportedModelError(f"config.json of {arch} lacks 'num_experts' (or 'num_local_experts')")
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if key not in cfg:
            raise UnsupportedModelError(f"config.json of {arch} lacks {key!r}")
    top_k = int(cfg["num_experts_per_tok"])
    if not 0 < top_k <= int(experts):
        raise UnsupportedModelError(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch.startswith("Qwen2Moe") else 0
    if arch.startswith("Qwen3Moe") and cfg.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError(f"shared_expert_intermediate_size is set, but {arch} has no shared expert; "
                                    "remove the key (or use Qwen2MoeForCausalLM).")
    layers = sparse_layers(cfg, num_layers, int(experts))
    if not layers:
        raise UnsupportedModelError(f"{arch} with no sparse layer (mlp_only_layers={cfg.get('mlp_only_layers')}, "
                                    f"decoder_sparse_step={cfg.get('decoder_sparse_step')}): use the dense "
                                    "architecture instead.")
    return dict(num_experts=int(experts), moe_top_k=top_k, moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=layers,
                shared_expert_ffn_hidden_size=shared)


def validate_expert_layout(shape, tp: int, ep: int) -> None:
    """Fail early, naming the setting, when EP / TP cannot shard the experts."""
    from rlhf_mcore.models.pipeline_layout import PipelineLayoutError

    if not shape.is_moe:
        raise PipelineLayoutError(f"expert_model_parallel_size={ep} needs a mixture-of-experts model; "
                                  f"{shape.architecture} has no experts: set it to 1.")
    if shape.num_experts % ep:
        raise PipelineLayoutError(f"expert_model_parallel_size={ep} must divide num_experts={shape.num_experts}")
    for name, width in (("moe_intermediate_size", shape.moe_ffn_hidden_size),
                        ("shared_expert_intermediate_size", shape.shared_expert_ffn_hidden_size)):
        if width % tp:
            raise PipelineLayoutError(f"tensor parallel size {tp} must divide {name}={width}")


def moe_config_kwargs(shape, ep: int, overrides: dict) -> dict:
    """`TransformerConfig` fields of the MoE layers (overrides may set moe_aux_loss_coeff / moe_z_loss_coeff)."""
    aux = overrides.get("moe_aux_loss_coeff", 0.0) or 0.0
    kwargs = dict(
        num_moe_experts=shape.num_experts, moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_router_topk=shape.moe_top_k, moe_router_pre_softmax=not shape.norm_topk_prob,
        moe_router_score_function="softmax", moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux else "none",
        moe_token_dispatcher_type=MOE_DISPATCHER, moe_grouped_gemm=False, moe_permute_fusion=False,
        moe_layer_freq=[1 if i in shape.moe_layers else 0 for i in range(shape.num_layers)],
        expert_model_parallel_size=ep,
    )
    if shape.shared_expert_ffn_hidden_size:
        kwargs.update(moe_shared_expert_intermediate_size=shape.shared_expert_ffn_hidden_size,
                      moe_shared_expert_gate=True)
    return kwargs


def define_missing_te_gemm() -> None:
    """megatron-core 0.16.1's router GEMM (`moe_utils.RouterGatingLinearFunction`) tests `te_general_gemm is not
    None`, a name that module only defines when Transformer Engine imports: without TE every MoE forward raises
    NameError. Defining it as None selects the function's own torch path (its documented fallback)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def moe_block_spec(config, backend: str, vp_stage, pp_rank: int):
    """The decoder block spec of this PP (virtual) stage: Megatron's per-layer dense / MoE specs, with the "sdpa"
    backend's core attention (`attention.SDPACoreAttention`) in every layer, and (local specs: "sdpa", "local") the
    MoE layers' experts `grouped_experts.GroupedExperts` instead of Megatron's `SequentialMLP`. The "te" spec keeps
    Megatron's choice (TE's grouped experts when `moe_grouped_gemm`, else its sequential ones)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from rlhf_mcore.models.grouped_experts import GroupedExperts

    if TRAIN_EXPERTS not in ("grouped", "sequential"):
        raise ValueError(f"moe.TRAIN_EXPERTS={TRAIN_EXPERTS!r}: choose 'grouped' or 'sequential'")
    define_missing_te_gemm()
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=backend == "te", normalization="RMSNorm",
                                       vp_stage=vp_stage, pp_rank=pp_rank)
    if backend == "te":
        return block
    block = copy.deepcopy(block)
    for spec in block.layer_specs:
        mlp = spec.submodules.mlp
        if mlp.module is MoELayer and TRAIN_EXPERTS == "grouped":  # SequentialMLP -> grouped GEMMs
            mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    if backend != "sdpa":
        return block
    from rlhf_mcore.models.attention import SDPACoreAttention

    for spec in block.layer_specs:
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return block


def expert_offset(shape, ep_rank: int, ep: int) -> int:
    """The global index of this EP rank's first expert."""
    return ep_rank * (shape.num_experts // ep) if shape.is_moe else 0


def moe_loss_metrics(state, role: str, micro_batches: int) -> dict:
    """The load-balancing and z-losses of the training passes since the last call, from Megatron's MoE tracker
    (filled by the routers in training forward passes with gradients, one unscaled value per MoE layer and
    micro-batch), reduced over PP and DP: `{role}/moe_load_balancing_loss` and `{role}/moe_z_loss`, each the mean
    over layers and micro-batches; the tracker is cleared. Empty when the losses are off (coefficients 0)."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    if not tracker or micro_batches <= 0:
        return {}
    names = sorted(tracker)
    reduce_aux_losses_tracker_across_ranks(names, pg_collection=state.pg_collection)
    out = {}
    for name in names:
        values = tracker[name]["values"]  # (num_layers,): the sum over micro-batches of each layer's loss
        layers = int((values != 0).sum())
        if layers:
            out[f"{role}/moe_{name}"] = float(values.sum()) / layers / micro_batches
    clear_aux_losses_tracker()
    return out
