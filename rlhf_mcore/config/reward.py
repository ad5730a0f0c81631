"""The `reward` section: rule rewards and their workers, the reward model (and PRIME's implicit PRM), DAPO's
overlong shaping and the LLM judge."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from rlhf_mcore.config.checks import above, at_least, checked, finite, unset_or, within
from rlhf_mcore.config.shared import AT_LEAST_ONE, FINITE, TEMPERATURE, Dtype, MegatronConfig, OptimConfig


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
    len: int = checked(0, ok=at_least(0), what=">= 0 (tokens)")  # of the buffer; enable needs 1..max_response_length
    # the penalty of a response at data.max_response_length
    penalty_factor: float = checked(0.0, ok=lambda v: finite(v) and v >= 0, what=">= 0 (e.g. 1.0)")
    log: bool = False  # log reward/overlong_penalty and reward/overlong_fraction


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None  # a Hugging Face *ForSequenceClassification directory with num_labels=1
    # the policy's tokenizer, when the reward model's tokenizer or chat template differs from it: each conversation
    # is then decoded and re-templated with the reward model's chat template; None: the policy's token ids as they
    # are (the two tokenizers must then be the same)
    input_tokenizer: Optional[str] = None
    dtype: Dtype = "auto"
    use_remove_padding: bool = True
    # must stay false, as for the actor's model
    trust_remote_code: bool = checked(False, ok=lambda v: not v,
                                      what="false: reward models load through rlhf_mcore's own Qwen2/Qwen3/Llama code")
    # PRIME (reward_manager=prime): the implicit PRM's beta, when it is updated relative to scoring (before: update,
    # then score with the updated PRM, veRL's default; after: score, then update) and its optimizer
    beta_train: float = checked(0.05, ok=lambda v: finite(v) and v > 0, what="> 0 (e.g. 0.05)")
    update: Literal["before", "after"] = "before"
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
    # sequences per forward pass; None: 1
    micro_batch_size_per_gpu: Optional[int] = checked(None, ok=unset_or(at_least(1)), what="unset or >= 1")
    # tokens given to the reward model; longer inputs are cut at the end, counted
    max_length: Optional[int] = checked(None, ok=unset_or(at_least(2)), what="unset or >= 2 (tokens)")
    reward_weight: float = checked(1.0, **FINITE)
    rule_weight: float = checked(0.0, **FINITE)
    data_sources: list[str] = field(default_factory=list)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # param_offload: on the host between scorings
    # veRL's names for scoring each sample by its data_source's function: naive, or dapo (the same here: its
    # overlong shaping is overlong_buffer below, applied under either name); prime: PRIME's implicit process reward
    # model (rlhf_mcore.trainer.prime; model.path: a causal LM, unset = the actor's model)
    reward_manager: Literal["naive", "dapo", "prime"] = "naive"
    prime_granularity: Literal["token", "whole"] = "token"  # PRIME: where the process rewards sit
    # PRIME: batch_norm scales by the batch's largest |return-to-go|
    prime_norm: Literal["batch_norm", "none"] = "batch_norm"
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
    max_new_tokens: int = checked(64, **AT_LEAST_ONE)
    temperature: float = checked(0.0, **TEMPERATURE)
    max_num_seqs: int = checked(64, **AT_LEAST_ONE)
    max_model_len: int = checked(4096, **AT_LEAST_ONE)
    reward_weight: float = checked(1.0, **FINITE)
    rule_weight: float = checked(0.0, **FINITE)
    data_sources: list[str] = field(default_factory=list)


@dataclass
class RewardConfig:
    num_workers: int = checked(0, ok=at_least(0), what=">= 0 (0 scores in the trainer process)")
    # per item, also with num_workers=0; an item that hangs scores 0 and counts as a timeout
    timeout_s: float = checked(10.0, ok=above(0), what="> 0 seconds")
    # Fail the run (RewardFunctionError, with the function's first error) when more than this fraction of a
    # step's items raised, returned no valid number or timed out. 0.5: a working function fails on a few odd
    # outputs at most; when most items fail the function is broken and the step would train on zeros. 0.0
    # tolerates no failure; 1.0 turns the check off.
    max_failure_ratio: float = checked(0.5, ok=within(0, 1), what=(
        "in [0, 1] (the fraction of a step's items whose reward may fail; 1.0 turns the check off)"))
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
