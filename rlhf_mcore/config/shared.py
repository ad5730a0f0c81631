"""Sections that appear under several roles: the optimizer, the Megatron layout, dtypes and sampling rules.

Each rule here is written once and holds wherever the section is nested (:mod:`.checks`): `OptimConfig` under
`actor_rollout_ref.actor`, `critic` and `reward.reward_model.model` (PRIME's implicit PRM) alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from rlhf_mcore.config.checks import above, at_least, checked, finite, unset_or, within

Dtype = Literal["auto", "bfloat16", "float16", "float32"]  # auto: bf16 on GPU, fp32 on CPU
Strategy = Literal["megatron"]

# Sampling rules shared by the rollout, its validation kwargs and the judge.
TEMPERATURE = dict(ok=at_least(0), what=">= 0 (0 is greedy)")
TOP_P = dict(ok=lambda v: 0 < v <= 1, what="in (0, 1]")
TOP_K = dict(ok=lambda v: v == -1 or v > 0, what="-1 (off) or > 0")
AT_LEAST_ONE = dict(ok=at_least(1), what=">= 1")
GRAD_CLIP = dict(ok=above(0), what="> 0 (the max global gradient norm)")
FINITE = dict(ok=finite, what="a finite number")

# LoRA (veRL's model keys lora_rank / lora_alpha / target_modules / lora_adapter_path; rlhf_mcore.models.lora)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_targets_ok(v) -> bool:
    """`all-linear`, one of LORA_TARGETS, or a non-empty list of them."""
    names = [v] if isinstance(v, str) else list(v) if isinstance(v, (list, tuple)) or hasattr(v, "__iter__") else []
    return names == ["all-linear"] or (bool(names) and all(n in LORA_TARGETS for n in names))


LORA_RANK = dict(ok=at_least(0), what=">= 0 (0: LoRA off; e.g. 16)")
LORA_ALPHA = dict(ok=lambda v: finite(v) and v > 0, what="> 0 (the adapters' scale is lora_alpha / lora_rank)")
LORA_TARGET_MODULES = dict(ok=lora_targets_ok, what=f"'all-linear' or a list of {', '.join(LORA_TARGETS)}")


@dataclass
class OptimConfig:
    lr: float = checked(1e-6, ok=lambda v: finite(v) and v >= 0, what=">= 0 (e.g. 1e-6)")
    min_lr_ratio: float = checked(0.0, ok=within(0, 1), what="in [0, 1]")
    lr_warmup_steps: int = -1  # < 0: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = checked(0.0, ok=within(0, 1), what="in [0, 1]")
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"  # after warmup
    weight_decay: float = checked(0.01, ok=at_least(0), what=">= 0")
    betas: list[float] = checked(factory=lambda: [0.9, 0.999], ok=lambda b: len(b) == 2 and all(0 <= x < 1 for x in b),
                                 what="two numbers in [0, 1)")
    eps: float = checked(1e-8, ok=above(0), what="> 0")
    total_training_steps: int = -1  # filled in by the trainer


@dataclass
class OverrideTransformerConfig:
    """veRL's `megatron.override_transformer_config`: here only the uneven pipeline split (layers on the first /
    last PP stage; the stages between share the rest evenly). Unset and PP not dividing the layers: a split is
    chosen (rlhf_mcore.models.pipeline_layout)."""

    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    # mixture-of-experts models (rlhf_mcore.models.moe): Megatron's load-balancing loss and router z-loss, added to
    # this role's training loss; their values are logged as <role>/moe_load_balancing_loss, <role>/moe_z_loss.
    # A dense model refuses a value other than the default.
    moe_aux_loss_coeff: float = checked(0.0, ok=lambda v: finite(v) and v >= 0, what=">= 0 (0: off; e.g. 1e-3)")
    moe_z_loss_coeff: Optional[float] = checked(None, ok=unset_or(lambda v: finite(v) and v > 0),
                                                what="unset (off) or > 0 (e.g. 1e-3)")
    # Activation recompute (Megatron's keys, where veRL passes them). recompute_granularity: full recomputes whole
    # layers, as the role's model.enable_gradient_checkpointing=true does; selective recomputes the modules of
    # recompute_modules in every layer (only core_attn runs without Transformer Engine; veRL's default list, read
    # only with selective). For whole layers, recompute_method `uniform` recomputes every layer, keeping the input
    # of each run of recompute_num_layers layers (which must divide a model chunk's layers); `block` recomputes only
    # the first recompute_num_layers layers of each model chunk, and the others keep their activations: fewer layers
    # run twice, more memory held. Unset: uniform, 1 (the least memory).
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])
    recompute_method: Optional[Literal["uniform", "block"]] = None
    recompute_num_layers: Optional[int] = checked(None, ok=unset_or(at_least(1)), what="unset or >= 1")
    # Megatron's fusion of each linear layer's weight-gradient GEMM with its accumulation into the fp32 main_grad
    # (rlhf_mcore.models.grad_accum_fusion: cuBLAS through torch, no APEX needed): no bf16 gradient per micro-batch,
    # no separate add. Trained roles only (actor, critic); the decoder then runs eager (no CUDA graphs), and it is
    # refused with LoRA and FP8 training. Off by default until measured on a GPU (BENCHMARKS.md)
    gradient_accumulation_fusion: bool = False


@dataclass
class MegatronConfig:
    """The parallel layout of a Megatron model. The actor's layout is the process layout; ref and critic
    inherit it (a different one would need a second set of process groups, not supported yet)."""

    tensor_model_parallel_size: Optional[int] = None
    pipeline_model_parallel_size: Optional[int] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
    # mixture-of-experts models: each MoE layer's experts split over this many data-parallel ranks (it must divide
    # DP); unset: 1 for the actor, the actor's for ref and critic (one process layout)
    expert_model_parallel_size: Optional[int] = checked(None, ok=unset_or(at_least(1)), what="unset or >= 1")
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    seed: int = 42
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    # the decoder as CUDA graphs for packed micro-batches (rlhf_mcore.engine.cuda_graphs): unset (null) on where
    # supported (CUDA, TP = PP = CP = 1, no recompute) for micro-batches of <= 8,192 tokens (the host-bound ones);
    # true: every micro-batch (an error says why where they cannot run); false: off
    cuda_graphs: Optional[bool] = None
    # FP8 GEMMs in the decoder's linear layers (rlhf_mcore.models.fp8_training; no Transformer Engine): null (off),
    # e4m3 (forward and gradients e4m3) or hybrid (gradients e5m2), Megatron's names; actor and critic only, CUDA
    # GPUs with FP8 tensor cores (sm >= 89)
    fp8: Optional[Literal["e4m3", "hybrid"]] = None
    # how fp8 scales its GEMM operands (rlhf_mcore.kernels.fp8_linear): rowwise (one scale per token and per
    # channel; measured in BENCHMARKS.md) or tensorwise (one per tensor, Transformer Engine's; less quantization
    # traffic, cuBLAS's faster tensor-wise GEMM, narrower range: pair it with fp8=hybrid). Read only with fp8 set
    # delayed: tensorwise with the activations' and gradients' scales from the amaxes of the last
    # fp8_amax_history_len optimizer steps (Transformer Engine's DelayedScaling, Megatron's fp8_recipe=delayed): each
    # cast reads its tensor once instead of twice; values beyond the history's amax saturate
    fp8_recipe: Literal["rowwise", "tensorwise", "delayed"] = "rowwise"
    # fp8_recipe=delayed only: how many optimizer steps' amaxes a scale is the maximum of (Megatron's name)
    fp8_amax_history_len: int = checked(16, ok=lambda v: isinstance(v, int) and v >= 1, what="an integer >= 1")
    # tensorwise and delayed only: each decoder linear keeps its weight's FP8 codes (and their transpose) from its
    # first forward after an optimizer step to the next, as Transformer Engine does across micro-batches, instead of
    # casting W in every forward (each micro-batch, both passes under recompute); costs 2 bytes a parameter of GPU
    # memory while kept (dropped at each optimizer step, load and offload); "forward": only the codes (1 byte a
    # parameter), their transpose copied from them once per micro-batch, for updates that cannot spare 2 bytes (a 7B
    # update on one H200). Measured in BENCHMARKS.md (issue 36, sessions 39-40)
    fp8_weight_cache: Union[bool, str] = checked(False, ok=lambda v: v in (False, True, "forward"),
                                                 what="false, true (codes and transposes) or forward (codes only)")
    override_transformer_config: OverrideTransformerConfig = field(default_factory=OverrideTransformerConfig)
