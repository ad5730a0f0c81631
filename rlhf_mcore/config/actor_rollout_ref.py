"""The `actor_rollout_ref` section: the policy's model, its training (actor), generation (rollout, multi-turn)
and the reference policy."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from omegaconf import MISSING

from rlhf_mcore.config.checks import above, at_least, checked, choice, unset_or, within
from rlhf_mcore.config.shared import (
    AT_LEAST_ONE,
    GRAD_CLIP,
    LORA_ALPHA,
    LORA_RANK,
    LORA_TARGET_MODULES,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    Dtype,
    MegatronConfig,
    OptimConfig,
    Strategy,
)


@dataclass
class ModelConfig:
    path: str = MISSING  # a Hugging Face model directory
    dtype: Dtype = "auto"
    enable_gradient_checkpointing: bool = False
    use_remove_padding: bool = True  # packed (THD) sequences in the train engine
    # the rows of a micro-batch that share a prompt pack it once, their responses attending to it (the actor's update
    # and log-prob passes, the reference's; rlhf_mcore.engine.shared_prefix): GRPO's n samples per prompt compute the
    # prompt once instead of n times; the same log-probs and gradients up to summation order
    share_prompt_prefix: bool = False
    # must stay false: models load through rlhf_mcore's own code, never the repo's
    trust_remote_code: bool = checked(False, ok=lambda v: not v, what=(
        "false: rlhf_mcore builds Qwen2/Qwen2.5/Qwen3/Llama models with its own code and never runs a model "
        "repository's Python"))
    # LoRA: adapters on the linear layers, the base frozen (0: full fine-tuning); veRL's keys
    lora_rank: int = checked(0, **LORA_RANK)
    lora_alpha: float = checked(16.0, **LORA_ALPHA)
    target_modules: Any = checked("all-linear", **LORA_TARGET_MODULES)
    lora_adapter_path: Optional[str] = None  # a PEFT adapter directory to start from (r, alpha, targets must match)


@dataclass
class RouterReplayConfig:
    """veRL's `actor_rollout_ref.actor.router_replay` (mixture-of-experts models; rlhf_mcore.models.routing_replay):
    the training passes route each token to the experts another pass chose. disabled: each pass routes by itself;
    R2: the old-log-prob pass's routes are replayed in the update passes; R3: the rollout's routes (recorded by the
    native engine) are replayed in the old-log-prob, reference and update passes."""

    mode: Literal["disabled", "R2", "R3"] = "disabled"


@dataclass
class ActorConfig:
    strategy: Strategy = "megatron"
    ppo_mini_batch_size: int = 256  # prompts per optimizer step
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # sequences per forward/backward per DP rank
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = checked(1, **AT_LEAST_ONE)
    shuffle: bool = False
    grad_clip: float = checked(1.0, **GRAD_CLIP)
    clip_ratio: float = checked(0.2, ok=lambda v: 0 < v < 1, what="in (0, 1), e.g. 0.2")
    clip_ratio_low: Optional[float] = checked(None, ok=unset_or(lambda v: 0 < v < 10),
                                              what="unset or > 0 (e.g. 0.2; clip-higher uses 0.28)")
    clip_ratio_high: Optional[float] = checked(None, ok=unset_or(lambda v: 0 < v < 10),
                                               what="unset or > 0 (e.g. 0.2; clip-higher uses 0.28)")
    # dual-clip lower bound for negative advantages
    clip_ratio_c: float = checked(3.0, ok=above(1), what="> 1 (dual-clip bound, e.g. 3)")
    policy_loss: str = "vanilla"  # vanilla (PPO clip) | gspo | ... (registry in rlhf_mcore.algos)
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None  # seq-mean-token-sum-norm's constant (e.g. max_response_length)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = checked(0.001, ok=at_least(0), what=">= 0")
    kl_loss_type: str = "low_var_kl"
    # the rollout's log-probs are the old policy: no old-log-prob forward pass (veRL's bypass mode)
    use_rollout_log_probs: bool = False
    # when nothing reads the old log-probs before the update (no KL in the reward, no rollout correction, not a
    # MoE actor), those of the update's first mini-batch are its own log-probs, detached (no optimizer step has
    # run yet): the same loss and gradient, and the old-log-prob pass leaves those rows out -- no pass at all when
    # the update is one optimizer step on the whole batch (rlhf_mcore.trainer.learner.Learner.old_from_update);
    # false: the pass takes every row
    old_log_prob_from_update: bool = True
    logprob_backend: str = "auto"  # log-prob/entropy kernel: auto (triton on CUDA if installed) | torch | triton
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class SamplingKwargs:
    temperature: float = checked(0.0, **TEMPERATURE)
    top_k: int = checked(-1, **TOP_K)
    top_p: float = checked(1.0, **TOP_P)
    n: int = checked(1, **AT_LEAST_ONE)
    do_sample: bool = False


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools and environments (rlhf_mcore.agents); veRL's names where they exist."""

    enable: bool = False
    max_assistant_turns: int = checked(5, ok=within(1, 255), what="in [1, 255]")  # model turns per trajectory
    max_user_turns: int = checked(5, ok=at_least(0), what=">= 0")  # environment / user turns per trajectory
    tool_config_path: Optional[str] = None  # YAML: the run's tools (rlhf_mcore.agents.tools)
    format: Literal["hermes"] = "hermes"  # how tool calls are written: <tool_call>{"name", "arguments"}</tool_call>
    # per model turn; None: what is left of data.max_response_length
    max_tokens_per_turn: Optional[int] = checked(None, ok=unset_or(at_least(1)),
                                                 what="unset (what is left of data.max_response_length) or >= 1")
    tool_timeout_s: float = checked(30.0, ok=above(0), what="> 0 seconds")  # per call (a tool may set its own)
    max_parallel_calls: int = checked(4, **AT_LEAST_ONE)  # calls run per model turn; more get an error message
    tool_workers: int = checked(16, **AT_LEAST_ONE)  # threads running tool calls
    default_agent: str = "single_turn_agent"  # agent loop of rows without an agent_name


@dataclass
class RolloutConfig:
    name: Literal["native", "hf", "sglang"] = "native"
    # sync: the only mode; veRL's server-based "async" rollout is not implemented
    mode: Literal["sync"] = choice("sync", hint=(
        "veRL's async server rollout is not a rollout mode here; the asynchronous trainers are "
        "async_training.mode=one_step_off or fully_async (off: synchronous), so set that instead"))
    temperature: float = checked(1.0, **TEMPERATURE)
    top_k: int = checked(-1, **TOP_K)
    top_p: float = checked(1.0, **TOP_P)
    n: int = checked(1, **AT_LEAST_ONE)
    prompt_length: Optional[int] = None  # veRL's copy of data.max_prompt_length: unset, or equal to it
    response_length: Optional[int] = None  # veRL's copy of data.max_response_length: unset, or equal to it
    dtype: Dtype = "auto"
    gpu_memory_utilization: float = checked(0.5, ok=lambda v: 0 < v <= 1, what="in (0, 1]")
    tensor_model_parallel_size: int = checked(1, **AT_LEAST_ONE)
    max_num_seqs: int = checked(256, **AT_LEAST_ONE)
    free_cache_engine: bool = True
    # what the rollout releases after generating (with free_cache_engine): 1 = its KV cache, weights kept (synced
    # after each update); 2 = its weights too, re-sent at the next wake after the training engines' offload (the
    # order a 7B model needs to fit one H200, BENCHMARKS.md)
    sleep_level: int = 1
    enforce_eager: bool = False  # no CUDA graphs
    # veRL's key: fp8 quantizes the native engine's attention-output and MLP weights to e4m3 at every weight sync
    # (embeddings, norms, QKV, LM head and KV cache stay bf16; rlhf_mcore.rollout.native.fp8); pair it with
    # algorithm.rollout_correction
    # (configs/gsm8k_grpo_qwen2.5_0.5b_fp8.yaml). null: the model's dtype
    quantization: Optional[Literal["fp8"]] = None
    # vLLM's / SGLang's key: fp8_e4m3 caches the native engine's keys and values as e4m3 codes with one fp32 scale
    # per token and head (half the bytes a decode step's attention reads; rlhf_mcore.rollout.native.kv_cache), an
    # FP8 GPU only; auto: the rollout's dtype. Independent of quantization; pair it with algorithm.rollout_correction
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    # decode steps the native engine runs in one launch (one CUDA graph replay) before it reads finished rows back: a
    # row that finishes inside a launch holds still, so the samples are those of 1 (rlhf_mcore.rollout.native.engine;
    # BENCHMARKS.md, session 47). null: the engine's default
    decode_steps_per_launch: Optional[int] = checked(None, ok=unset_or(at_least(1)), what="unset or >= 1")
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    val_kwargs: SamplingKwargs = field(default_factory=SamplingKwargs)
    # Weight sync (actor -> rollout after every update)
    sync_bucket_mb: int = checked(512, **AT_LEAST_ONE)
    sync_verify: bool = False
    # a LoRA actor's sync into the colocated native engine: merged (every weight, `W + (alpha / r) B @ A` formed on
    # the training side; the faster one on the H200, BENCHMARKS.md) or adapter_only (after a first full sync the
    # adapters cross and the engine's side merges them into its host copy of the base: fewer bytes, but that copy
    # goes host -> device at every sync; rlhf_mcore.sync.lora)
    lora_sync: Literal["merged", "adapter_only"] = "merged"
    # veRL's key: the native engine records every token's top-k expert ids per MoE layer and returns them with the
    # samples (what router_replay.mode=R3 replays; with another mode the trainer only measures the routing mismatch).
    # null: on exactly when actor.router_replay.mode=R3
    enable_rollout_routing_replay: Optional[bool] = None
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    logprob_backend: str = "auto"  # as actor.logprob_backend
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
