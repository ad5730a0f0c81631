"""The run configuration: a dataclass schema, loaded from YAML plus ``key=value`` overrides through OmegaConf.

Key names follow veRL's where they fit, so a veRL command line translates one to one::

    data.train_batch_size=256 actor_rollout_ref.actor.ppo_mini_batch_size=64 algorithm.kl_ctrl.kl_coef=0.001

Every mistake a user can make in a config ends in a :class:`ConfigError` whose message names the key, the
value and the fix; ``launch/train.py`` prints it without a traceback and exits non-zero.

Sizes follow veRL's conventions: ``data.train_batch_size`` and ``ppo_mini_batch_size`` count *prompts*
(each brings ``rollout.n`` responses); ``*_micro_batch_size_per_gpu`` counts *sequences* per data-parallel rank.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional, get_args, get_origin, get_type_hints

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlhf_mcore.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration a run cannot start with; the message says what to change."""

    kind = "config error"


# --------------------------------------------------------------------------------------------- schema


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024  # prompts per step (each gets rollout.n responses)
    # prompts per generation batch of dynamic sampling (algorithm.filter_groups); None: train_batch_size
    gen_batch_size: Optional[int] = None
    val_batch_size: Optional[int] = None  # prompts per validation generate call; None: the whole set at once
    truncation: str = "error"  # error | left | right | filter (drop over-long prompts, counted)
    filter_overlong_prompts: bool = False  # veRL's switch; True is the same as truncation=filter
    on_bad_row: str = "error"  # error | skip (count and report malformed rows)
    shuffle: bool = True
    seed: int = 1
    max_train_samples: Optional[int] = None  # use only the first N training rows (demos, smoke runs)
    max_val_samples: Optional[int] = None


@dataclass
class ModelConfig:
    path: str = MISSING  # a Hugging Face model directory
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32
    enable_gradient_checkpointing: bool = False
    use_remove_padding: bool = True  # packed (THD) sequences in the train engine
    trust_remote_code: bool = False  # must stay false: models load through rlhf_mcore's own code, never the repo's


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr_ratio: float = 0.0
    lr_warmup_steps: int = -1  # < 0: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler: str = "constant"  # constant | cosine | linear (after warmup)
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    total_training_steps: int = -1  # filled in by the trainer


@dataclass
class OverrideTransformerConfig:
    """veRL's `megatron.override_transformer_config`: here only the uneven pipeline split (layers on the first /
    last PP stage; the stages between share the rest evenly). Unset and PP not dividing the layers: a split is
    chosen (rlhf_mcore.models.pipeline_layout)."""

    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None


@dataclass
class MegatronConfig:
    """The parallel layout of a Megatron model. The actor's layout is the process layout; ref and critic
    inherit it (a different one would need a second set of process groups, not supported yet)."""

    tensor_model_parallel_size: Optional[int] = None
    pipeline_model_parallel_size: Optional[int] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
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
    override_transformer_config: OverrideTransformerConfig = field(default_factory=OverrideTransformerConfig)


@dataclass
class ActorConfig:
    strategy: str = "megatron"
    ppo_mini_batch_size: int = 256  # prompts per optimizer step
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # sequences per forward/backward per DP rank
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    grad_clip: float = 1.0  # max global gradient norm
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0  # dual-clip lower bound for negative advantages
    policy_loss: str = "vanilla"  # vanilla (PPO clip) | gspo | ... (registry in rlhf_mcore.algos)
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None  # seq-mean-token-sum-norm's constant (e.g. max_response_length)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    # the rollout's log-probs are the old policy: no old-log-prob forward pass (veRL's bypass mode)
    use_rollout_log_probs: bool = False
    logprob_backend: str = "auto"  # log-prob/entropy kernel: auto (triton on CUDA if installed) | torch | triton
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class SamplingKwargs:
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    n: int = 1
    do_sample: bool = False


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools and environments (rlhf_mcore.agents); veRL's names where they exist."""

    enable: bool = False
    max_assistant_turns: int = 5  # model turns per trajectory
    max_user_turns: int = 5  # environment / user turns per trajectory
    tool_config_path: Optional[str] = None  # YAML: the run's tools (rlhf_mcore.agents.tools)
    format: str = "hermes"  # how tool calls are written: <tool_call>{"name", "arguments"}</tool_call>
    max_tokens_per_turn: Optional[int] = None  # per model turn; None: what is left of data.max_response_length
    tool_timeout_s: float = 30.0  # per call (a tool may set its own)
    max_parallel_calls: int = 4  # calls run per model turn; more get an error message
    tool_workers: int = 16  # threads running tool calls
    default_agent: str = "single_turn_agent"  # agent loop of rows without an agent_name


@dataclass
class RolloutConfig:
    name: str = "native"  # native | hf | sglang
    mode: str = "sync"  # sync (the only mode; veRL's server-based "async" rollout is not implemented)
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    n: int = 1
    prompt_length: Optional[int] = None  # veRL's copy of data.max_prompt_length: unset, or equal to it
    response_length: Optional[int] = None  # veRL's copy of data.max_response_length: unset, or equal to it
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.5
    tensor_model_parallel_size: int = 1
    max_num_seqs: int = 256
    free_cache_engine: bool = True
    # what the rollout releases after generating (with free_cache_engine): 1 = its KV cache, weights kept (synced
    # after each update); 2 = its weights too, re-sent at the next wake after the training engines' offload (the
    # order a 7B model needs to fit one H200, BENCHMARKS.md)
    sleep_level: int = 1
    enforce_eager: bool = False  # no CUDA graphs
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    val_kwargs: SamplingKwargs = field(default_factory=SamplingKwargs)
    # Weight sync (actor -> rollout after every update)
    sync_bucket_mb: int = 512
    sync_verify: bool = False
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


@dataclass
class CriticModelConfig:
    path: Optional[str] = None  # None: the actor's model
    dtype: str = "auto"
    enable_gradient_checkpointing: bool = False
    use_remove_padding: bool = True


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # None: on exactly when algorithm.adv_estimator needs values (gae)
    strategy: str = "megatron"
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: Optional[int] = None  # None: the actor's
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    # the value pass (forward-only, no activations kept) may take larger micro-batches than the update
    forward_micro_batch_size_per_gpu: Optional[int] = None  # None: ppo_micro_batch_size_per_gpu
    forward_max_token_len_per_gpu: Optional[int] = None  # None: ppo_max_token_len_per_gpu (use_dynamic_bsz)
    ppo_epochs: Optional[int] = None  # None: the actor's
    grad_clip: float = 1.0
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None  # a .py file
    name: str = "compute_score"


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (rlhf_mcore.rewards.overlong): a response longer than
    data.max_response_length - len gets min(-(length - (max_response_length - len)) / len * penalty_factor, 0)
    added to its score."""

    enable: bool = False
    len: int = 0  # tokens of the buffer; enable needs 1..data.max_response_length
    penalty_factor: float = 0.0  # the penalty of a response at data.max_response_length
    log: bool = False  # log reward/overlong_penalty and reward/overlong_fraction


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None  # a Hugging Face *ForSequenceClassification directory with num_labels=1
    # the policy's tokenizer, when the reward model's tokenizer or chat template differs from it: each conversation
    # is then decoded and re-templated with the reward model's chat template; None: the policy's token ids as they
    # are (the two tokenizers must then be the same)
    input_tokenizer: Optional[str] = None
    dtype: str = "auto"
    use_remove_padding: bool = True
    trust_remote_code: bool = False  # must stay false, as for the actor's model
    # PRIME (reward_manager=prime): the implicit PRM's beta, when it is updated relative to scoring (before: update,
    # then score with the updated PRM, veRL's default; after: score, then update) and its optimizer
    beta_train: float = 0.05
    update: str = "before"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, weight_decay=0.0))


@dataclass
class RewardModelConfig:
    """veRL's `reward_model` section (also accepted at the top level, as veRL writes it).

    With `enable`, a discriminative reward model (rlhf_mcore.rewards.reward_model) scores every response whose
    data_source is in `data_sources` (all of them when empty) at its last token, and that row's reward is
    `reward_weight * rm_score + rule_weight * rule_score` (the rule score: the data_source's reward function or
    reward.custom_reward_function, computed for every row as without a reward model). Other rows keep their rule
    score. The defaults (1, 0) are veRL's: the reward model's score replaces the rule's.
    """

    enable: bool = False
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: Optional[int] = None  # sequences per forward pass; None: 1
    max_length: Optional[int] = None  # tokens given to the reward model; longer inputs are cut at the end, counted
    reward_weight: float = 1.0
    rule_weight: float = 0.0
    data_sources: list[str] = field(default_factory=list)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # param_offload: on the host between scorings
    # veRL's names for scoring each sample by its data_source's function: naive, or dapo (the same here: its
    # overlong shaping is overlong_buffer below, applied under either name); prime: PRIME's implicit process reward
    # model (rlhf_mcore.trainer.prime; model.path: a causal LM, unset = the actor's model)
    reward_manager: str = "naive"
    prime_granularity: str = "token"  # token | whole (PRIME: where the process rewards sit)
    prime_norm: str = "batch_norm"  # batch_norm | none (PRIME: scale by the batch's largest |return-to-go|)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class JudgeConfig:
    """A generative reward model (LLM-as-judge, rlhf_mcore.rewards.judge): a second native engine writes a verdict
    on each response; `parser` reads the score from it (unreadable: 0, counted). Combined with the rule score as
    reward_model's is (data_sources, reward_weight, rule_weight)."""

    enable: bool = False
    model_path: Optional[str] = None  # the judge's Hugging Face causal LM directory
    # fields: {prompt} (the last user message), {response}, {ground_truth}; literal braces as {{ }}
    prompt_template: str = ("Question:\n{prompt}\n\nProposed answer:\n{response}\n\nReference answer: "
                            "{ground_truth}\n\nIs the proposed answer correct? Reply with <score>1</score> if it "
                            "is, <score>0</score> if not.")
    parser: str = "score_tag"  # score_tag | rating | yes_no | a registered parser (rlhf_mcore.rewards.judge)
    max_new_tokens: int = 64
    temperature: float = 0.0
    max_num_seqs: int = 64
    max_model_len: int = 4096
    reward_weight: float = 1.0
    rule_weight: float = 0.0
    data_sources: list[str] = field(default_factory=list)


@dataclass
class RewardConfig:
    num_workers: int = 0  # 0: score in the trainer process
    timeout_s: float = 10.0  # per item, also with num_workers=0; an item that hangs scores 0 and counts as a timeout
    # Fail the run (RewardFunctionError, with the function's first error) when more than this fraction of a
    # step's items raised, returned no valid number or timed out. 0.5: a working function fails on a few odd
    # outputs at most; when most items fail the function is broken and the step would train on zeros. 0.0
    # tolerates no failure; 1.0 turns the check off.
    max_failure_ratio: float = 0.5
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction with ratio pi_old / pi_rollout (rlhf_mcore.algos.rollout_correction)."""
    rollout_is: Optional[str] = None  # None (off) | token | sequence: IS weights on the policy loss
    rollout_is_threshold: float = 2.0  # TIS: IS weights capped at this
    rollout_is_batch_normalize: bool = False  # IS weights divided by their batch mean
    rollout_rs: Optional[str] = None  # None (off) | token | sequence | geometric: rejection from the loss
    rollout_rs_threshold: Optional[float] = None  # largest ratio kept (required with rollout_rs)
    rollout_rs_threshold_lower: Optional[float] = None  # smallest ratio kept; None: 1 / rollout_rs_threshold
    rollout_token_veto_threshold: Optional[float] = None  # a token ratio below this rejects its sequence


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (rlhf_mcore.algos.dynamic_sampling): drop groups whose responses all have the
    same `metric`, generating further data.gen_batch_size prompt batches until data.train_batch_size groups
    remain."""

    enable: bool = False
    metric: Optional[str] = None  # acc | score (the reward function's score) | seq_reward (after shaping) | ...
    max_num_gen_batches: int = 0  # generation batches per step before the run stops; <= 0: no limit


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"  # gae | grpo | rloo | remax | reinforce_plus_plus | reinforce_plus_plus_baseline
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True  # False is Dr.GRPO
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # kl (k1) | abs | mse (k2) | low_var_kl (k3)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    # PRIME (reward_model.reward_manager=prime): weights of the RLOO advantages of the implicit process rewards and
    # of the outcome (rule) reward
    reward_dpo_coef: float = 5.0
    reward_gt_coef: float = 5.0


@dataclass
class TrainerConfig:
    project_name: str = "rlhf_mcore"
    experiment_name: str = "run"
    logger: list[str] = field(default_factory=lambda: ["console"])  # console | jsonl | tensorboard | wandb
    # veRL's layout keys: when set, nnodes x n_gpus_per_node must equal the processes torchrun launched
    nnodes: Optional[int] = None
    n_gpus_per_node: Optional[int] = None
    device: str = "auto"  # auto | cuda | cpu
    total_epochs: int = 1
    total_training_steps: Optional[int] = None
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    log_val_generations: int = 3
    default_local_dir: Optional[str] = None  # None: outputs/<project_name>/<experiment_name>
    # auto: the newest checkpoint under default_local_dir that passes its manifest check (each newer broken one is
    # reported and skipped) | disable: start from step 0 | <checkpoint path>: that one, which must pass the check
    resume_mode: str = "auto"
    # resuming a checkpoint saved with different algorithm settings (rlhf_mcore.trainer.checkpoint.ALGORITHM_KEYS:
    # algorithm.*, the actor's loss/KL keys, model paths, rollout.n, data.train_batch_size, ...) is refused with
    # the differing keys listed; true resumes anyway
    resume_ignore_config_changes: bool = False
    max_actor_ckpt_to_keep: Optional[int] = 2
    export_hf_final: bool = True  # the final actor as a Hugging Face directory in <default_local_dir>/hf_final
    # The rollout's log-probs against the actor's recomputed ones on the same weights (`rollout/k3_kl`, the mean
    # k3 KL): numerics only (2e-6 measured in bf16 on an H200 with a tiny model). A step above the limit means the
    # engines disagree about the policy (a broken weight sync, a kernel bug): it stops the run (error) or logs a
    # warning (warn). Not applied under top-k/top-p sampling, whose rollout log-probs are renormalised over the
    # kept tokens by design. None: no limit.
    max_rollout_logprob_gap: Optional[float] = 0.02
    rollout_logprob_gap_action: str = "error"  # error | warn
    seed: int = 1
    deterministic: bool = False  # torch.use_deterministic_algorithms (warn where an op has no deterministic kernel)
    # Python files (.py) or importable modules loaded on every rank before anything is built: the place to
    # register rewards, advantage estimators or policy losses (rlhf_mcore.rewards/.algos registries).
    plugins: list[str] = field(default_factory=list)


@dataclass
class RolloutPoolConfig:
    """veRL's `rollout.nnodes` x `rollout.n_gpus_per_node`: the processes of the rollout pool under
    async_training (the training pool is trainer.nnodes x trainer.n_gpus_per_node; torchrun launches both)."""

    nnodes: Optional[int] = None
    n_gpus_per_node: Optional[int] = None


@dataclass
class AsyncTrainingConfig:
    # off: the colocated synchronous trainer | one_step_off: the rollout pool generates step k+1 while the
    # training pool trains step k | fully_async: the rollout pool streams samples continuously
    mode: str = "off"
    # fully_async: a training step takes require_batches mini-batches (actor.ppo_mini_batch_size prompts each)
    require_batches: int = 1
    # fully_async: the rollout pool receives the actor's weights after every this many training steps
    trigger_parameter_sync_step: int = 1
    # fully_async: the most policy versions a sample may lag the trainer (by its oldest token) to be trained on;
    # older ones are dropped and counted (veRL's key; there a fraction of extra samples, here a version count)
    staleness_threshold: int = 1
    # fully_async: at a weight sync, in-flight samples pause and continue under the new weights (true), or the
    # rollout finishes them under the old weights before it takes the new ones (false)
    partial_rollout: bool = True


@dataclass
class RLConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)


# --------------------------------------------------------------------------------------------- loading

_CHOICES = {  # fixed by the code; names that users extend (estimators, losses, KL) are checked in validate_config
    "data.truncation": ("error", "left", "right", "filter"),
    "data.on_bad_row": ("error", "skip"),
    "actor_rollout_ref.model.dtype": ("auto", "bfloat16", "float16", "float32"),
    "actor_rollout_ref.rollout.dtype": ("auto", "bfloat16", "float16", "float32"),
    "critic.model.dtype": ("auto", "bfloat16", "float16", "float32"),
    "reward.reward_model.model.dtype": ("auto", "bfloat16", "float16", "float32"),
    "actor_rollout_ref.actor.strategy": ("megatron",),
    "critic.strategy": ("megatron",),
    "actor_rollout_ref.rollout.name": ("native", "hf", "sglang"),
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "trainer.device": ("auto", "cuda", "cpu"),
    "actor_rollout_ref.rollout.mode": ("sync",),
    "actor_rollout_ref.rollout.multi_turn.format": ("hermes",),
    "async_training.mode": ("off", "one_step_off", "fully_async"),
    "trainer.rollout_logprob_gap_action": ("error", "warn"),
    "reward.reward_model.reward_manager": ("naive", "dapo", "prime"),
    "reward.reward_model.prime_granularity": ("token", "whole"),
    "reward.reward_model.prime_norm": ("batch_norm", "none"),
    "reward.reward_model.model.update": ("before", "after"),
    "actor_rollout_ref.actor.optim.lr_scheduler": ("constant", "cosine", "linear"),
    "critic.optim.lr_scheduler": ("constant", "cosine", "linear"),
}
# What a rejected value of a choice key is for here, when it names a feature that lives under another key.
_CHOICE_HINTS = {
    "actor_rollout_ref.rollout.mode":
        "veRL's async server rollout is not a rollout mode here; the asynchronous trainers are "
        "async_training.mode=one_step_off or fully_async (off: synchronous), so set that instead",
}
_LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
# algorithm.filter_groups.metric: acc / score, the reward function's score; seq_reward, the score after the overlong
# penalty; seq_final_reward, the reward after KL-in-reward (the same as seq_reward when use_kl_in_reward is off)
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


# veRL keys that have no meaning here, with the reason (an unknown key would only say "did you mean ...").
_NOT_APPLICABLE = {
    "actor_rollout_ref.rollout.load_format":
        "the rollout engine always starts from the actor's weights, sent to it before the first step, so there is "
        "nothing for it to load; remove the key",
    "algorithm.rollout_correction.bypass_mode":
        "set actor_rollout_ref.actor.use_rollout_log_probs=true to use the rollout's log-probs as the old policy",
    "algorithm.rollout_correction.loss_type":
        "the policy loss is actor_rollout_ref.actor.policy_loss (PPO clip with the rollout as the old policy under "
        "actor_rollout_ref.actor.use_rollout_log_probs=true)",
}
# veRL's top-level sections that live under `reward` here: accepted under either name.
_ALIASES = {"reward_model": "reward.reward_model", "custom_reward_function": "reward.custom_reward_function"}


def _unalias(dotted: str) -> str:
    head, _, rest = dotted.partition(".")
    return f"{_ALIASES[head]}.{rest}" if head in _ALIASES and rest else _ALIASES.get(dotted, dotted)


def _unalias_tree(raw: dict) -> dict:
    """Move veRL's top-level `reward_model` / `custom_reward_function` sections under `reward`."""
    out = {k: v for k, v in raw.items() if k not in _ALIASES}
    for old, new in _ALIASES.items():
        if old in raw:
            section = out.setdefault("reward", {}) if isinstance(out.get("reward", {}), dict) else None
            if section is None:
                raise ConfigError("config key 'reward' must be a section when '{old}' is given too.")
            leaf = new.split(".")[1]
            if leaf in section:
                raise ConfigError(f"config sets both '{old}' and '{new}' (the same section): keep one.")
            section[leaf] = raw[old]
    return out


def _schema_node(path: list[str]):
    """The dataclass type (or leaf type) at a dotted path of the schema, or raise ConfigError with suggestions."""
    node: Any = RLConfig
    walked: list[str] = []
    for key in path:
        if not (isinstance(node, type) and is_dataclass(node)):
            raise ConfigError(
                f"'{'.'.join(walked)}' is a value, not a section, so '{'.'.join(path)}' does not exist.")
        hints = get_type_hints(node)
        if key not in hints:
            dotted = ".".join(path[:len(walked) + 1])
            if dotted in _NOT_APPLICABLE:
                raise ConfigError(f"config key '{dotted}' does not apply to rlhf_mcore: {_NOT_APPLICABLE[dotted]}.")
            section = ".".join(walked) or "<top level>"
            close = difflib.get_close_matches(key, list(hints), n=3, cutoff=0.5)
            full = difflib.get_close_matches(".".join(path), _all_keys(), n=3, cutoff=0.75)
            hint = [".".join(walked + [c]) for c in close] or full
            msg = f"unknown config key '{'.'.join(path)}': section '{section}' has no key '{key}'."
            if hint:
                msg += " Did you mean " + " or ".join(f"'{h}'" for h in hint) + "?"
            else:
                msg += f" Valid keys in '{section}': {', '.join(sorted(hints))}."
            raise ConfigError(msg)
        walked.append(key)
        node = hints[key]
        if get_origin(node) is Optional or (get_origin(node) is not None and type(None) in get_args(node)):
            node = next(a for a in get_args(node) if a is not type(None))
    return node


def _all_keys(node=RLConfig, prefix: str = "") -> list[str]:
    keys = []
    for f in fields(node):
        hint = get_type_hints(node)[f.name]
        if isinstance(hint, type) and is_dataclass(hint):
            keys += _all_keys(hint, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _check_keys(tree: Any, path: list[str]) -> None:
    """Walk a user-supplied mapping and fail on the first key the schema does not have."""
    node = _schema_node(path) if path else RLConfig
    if isinstance(tree, dict) and isinstance(node, type) and is_dataclass(node):
        for key, value in tree.items():
            _check_keys(value, path + [str(key)])


def _is_list_type(t) -> bool:
    return get_origin(t) is list


def _coerce_overrides(overrides: list[str]) -> list[str]:
    """Validate override keys and let a scalar stand for a one-element list (veRL's `trainer.logger=console`)."""
    out = []
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override '{ov}' is not of the form key=value (e.g. data.train_batch_size=256).")
        key, value = ov.split("=", 1)
        key = _unalias(key.lstrip("+"))
        node = _schema_node(key.split("."))
        if isinstance(node, type) and is_dataclass(node):
            raise ConfigError(f"'{key}' is a section, not a value: set one of its keys, e.g. '{key}.<key>=...'.")
        if _is_list_type(node) and not value.strip().startswith("["):
            value = f"[{value}]" if value.strip() else "[]"
        out.append(f"{key}={value}")
    return out


def _wrap_scalar_lists(tree: Any, path: list[str]) -> Any:
    if not isinstance(tree, dict):
        return tree
    result = {}
    for key, value in tree.items():
        node = _schema_node(path + [str(key)])
        if _is_list_type(node) and value is not None and not isinstance(value, (list, tuple)):
            value = [value]
        result[key] = _wrap_scalar_lists(value, path + [str(key)]) if isinstance(value, dict) else value
    return result


def _omegaconf_message(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
    try:
        expected = _schema_node(str(key).split("."))
        expected_name = getattr(expected, "__name__", str(expected))
    except ConfigError:
        expected_name = "?"
    value = getattr(err, "value", None)
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    if "Value" in first or "cannot be converted" in first or "Invalid" in first or "type" in first.lower():
        return f"config key '{key}' has value {value!r}, which is not a valid {expected_name}. ({first})"
    return f"config key '{key}': {first}"


def load_config(config_path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RLConfig:
    """Schema defaults <- YAML file <- ``key=value`` overrides, type-checked; returns the dataclass tree.

    Cross-field checks that need the world size or the model live in :func:`validate_config`.
    """
    base = OmegaConf.structured(RLConfig)
    layers, raw, coerced = [], None, []
    if config_path is not None:
        p = Path(config_path)
        if not p.is_file():
            raise ConfigError(f"config file '{config_path}' does not exist (pass --config configs/<run>.yaml).")
        try:
            raw = OmegaConf.to_container(OmegaConf.load(p), resolve=False) or {}
        except Exception as e:  # YAML syntax errors
            raise ConfigError(f"cannot parse config file '{config_path}': {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file '{config_path}' must hold a mapping of sections, got {type(raw).__name__}.")
        raw = _unalias_tree(raw)
        _check_keys(raw, [])
        layers.append(OmegaConf.create(_wrap_scalar_lists(raw, [])))
    if overrides:
        coerced = _coerce_overrides(list(overrides))
        layers.append(OmegaConf.from_dotlist(coerced))
    try:
        merged = OmegaConf.merge(base, *layers)
        OmegaConf.resolve(merged)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(
                f"config key '{missing[0]}' must be set (e.g. {missing[0]}=/path/to/hf_model on the command line).")
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e)) from None
    _check_choices(cfg)
    _check_values(cfg)
    from rlhf_mcore.config_unused import given_keys, report_unused_keys

    report_unused_keys(cfg, given_keys(raw, coerced))  # set, but nothing reads them here: one notice line
    return cfg


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _check_choices(cfg: RLConfig) -> None:
    for key, choices in _CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            close = difflib.get_close_matches(str(value), choices, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            if key in _CHOICE_HINTS:
                hint = f" {_CHOICE_HINTS[key]}."
            raise ConfigError(f"config key '{key}' has value {value!r}; choose one of {', '.join(choices)}.{hint}")
    for name in cfg.trainer.logger:
        if name not in _LOGGERS:
            raise ConfigError(f"config key 'trainer.logger' has {name!r}; loggers are {', '.join(_LOGGERS)}.")


def _check_values(cfg: RLConfig) -> None:
    """Single-key ranges, before anything is built: the key, the value, the allowed range."""
    import math

    def need(key: str, ok: bool, what: str) -> None:
        if not ok:
            raise ConfigError(f"config key '{key}' has value {_get(cfg, key)!r}; it must be {what}.")

    for role in ("actor_rollout_ref.actor", "critic"):
        o = f"{role}.optim"
        need(f"{o}.lr", math.isfinite(_get(cfg, f"{o}.lr")) and _get(cfg, f"{o}.lr") >= 0, ">= 0 (e.g. 1e-6)")
        need(f"{o}.min_lr_ratio", 0 <= _get(cfg, f"{o}.min_lr_ratio") <= 1, "in [0, 1]")
        need(f"{o}.lr_warmup_steps_ratio", 0 <= _get(cfg, f"{o}.lr_warmup_steps_ratio") <= 1, "in [0, 1]")
        need(f"{o}.weight_decay", _get(cfg, f"{o}.weight_decay") >= 0, ">= 0")
        betas = _get(cfg, f"{o}.betas")
        need(f"{o}.betas", len(betas) == 2 and all(0 <= b < 1 for b in betas), "two numbers in [0, 1)")
        need(f"{o}.eps", _get(cfg, f"{o}.eps") > 0, "> 0")
        need(f"{role}.grad_clip", _get(cfg, f"{role}.grad_clip") > 0, "> 0 (the max global gradient norm)")
    a = "actor_rollout_ref.actor"
    need(f"{a}.clip_ratio", 0 < cfg.actor_rollout_ref.actor.clip_ratio < 1, "in (0, 1), e.g. 0.2")
    for k in ("clip_ratio_low", "clip_ratio_high"):
        v = _get(cfg, f"{a}.{k}")
        need(f"{a}.{k}", v is None or 0 < v < 10, "unset or > 0 (e.g. 0.2; clip-higher uses 0.28)")
    need(f"{a}.clip_ratio_c", cfg.actor_rollout_ref.actor.clip_ratio_c > 1, "> 1 (dual-clip bound, e.g. 3)")
    need(f"{a}.kl_loss_coef", cfg.actor_rollout_ref.actor.kl_loss_coef >= 0, ">= 0")
    need(f"{a}.ppo_epochs", cfg.actor_rollout_ref.actor.ppo_epochs >= 1, ">= 1")
    need("critic.cliprange_value", cfg.critic.cliprange_value > 0, "> 0")
    r = "actor_rollout_ref.rollout"
    for k in ("temperature", "val_kwargs.temperature"):
        need(f"{r}.{k}", _get(cfg, f"{r}.{k}") >= 0, ">= 0 (0 is greedy)")
    for k in ("top_p", "val_kwargs.top_p"):
        need(f"{r}.{k}", 0 < _get(cfg, f"{r}.{k}") <= 1, "in (0, 1]")
    for k in ("top_k", "val_kwargs.top_k"):
        need(f"{r}.{k}", _get(cfg, f"{r}.{k}") == -1 or _get(cfg, f"{r}.{k}") > 0, "-1 (off) or > 0")
    for k in ("n", "val_kwargs.n", "max_num_seqs", "tensor_model_parallel_size", "sync_bucket_mb"):
        need(f"{r}.{k}", _get(cfg, f"{r}.{k}") >= 1, ">= 1")
    need(f"{r}.gpu_memory_utilization", 0 < cfg.actor_rollout_ref.rollout.gpu_memory_utilization <= 1, "in (0, 1]")
    need("algorithm.gamma", 0 <= cfg.algorithm.gamma <= 1, "in [0, 1]")
    need("algorithm.lam", 0 <= cfg.algorithm.lam <= 1, "in [0, 1]")
    need("algorithm.kl_ctrl.kl_coef", cfg.algorithm.kl_ctrl.kl_coef >= 0, ">= 0")
    _check_rollout_correction(cfg, need)
    need("reward.num_workers", cfg.reward.num_workers >= 0, ">= 0 (0 scores in the trainer process)")
    need("reward.timeout_s", cfg.reward.timeout_s > 0, "> 0 seconds")
    need("reward.max_failure_ratio", 0 <= cfg.reward.max_failure_ratio <= 1,
         "in [0, 1] (the fraction of a step's items whose reward may fail; 1.0 turns the check off)")
    need("trainer.total_epochs", cfg.trainer.total_epochs >= 1, ">= 1")
    for k in ("total_training_steps", "max_actor_ckpt_to_keep", "nnodes", "n_gpus_per_node"):
        v = _get(cfg, f"trainer.{k}")
        need(f"trainer.{k}", v is None or v >= 1, "unset or >= 1")
    for k in ("nnodes", "n_gpus_per_node"):
        v = _get(cfg, f"rollout.{k}")
        need(f"rollout.{k}", v is None or v >= 1, "unset or >= 1")
    need("trainer.max_rollout_logprob_gap", cfg.trainer.max_rollout_logprob_gap is None
         or cfg.trainer.max_rollout_logprob_gap > 0, "unset (no limit) or > 0")
    need("data.val_batch_size", cfg.data.val_batch_size is None or cfg.data.val_batch_size >= 1, "unset or >= 1")
    need("actor_rollout_ref.model.trust_remote_code", not cfg.actor_rollout_ref.model.trust_remote_code,
         "false: rlhf_mcore builds Qwen2/Qwen2.5/Qwen3/Llama models with its own code and never runs a model "
         "repository's Python")
    _check_reward_model(cfg, need)
    for k, data_key in (("prompt_length", "max_prompt_length"), ("response_length", "max_response_length")):
        v = _get(cfg, f"{r}.{k}")
        need(f"{r}.{k}", v is None or v == _get(cfg, f"data.{data_key}"),
             f"unset or equal to data.{data_key} ({_get(cfg, f'data.{data_key}')}), which sets it")
    _check_dapo(cfg, need)
    _check_multi_turn(cfg, need)


def _check_multi_turn(cfg: RLConfig, need) -> None:
    mt, m = cfg.actor_rollout_ref.rollout.multi_turn, "actor_rollout_ref.rollout.multi_turn"
    need(f"{m}.max_assistant_turns", 1 <= mt.max_assistant_turns <= 255, "in [1, 255]")
    need(f"{m}.max_user_turns", mt.max_user_turns >= 0, ">= 0")
    need(f"{m}.max_tokens_per_turn", mt.max_tokens_per_turn is None or mt.max_tokens_per_turn >= 1,
         "unset (what is left of data.max_response_length) or >= 1")
    need(f"{m}.tool_timeout_s", mt.tool_timeout_s > 0, "> 0 seconds")
    for k in ("max_parallel_calls", "tool_workers"):
        need(f"{m}.{k}", getattr(mt, k) >= 1, ">= 1")
    if not mt.enable:
        return
    need(f"{m}.tool_config_path", mt.tool_config_path is None or Path(mt.tool_config_path).is_file(),
         "an existing YAML file listing the tools (e.g. configs/tools/calculator.yaml), or unset for no tools")
    need("algorithm.adv_estimator", cfg.algorithm.adv_estimator != "remax",
         f"not remax with {m}.enable=true: the greedy baseline is generated single-turn")
    need("actor_rollout_ref.rollout.tensor_model_parallel_size",
         cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 1,
         f"1 with {m}.enable=true: the ranks of a tensor-parallel rollout would have to see tool results at the "
         f"same engine step")


def _check_reward_model(cfg: RLConfig, need) -> None:
    """`reward_model.*` when enabled: a model path, sizes, weights (the model directory itself: build time)."""
    import math

    _check_judge(cfg, need)
    rm, k = cfg.reward.reward_model, "reward.reward_model"
    if rm.reward_manager == "prime":
        _check_prime(cfg, need)
        return
    if not rm.enable:
        return
    need(f"{k}.enable", not cfg.reward.judge.enable, "false while reward.judge.enable=true: score with one learned "
         "model at a time (a reward model or a judge)")
    need(f"{k}.model.path", bool(rm.model.path),
         "set with reward_model.enable=true: a Hugging Face *ForSequenceClassification directory (num_labels=1), "
         "e.g. one written by launch/train_rm.py")
    need(f"{k}.model.trust_remote_code", not rm.model.trust_remote_code,
         "false: reward models load through rlhf_mcore's own Qwen2/Qwen3/Llama code")
    need(f"{k}.micro_batch_size_per_gpu", rm.micro_batch_size_per_gpu is None or rm.micro_batch_size_per_gpu >= 1,
         "unset or >= 1")
    need(f"{k}.max_length", rm.max_length is None or rm.max_length >= 2, "unset or >= 2 (tokens)")
    for w in ("reward_weight", "rule_weight"):
        need(f"{k}.{w}", math.isfinite(getattr(rm, w)), "a finite number")
    need(f"{k}.reward_weight", rm.reward_weight != 0, "non-zero with reward_model.enable=true (0 ignores the model: "
         "turn reward_model.enable off instead)")
    need("algorithm.adv_estimator", cfg.algorithm.adv_estimator != "remax",
         "not remax with reward_model.enable=true: ReMax's greedy baselines are scored by rule functions only")
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        got, want = getattr(rm.megatron, name), getattr(cfg.actor_rollout_ref.actor.megatron, name) or 1
        need(f"{k}.megatron.{name}", got is None or got == want,
             f"unset or the actor's ({want}): every training-side model shares the actor's process layout")


def _check_prime(cfg: RLConfig, need) -> None:
    """PRIME: the implicit PRM is the actor's model (its reference is the reference policy), RLOO advantages."""
    import math

    rm, k, a = cfg.reward.reward_model, "reward.reward_model", cfg.algorithm
    need(f"{k}.enable", rm.enable, "true with reward_manager=prime (the implicit PRM is a reward model)")
    need(f"{k}.model.path", rm.model.path in (None, cfg.actor_rollout_ref.model.path),
         f"unset or the actor's model ({cfg.actor_rollout_ref.model.path}) with reward_manager=prime: the implicit "
         f"PRM starts from the policy's weights and is measured against the reference policy")
    need("algorithm.adv_estimator", a.adv_estimator == "rloo",
         "rloo with reward_manager=prime (PRIME's advantages are RLOO on the process and the outcome rewards)")
    need("algorithm.use_kl_in_reward", not a.use_kl_in_reward, "false with reward_manager=prime")
    need("critic.enable", not cfg.critic.enable, "false or unset with reward_manager=prime")
    need(f"{k}.model.beta_train", math.isfinite(rm.model.beta_train) and rm.model.beta_train > 0, "> 0 (e.g. 0.05)")
    need("algorithm.reward_dpo_coef", math.isfinite(a.reward_dpo_coef), "a finite number")
    need("algorithm.reward_gt_coef", math.isfinite(a.reward_gt_coef), "a finite number")
    need("algorithm.reward_dpo_coef", a.reward_dpo_coef != 0 or a.reward_gt_coef != 0,
         "non-zero, or algorithm.reward_gt_coef non-zero: with both 0 every advantage is 0")
    need(f"{k}.model.optim.lr", math.isfinite(rm.model.optim.lr) and rm.model.optim.lr >= 0, ">= 0 (e.g. 1e-6)")


def _check_judge(cfg: RLConfig, need) -> None:
    """`reward.judge.*` when enabled: model path, template fields, sizes (parser names: at build time, after
    trainer.plugins)."""
    import math

    from rlhf_mcore.rewards.judge import check_template

    j, k = cfg.reward.judge, "reward.judge"
    if not j.enable:
        return
    need(f"{k}.model_path", bool(j.model_path), "set with reward.judge.enable=true: the judge's causal LM directory")
    try:
        check_template(j.prompt_template)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for key in ("max_new_tokens", "max_num_seqs", "max_model_len"):
        need(f"{k}.{key}", getattr(j, key) >= 1, ">= 1")
    need(f"{k}.temperature", j.temperature >= 0, ">= 0 (0 is greedy)")
    for w in ("reward_weight", "rule_weight"):
        need(f"{k}.{w}", math.isfinite(getattr(j, w)), "a finite number")
    need("algorithm.adv_estimator", cfg.algorithm.adv_estimator != "remax",
         "not remax with reward.judge.enable=true: ReMax's greedy baselines are scored by rule functions only")


def _check_dapo(cfg: RLConfig, need) -> None:
    """Overlong reward shaping and dynamic sampling (filter groups) against the batch and response sizes."""
    import math

    ob, o = cfg.reward.reward_model.overlong_buffer, "reward.reward_model.overlong_buffer"
    need(f"{o}.len", ob.len >= 0, ">= 0 (tokens)")
    need(f"{o}.penalty_factor", math.isfinite(ob.penalty_factor) and ob.penalty_factor >= 0, ">= 0 (e.g. 1.0)")
    if ob.enable:
        need(f"{o}.len", 1 <= ob.len <= cfg.data.max_response_length,
             f"in [1, data.max_response_length={cfg.data.max_response_length}] with {o}.enable=true (DAPO uses a "
             f"quarter of the response length, e.g. 4096 of 20480)")
    fg, f, d = cfg.algorithm.filter_groups, "algorithm.filter_groups", cfg.data
    need(f"{f}.metric", fg.metric is None or fg.metric in FILTER_METRICS,
         f"one of {', '.join(FILTER_METRICS)} (acc and score: the reward function's score; seq_reward: after the "
         f"overlong penalty)")
    need("data.gen_batch_size", d.gen_batch_size is None or d.gen_batch_size >= 1, "unset or >= 1")
    if not fg.enable:
        need("data.gen_batch_size", d.gen_batch_size in (None, d.train_batch_size),
             f"unset or data.train_batch_size ({d.train_batch_size}) unless {f}.enable=true: it sizes dynamic "
             f"sampling's generation batches")
        return
    need(f"{f}.metric", fg.metric is not None, f"set with {f}.enable=true: one of {', '.join(FILTER_METRICS)}")
    need(f"{f}.metric", fg.metric != "seq_final_reward" or not cfg.algorithm.use_kl_in_reward,
         "acc, score or seq_reward with algorithm.use_kl_in_reward=true: the KL penalty is computed after "
         "the groups are filtered here")
    need("actor_rollout_ref.rollout.n", cfg.actor_rollout_ref.rollout.n >= 2,
         f">= 2 with {f}.enable=true: a group of one response has nothing to compare with, so none would be "
         f"filtered")
    need("data.gen_batch_size", d.gen_batch_size is None or d.gen_batch_size >= d.train_batch_size,
         f">= data.train_batch_size ({d.train_batch_size}) or unset: filtering only removes groups, so a smaller "
         f"generation batch can never fill a step (DAPO draws 3x train_batch_size)")


def _check_rollout_correction(cfg: RLConfig, need) -> None:
    rc, p = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    need(f"{p}.rollout_is", rc.rollout_is in (None, "token", "sequence"), "null (off), token or sequence")
    need(f"{p}.rollout_is_threshold", rc.rollout_is_threshold > 0, "> 0 (the TIS cap on IS weights, e.g. 2.0)")
    need(f"{p}.rollout_is_batch_normalize", not rc.rollout_is_batch_normalize or rc.rollout_is is not None,
         f"false while {p}.rollout_is is null (there are no IS weights to normalise)")
    need(f"{p}.rollout_rs", rc.rollout_rs in (None, "token", "sequence", "geometric"),
         "null (off), token, sequence or geometric")
    for k in ("rollout_rs_threshold", "rollout_rs_threshold_lower"):
        v = getattr(rc, k)
        need(f"{p}.{k}", v is None or (rc.rollout_rs is not None and v > 0),
             f"> 0, and set only with {p}.rollout_rs (token, sequence or geometric)")
    need(f"{p}.rollout_rs_threshold", rc.rollout_rs is None or rc.rollout_rs_threshold is not None,
         f"set when {p}.rollout_rs is on: the largest ratio pi_old/pi_rollout kept, e.g. 2.0")
    lower = rc.rollout_rs_threshold_lower
    need(f"{p}.rollout_rs_threshold_lower", lower is None or lower < rc.rollout_rs_threshold,
         f"below {p}.rollout_rs_threshold ({rc.rollout_rs_threshold}); unset means its reciprocal")
    need(f"{p}.rollout_rs_threshold", rc.rollout_rs_threshold is None or lower is not None
         or rc.rollout_rs_threshold >= 1, f">= 1 while {p}.rollout_rs_threshold_lower is unset (the band "
         f"[1/threshold, threshold] is empty otherwise), or set rollout_rs_threshold_lower")
    need(f"{p}.rollout_token_veto_threshold",
         rc.rollout_token_veto_threshold is None or rc.rollout_token_veto_threshold > 0, "unset or > 0 (e.g. 1e-4)")
    corrects = rc.rollout_is is not None or rc.rollout_rs is not None or rc.rollout_token_veto_threshold is not None
    need("actor_rollout_ref.actor.use_rollout_log_probs",
         not (cfg.actor_rollout_ref.actor.use_rollout_log_probs and corrects),
         f"false while {p} is on: with the rollout's log-probs as the old policy every ratio pi_old/pi_rollout is 1 "
         f"(the PPO ratio pi/pi_rollout already corrects the mismatch); turn one of them off")


# --------------------------------------------------------------------------------------------- cross-field


def critic_enabled(cfg: RLConfig) -> bool:
    """`critic.enable` when set, else whether the advantage estimator needs a critic (its registered facts)."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return _estimator(cfg).needs_critic


def _estimator(cfg: RLConfig):
    from rlhf_mcore.algos import adv_estimator_info, list_adv_estimators

    name = cfg.algorithm.adv_estimator
    if name not in list_adv_estimators():
        close = difflib.get_close_matches(name, list_adv_estimators(), n=1)
        raise ConfigError(f"algorithm.adv_estimator={name!r} is not registered; choose one of "
                          f"{', '.join(list_adv_estimators())} or register your own with "
                          f"rlhf_mcore.algos.register_adv_estimator in a trainer.plugins file."
                          + (f" Did you mean '{close[0]}'?" if close else ""))
    return adv_estimator_info(name)


def reference_enabled(cfg: RLConfig) -> bool:
    """A reference policy is only built when some KL term, or PRIME's implicit PRM, needs it."""
    return (cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss
            or prime_enabled(cfg))


def prime_enabled(cfg: RLConfig) -> bool:
    """PRIME's implicit process reward model (`reward_model.reward_manager=prime`, `reward_model.enable`)."""
    rm = cfg.reward.reward_model
    return rm.enable and rm.reward_manager == "prime"


_SPLIT_KEYS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
_SHARED = (("actor_rollout_ref.ref.megatron", lambda c: c.actor_rollout_ref.ref.megatron),
           ("critic.megatron", lambda c: c.critic.megatron))


def parallel_layout(cfg: RLConfig) -> tuple[int, int, Optional[int]]:
    """(TP, PP, VPP) of the training side: the actor's layout, which ref and critic must share."""
    m = cfg.actor_rollout_ref.actor.megatron
    tp, pp = m.tensor_model_parallel_size or 1, m.pipeline_model_parallel_size or 1
    for name, get in _SHARED:
        other = get(cfg)
        for attr, want in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
            got = getattr(other, attr)
            if got is not None and got != want:
                raise ConfigError(
                    f"config key '{name}.{attr}' is {got} but the actor's is {want}: all training models share one "
                    f"process layout. Remove '{name}.{attr}' or set it to {want}.")
    pipeline_split(cfg)
    return tp, pp, m.virtual_pipeline_model_parallel_size


def pipeline_split(cfg: RLConfig) -> dict:
    """The actor's `override_transformer_config` stage split as TransformerConfig overrides (only the keys set),
    which ref and critic share: a different value under their `megatron` sections is refused."""
    actor = cfg.actor_rollout_ref.actor.megatron.override_transformer_config
    split = {k: getattr(actor, k) for k in _SPLIT_KEYS if getattr(actor, k) is not None}
    for name, get in _SHARED:
        other = get(cfg).override_transformer_config
        for k in _SPLIT_KEYS:
            got = getattr(other, k)
            if got is not None and got != getattr(actor, k):
                key = f"{name}.override_transformer_config.{k}"
                raise ConfigError(
                    f"config key '{key}' is {got} but the actor's is {getattr(actor, k)}: ref and critic share the "
                    f"actor's pipeline stages. Remove '{key}' or set "
                    f"actor_rollout_ref.actor.megatron.override_transformer_config.{k} to the same value.")
    return split


def _check_pipeline_split(cfg: RLConfig, pp: int, vpp: Optional[int]) -> None:
    """The stage split against the layer count of the actor's (and a separate critic's) model, where readable."""
    from rlhf_mcore.models.pipeline_layout import PipelineLayoutError, resolve_split

    split = pipeline_split(cfg)
    paths = [("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path)]
    if critic_enabled(cfg) and cfg.critic.model.path:
        paths.append(("critic.model.path", cfg.critic.model.path))
    for key, path in paths:
        layers = model_num_layers(path)
        if layers is None:
            continue  # unreadable config.json: build_model reports it
        try:
            resolve_split(layers, pp, vpp, split.get(_SPLIT_KEYS[0]), split.get(_SPLIT_KEYS[1]))
        except PipelineLayoutError as e:
            raise ConfigError(
                f"{key}={path} has num_hidden_layers={layers}; with "
                f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}"
                + (f" and virtual_pipeline_model_parallel_size={vpp}" if vpp else "")
                + f": {e} (keys under actor_rollout_ref.actor.megatron.override_transformer_config)") from None


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_cuda_graphs(cfg: RLConfig, tp: int, pp: int, vpp: Optional[int]) -> None:
    """`megatron.cuda_graphs=true` where graphs cannot run is refused here, before anything is built (the engine
    checks again with the built model: `rlhf_mcore.engine.cuda_graphs.graphs_supported`)."""
    arr = cfg.actor_rollout_ref
    roles = [("actor_rollout_ref.actor", arr.actor.megatron, arr.model.use_remove_padding,
              arr.model.enable_gradient_checkpointing),
             ("actor_rollout_ref.ref", arr.ref.megatron, arr.model.use_remove_padding, False)]
    if critic_enabled(cfg):
        c = cfg.critic
        roles.append(("critic", c.megatron, c.model.use_remove_padding, c.model.enable_gradient_checkpointing))
    rm = cfg.reward.reward_model
    if rm.enable:
        roles.append(("reward_model", rm.megatron, rm.model.use_remove_padding, False))
    for role, megatron, packed, recompute in roles:
        if megatron.cuda_graphs is not True:
            continue
        why = ("trainer.device=cpu" if cfg.trainer.device == "cpu" else
               "TP or PP > 1 (or virtual pipeline stages)" if tp > 1 or pp > 1 or vpp else
               "context_parallel_size > 1" if megatron.context_parallel_size > 1 else
               "padded sequences (use_remove_padding=false)" if not packed else
               "activation recompute (enable_gradient_checkpointing=true)" if recompute else None)
        _require(why is None, f"{role}.megatron.cuda_graphs=true, but CUDA graphs cannot run with {why}: set it to "
                              "false, or leave it unset (graphs where they run).")


def validate_config(cfg: RLConfig, world_size: int, model_max_positions: Optional[int] = None,
                    read_model: bool = True) -> None:
    """Checks that relate several keys, the world size and the model. Fails on the first problem.

    `world_size`: the launched processes (the launch-layout keys must name them). `read_model=False` skips the
    checks that read the models' config.json (the pipeline split against the layer count): `--print-config`
    reads no model file."""
    load_plugins(cfg.trainer.plugins)  # plugins may register estimators, losses and rewards used below
    t = cfg.trainer
    if cfg.async_training.mode != "off":
        train_size, _ = pool_sizes(cfg, world_size)
        _check_async(cfg, train_size)
        world_size = train_size  # TP x PP x DP below: the training pool's
    else:
        _check_async(cfg, world_size)
    if t.nnodes is not None or t.n_gpus_per_node is not None:
        nodes, per_node = t.nnodes or 1, t.n_gpus_per_node or world_size // (t.nnodes or 1)
        _require(nodes * per_node == world_size,
                 f"trainer.nnodes={nodes} x trainer.n_gpus_per_node={per_node} = {nodes * per_node} processes, but "
                 f"{world_size} were launched: launch with `torchrun --nnodes={nodes} --nproc_per_node={per_node} "
                 f"launch/train.py ...`, or set the two keys to the launched layout (or leave them unset).")
    tp, pp, vpp = parallel_layout(cfg)
    _require(tp >= 1 and pp >= 1, f"tensor/pipeline parallel sizes must be >= 1, got TP={tp}, PP={pp}.")
    _require(
        world_size % (tp * pp) == 0,
        f"world size {world_size} is not divisible by TP×PP = {tp}×{pp} = {tp * pp}: set "
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size / pipeline_model_parallel_size so their "
        f"product divides {world_size}, or launch with a multiple of {tp * pp} processes.")
    if vpp is not None:
        _require(pp > 1, "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size needs "
                         "pipeline_model_parallel_size > 1.")
    if read_model:
        _check_pipeline_split(cfg, pp, vpp)
    _check_cuda_graphs(cfg, tp, pp, vpp)
    dp = world_size // (tp * pp)
    d, actor, rollout = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    _require(d.train_batch_size > 0, f"data.train_batch_size must be > 0, got {d.train_batch_size}.")
    _require(rollout.n >= 1, f"actor_rollout_ref.rollout.n must be >= 1, got {rollout.n}.")
    _require(d.max_prompt_length > 0 and d.max_response_length > 0,
             "data.max_prompt_length and data.max_response_length must be > 0.")
    _require(
        d.train_batch_size % dp == 0,
        f"data.train_batch_size={d.train_batch_size} is not divisible by the data-parallel size {dp} "
        f"(world {world_size} / TP {tp} / PP {pp}); all samples of a prompt stay on one DP rank, so use a "
        f"multiple of {dp}.")
    roles = [("actor_rollout_ref.actor", actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu,
              actor.use_dynamic_bsz)]
    if critic_enabled(cfg):
        c = cfg.critic
        roles.append(("critic", c.ppo_mini_batch_size or actor.ppo_mini_batch_size,
                      c.ppo_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu, c.use_dynamic_bsz))
    for role, mini, micro, dynamic in roles:
        _require(mini > 0, f"{role}.ppo_mini_batch_size must be > 0, got {mini}.")
        _require(
            d.train_batch_size % mini == 0,
            f"data.train_batch_size={d.train_batch_size} is not divisible by {role}.ppo_mini_batch_size={mini}: "
            f"choose a mini-batch size that divides the batch (e.g. {_divisor_hint(d.train_batch_size, mini)}).")
        _require(
            mini % dp == 0,
            f"{role}.ppo_mini_batch_size={mini} (prompts) is not divisible by the data-parallel size {dp}: "
            f"use a multiple of {dp}.")
        per_rank = mini * rollout.n // dp
        if not dynamic:
            _require(micro is not None and micro > 0,
                     f"{role}.ppo_micro_batch_size_per_gpu must be set (> 0) unless {role}.use_dynamic_bsz=true.")
            _require(
                per_rank % micro == 0,
                f"{role}: a mini-batch is {mini} prompts × rollout.n {rollout.n} / DP {dp} = {per_rank} sequences "
                f"per rank, not divisible by ppo_micro_batch_size_per_gpu={micro}: use a divisor of {per_rank} "
                f"(e.g. {_divisor_hint(per_rank, micro)}).")
    if model_max_positions is not None:
        total = d.max_prompt_length + d.max_response_length
        _require(
            total <= model_max_positions,
            f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length} + {d.max_response_length} "
            f"= {total} exceeds the model's context of {model_max_positions} tokens (max_position_embeddings): "
            f"shorten one of them.")
    _require(0 < actor.clip_ratio < 1, f"actor_rollout_ref.actor.clip_ratio must be in (0, 1), got {actor.clip_ratio}.")
    _require(actor.clip_ratio_c > 1, f"actor_rollout_ref.actor.clip_ratio_c must be > 1, got {actor.clip_ratio_c}.")
    _require(rollout.temperature >= 0,
             f"actor_rollout_ref.rollout.temperature must be >= 0, got {rollout.temperature}.")
    _require(0 < rollout.top_p <= 1, f"actor_rollout_ref.rollout.top_p must be in (0, 1], got {rollout.top_p}.")
    _require(rollout.sleep_level in (1, 2),
             f"actor_rollout_ref.rollout.sleep_level must be 1 (free the KV cache) or 2 (KV cache and weights), got "
             f"{rollout.sleep_level}.")
    _require(rollout.sleep_level == 1 or rollout.free_cache_engine,
             "actor_rollout_ref.rollout.sleep_level=2 releases the rollout's memory after generating, which "
             "free_cache_engine=false turns off: set free_cache_engine=true or sleep_level=1.")
    _check_algorithm_names(cfg)
    _require(cfg.async_training.mode != "off" or (rollout.tensor_model_parallel_size >= 1
                                                  and world_size % rollout.tensor_model_parallel_size == 0),
             f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} must divide "
             f"the world size {world_size}.")


def pool_sizes(cfg: RLConfig, world_size: int) -> tuple[int, int]:
    """(training pool, rollout pool) process counts under async_training: the rollout pool is rollout.nnodes x
    rollout.n_gpus_per_node, the training pool trainer.nnodes x trainer.n_gpus_per_node (or the rest of the world);
    together they must be the launched world."""
    rp, t = cfg.rollout, cfg.trainer
    _require(rp.n_gpus_per_node is not None,
             f"async_training.mode={cfg.async_training.mode} splits the world into a training and a rollout pool: set "
             f"rollout.n_gpus_per_node (and rollout.nnodes, default 1) to the rollout pool's processes per node, "
             f"e.g. rollout.n_gpus_per_node=1 trainer.n_gpus_per_node={max(world_size - 1, 1)}.")
    rollout = (rp.nnodes or 1) * rp.n_gpus_per_node
    train = (t.nnodes or 1) * t.n_gpus_per_node if t.n_gpus_per_node is not None else world_size - rollout
    _require(train >= 1 and train + rollout == world_size,
             f"async_training: the training pool (trainer.nnodes x trainer.n_gpus_per_node = {train}) and the rollout "
             f"pool (rollout.nnodes x rollout.n_gpus_per_node = {rollout}) must add up to the {world_size} processes "
             f"torchrun launched: launch {max(train, 1) + rollout} processes or change the pool sizes.")
    return train, rollout


def _check_async(cfg: RLConfig, train_world: int) -> None:
    a, r = cfg.async_training, cfg.actor_rollout_ref.rollout
    defaults = AsyncTrainingConfig()
    if a.mode == "off":
        _require(cfg.rollout.nnodes is None and cfg.rollout.n_gpus_per_node is None,
                 "rollout.nnodes / rollout.n_gpus_per_node size the rollout pool of the asynchronous trainers: set "
                 "async_training.mode=one_step_off or fully_async, or remove them (the synchronous trainer colocates "
                 "the rollout on every rank).")
    if a.mode != "fully_async":
        for k in ("require_batches", "trigger_parameter_sync_step", "staleness_threshold", "partial_rollout"):
            _require(getattr(a, k) == getattr(defaults, k),
                     f"async_training.{k}={getattr(a, k)!r} applies to async_training.mode=fully_async only (the mode "
                     f"is {a.mode}): remove it or set the mode.")
    if a.mode == "off":
        return
    _, rollout = pool_sizes(cfg, train_world + (cfg.rollout.nnodes or 1) * cfg.rollout.n_gpus_per_node)
    _require(rollout % r.tensor_model_parallel_size == 0,
             f"the rollout pool has {rollout} processes, not a multiple of "
             f"actor_rollout_ref.rollout.tensor_model_parallel_size={r.tensor_model_parallel_size}.")
    # reward_model.enable (a discriminative reward model) runs on the training pool: async_trainers scores each batch
    _require(not cfg.reward.judge.enable,
             f"reward.judge.enable=true serves the judge with a second rollout engine colocated with the synchronous "
             f"trainer's; with async_training.mode={a.mode} the training pool holds no rollout engine to serve it: "
             f"turn the judge off or set async_training.mode=off.")
    _require(cfg.reward.reward_model.reward_manager != "prime",
             f"reward_model.reward_manager=prime updates its implicit PRM inside the synchronous step, on that step's "
             f"freshly generated samples before the actor's update; async_training.mode={a.mode} has no such step: "
             f"use another reward_manager or set async_training.mode=off.")
    _require(not cfg.algorithm.filter_groups.enable,
             f"algorithm.filter_groups (dynamic sampling) runs with async_training.mode=off only, not "
             f"{a.mode}: set algorithm.filter_groups.enable=false or async_training.mode=off.")
    if a.mode == "fully_async":
        need = a.require_batches * cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        _require(a.require_batches >= 1 and a.trigger_parameter_sync_step >= 1 and a.staleness_threshold >= 0,
                 "async_training.require_batches and .trigger_parameter_sync_step must be >= 1, "
                 ".staleness_threshold >= 0 (policy versions).")
        _require(a.staleness_threshold >= a.trigger_parameter_sync_step - 1,
                 f"async_training.staleness_threshold={a.staleness_threshold} is below "
                 f"trigger_parameter_sync_step - 1 = {a.trigger_parameter_sync_step - 1}: the rollout pool's weights "
                 f"lag the trainer by up to that many versions between syncs, so every sample would be dropped as "
                 f"stale and the run would never finish a step: raise the threshold or sync more often.")
        _require(cfg.data.train_batch_size == need,
                 f"async_training.mode=fully_async trains require_batches x actor.ppo_mini_batch_size = "
                 f"{a.require_batches} x {cfg.actor_rollout_ref.actor.ppo_mini_batch_size} = {need} prompts a step: "
                 f"set data.train_batch_size={need} (it is {cfg.data.train_batch_size}).")
        _require(r.name == "native",
                 f"async_training.mode=fully_async streams samples from the native engine; "
                 f"actor_rollout_ref.rollout.name={r.name} does not stream: set it to native, or use one_step_off.")
        _require(r.tensor_model_parallel_size == 1,
                 "async_training.mode=fully_async runs rollout replicas of one process each: set "
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=1 (one_step_off takes rollout TP > 1).")
        from rlhf_mcore.algos import adv_estimator_info

        _require(not adv_estimator_info(cfg.algorithm.adv_estimator).needs_greedy_baseline,
                 f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs a greedy baseline per prompt, which "
                 f"the streaming rollout does not generate: use one_step_off or another estimator.")


def _check_algorithm_names(cfg: RLConfig) -> None:
    """Names users can extend are checked against the registries (after trainer.plugins were imported)."""
    from rlhf_mcore.algos import list_kl_estimators, list_loss_agg_modes, list_policy_losses

    actor = cfg.actor_rollout_ref.actor
    for key, value, names, how in (
            ("actor_rollout_ref.actor.policy_loss", actor.policy_loss, list_policy_losses(),
             " or register your own with rlhf_mcore.algos.register_policy_loss in a trainer.plugins file"),
            ("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, list_loss_agg_modes(), ""),
            ("critic.loss_agg_mode", cfg.critic.loss_agg_mode, list_loss_agg_modes(), ""),
            ("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type.rstrip("+"), list_kl_estimators(),
             " (a '+' suffix takes k2's gradient)"),
            ("algorithm.kl_penalty", cfg.algorithm.kl_penalty.rstrip("+"), list_kl_estimators(),
             " (a '+' suffix takes k2's gradient)")):
        if value not in names:
            close = difflib.get_close_matches(str(value), names, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"config key '{key}' has value {value!r}; choose one of {', '.join(names)}{how}.{hint}")
    est, name, n = _estimator(cfg), cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n
    if est.needs_critic and cfg.critic.enable is False:
        raise ConfigError(f"algorithm.adv_estimator={name} needs a critic but critic.enable is false: set "
                          f"critic.enable=true or choose an estimator without one (e.g. grpo).")
    _require(not est.needs_group_index or n >= 2,
             f"algorithm.adv_estimator={name} compares the samples of each prompt with each other, but "
             f"actor_rollout_ref.rollout.n={n}: set rollout.n >= 2 (e.g. 5), or use an estimator that needs no "
             f"group (gae, remax, reinforce_plus_plus).")


def load_plugins(plugins: list[str]) -> None:
    """Import each ``trainer.plugins`` entry (a .py file or a module name) once; registrations happen on import."""
    import importlib
    import importlib.util
    import sys

    for entry in plugins:
        name = f"rlhf_mcore_plugin_{Path(entry).stem}" if entry.endswith(".py") else entry
        if name in sys.modules:
            continue
        try:
            if entry.endswith(".py"):
                if not Path(entry).is_file():
                    raise ConfigError(f"trainer.plugins: file {entry!r} does not exist.")
                spec = importlib.util.spec_from_file_location(name, entry)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
            else:
                importlib.import_module(entry)
        except ConfigError:
            raise
        except Exception as e:  # a plugin's own error: say which plugin
            sys.modules.pop(name, None)
            raise ConfigError(f"trainer.plugins: importing {entry!r} failed: {type(e).__name__}: {e}") from e


def _divisor_hint(total: int, near: int) -> int:
    divisors = [k for k in range(1, total + 1) if total % k == 0]
    return min(divisors, key=lambda k: (abs(k - near), k))


def model_max_positions(model_path: str) -> Optional[int]:
    """max_position_embeddings from an HF config.json, or None where it cannot be read."""
    try:
        return int(json.loads((Path(model_path) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def model_num_layers(model_path: str) -> Optional[int]:
    """num_hidden_layers from an HF config.json, or None where it cannot be read."""
    try:
        return int(json.loads((Path(model_path) / "config.json").read_text())["num_hidden_layers"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def to_yaml(cfg: RLConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RLConfig) -> dict:
    return dataclasses.asdict(cfg)


__all__ = [
    "RLConfig", "ConfigError", "load_config", "validate_config", "critic_enabled", "reference_enabled", "prime_enabled",
    "parallel_layout", "pipeline_split", "model_max_positions", "to_yaml", "to_dict", "load_plugins",
]
