"""What a :class:`~rlhf_mcore.engine.TrainEngine` needs to know besides the model: batching, loss and scoring.

The run configuration (`rlhf_mcore.config`) counts mini-batches in *prompts* over the whole data-parallel
world; the engine works on one DP rank's share of a batch and counts *sequences per rank*. The
`from_actor` / `from_critic` / `from_ref` constructors do that conversion.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["EngineConfig"]

ROLES = ("actor", "critic", "ref", "reward")


@dataclass
class EngineConfig:
    role: str = "actor"  # actor | critic | ref (forward-only, frozen) | reward (scores; trains with a loss hook)
    # -- updates: ppo_epochs × mini-batches × micro-batches (sequences per DP rank)
    mini_batch_size: Optional[int] = None  # sequences per optimizer step; None: the whole batch
    micro_batch_size: int = 1  # sequences per forward/backward (when not use_dynamic_bsz)
    use_dynamic_bsz: bool = False  # micro-batches by a token budget instead of a sequence count
    max_token_len: int = 16384  # token budget of one micro-batch (ppo_max_token_len_per_gpu)
    ppo_epochs: int = 1
    shuffle: bool = False  # shuffle sequences between epochs before forming mini-batches
    seed: int = 1
    grad_clip: float = 1.0  # max global gradient norm (<= 0: no clipping)
    use_remove_padding: bool = True  # packed (THD) sequences; False: padded [B, S] with a causal mask
    # packed: rows with the same prompt share one copy of it in a micro-batch (rlhf_mcore.engine.shared_prefix)
    share_prompt_prefix: bool = False
    # -- forward-only passes (old/ref log-probs, values)
    forward_micro_batch_size: Optional[int] = None  # None: micro_batch_size
    forward_use_dynamic_bsz: Optional[bool] = None  # None: use_dynamic_bsz
    forward_max_token_len: Optional[int] = None  # None: max_token_len
    # -- actor loss
    policy_loss: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    loss_scale_factor: Optional[float] = None  # seq-mean-token-sum-norm's constant (default: R)
    # -- critic loss
    cliprange_value: float = 0.5
    # -- scoring tokens
    temperature: float = 1.0  # the rollout's sampling temperature: log-probs of softmax(logits / T)
    logprob_chunk_size: int = 2048  # rows of logits processed at once (bounds fp32 working memory)
    logprob_backend: str = "auto"  # auto | torch | triton (registry in rlhf_mcore.engine.logprobs)
    # (lo, hi): score tokens under the softmax over ids lo..hi-1 only (a VLA policy's action vocabulary, as
    # rlhf_mcore.models.vision.decode samples them); None: the whole vocabulary
    token_range: Optional[tuple[int, int]] = None
    # -- the decoder as CUDA graphs (rlhf_mcore.engine.cuda_graphs): None where supported for micro-batches of at
    # most AUTO_MAX_TOKENS tokens, True for all (required), False off
    cuda_graphs: Optional[bool] = None
    # -- routing replay of MoE models (veRL's actor.router_replay.mode): disabled | R2 | R3; which pass replays which
    # routes is rlhf_mcore.engine.routes.replay_key
    router_replay: str = "disabled"

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"engine role={self.role!r}; choose one of {ROLES}")
        for key in ("micro_batch_size", "max_token_len", "ppo_epochs", "logprob_chunk_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"engine {key} must be >= 1, got {getattr(self, key)}")
        for key, name in zip(("forward_micro_batch_size", "forward_max_token_len"), self.forward_keys):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {getattr(self, key)}")
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            raise ValueError(f"engine mini_batch_size must be >= 1 or None, got {self.mini_batch_size}")
        if self.token_range is not None and not (0 <= self.token_range[0] < self.token_range[1]):
            raise ValueError(f"engine token_range={self.token_range} must be (lo, hi) with 0 <= lo < hi")
        if self.temperature <= 0:
            raise ValueError(f"engine temperature must be > 0 (log-probs are scored under logits / T), got "
                             f"{self.temperature}; for greedy rollouts use 1.0")

    @property
    def update_keys(self) -> tuple[str, str]:
        """The run-config keys of this role's update micro-batch size and token budget (for error messages)."""
        if self.role == "reward":
            return "launch/train_rm.py --micro-batch-pairs (x2)", "(dynamic batching is not used for pairs)"
        prefix = "critic" if self.role == "critic" else "actor_rollout_ref.actor"
        return f"{prefix}.ppo_micro_batch_size_per_gpu", f"{prefix}.ppo_max_token_len_per_gpu"

    @property
    def forward_keys(self) -> tuple[str, str]:
        """The run-config keys of this role's forward-only micro-batch size and token budget."""
        if self.role == "critic":
            return "critic.forward_micro_batch_size_per_gpu", "critic.forward_max_token_len_per_gpu"
        if self.role == "reward":
            return "reward_model.micro_batch_size_per_gpu", "reward_model.forward_max_token_len_per_gpu"
        prefix = "actor_rollout_ref.ref" if self.role == "ref" else "actor_rollout_ref.rollout"
        return f"{prefix}.log_prob_micro_batch_size_per_gpu", f"{prefix}.log_prob_max_token_len_per_gpu"

    @property
    def graph_key(self) -> str:
        """The run-config key of this role's CUDA graphs switch (for error messages)."""
        keys = {"critic": "critic", "ref": "actor_rollout_ref.ref", "reward": "reward_model"}
        return f"{keys.get(self.role, 'actor_rollout_ref.actor')}.megatron.cuda_graphs"

    @property
    def fwd_micro_batch_size(self) -> int:
        return self.forward_micro_batch_size or self.micro_batch_size

    @property
    def fwd_use_dynamic_bsz(self) -> bool:
        return self.use_dynamic_bsz if self.forward_use_dynamic_bsz is None else self.forward_use_dynamic_bsz

    @property
    def fwd_max_token_len(self) -> int:
        return self.forward_max_token_len or self.max_token_len

    # ------------------------------------------------------------------ from the run configuration

    @classmethod
    def from_actor(cls, actor, model, rollout, dp_size: int, forward=None) -> "EngineConfig":
        """From `actor_rollout_ref.actor` (ActorConfig), `.model` (ModelConfig), `.rollout` (RolloutConfig).

        `forward`: where the old-policy log-prob settings live (`rollout.log_prob_*` in veRL's layout).
        """
        forward = forward or rollout
        return cls(
            role="actor", mini_batch_size=_per_rank(actor.ppo_mini_batch_size, rollout.n, dp_size,
                                                    "actor_rollout_ref.actor.ppo_mini_batch_size"),
            micro_batch_size=actor.ppo_micro_batch_size_per_gpu or 1, use_dynamic_bsz=actor.use_dynamic_bsz,
            max_token_len=actor.ppo_max_token_len_per_gpu, ppo_epochs=actor.ppo_epochs, shuffle=actor.shuffle,
            seed=actor.megatron.seed, use_remove_padding=model.use_remove_padding,
            share_prompt_prefix=getattr(model, "share_prompt_prefix", False),
            forward_micro_batch_size=getattr(forward, "log_prob_micro_batch_size_per_gpu", None),
            forward_use_dynamic_bsz=getattr(forward, "log_prob_use_dynamic_bsz", None),
            forward_max_token_len=getattr(forward, "log_prob_max_token_len_per_gpu", None),
            policy_loss=actor.policy_loss, loss_agg_mode=actor.loss_agg_mode, clip_ratio=actor.clip_ratio,
            clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_c=actor.clip_ratio_c, entropy_coeff=actor.entropy_coeff, use_kl_loss=actor.use_kl_loss,
            kl_loss_coef=actor.kl_loss_coef, kl_loss_type=actor.kl_loss_type, grad_clip=actor.grad_clip,
            loss_scale_factor=getattr(actor, "loss_scale_factor", None),
            temperature=rollout.temperature if rollout.temperature > 0 else 1.0,
            logprob_backend=getattr(actor, "logprob_backend", "auto"), cuda_graphs=actor.megatron.cuda_graphs,
            router_replay=actor.router_replay.mode if hasattr(actor, "router_replay") else "disabled")

    @classmethod
    def from_critic(cls, critic, actor, rollout, dp_size: int) -> "EngineConfig":
        """From `critic` (CriticConfig); unset sizes fall back to the actor's, as the run config says."""
        mini = critic.ppo_mini_batch_size or actor.ppo_mini_batch_size
        return cls(
            role="critic", mini_batch_size=_per_rank(mini, rollout.n, dp_size, "critic.ppo_mini_batch_size"),
            micro_batch_size=critic.ppo_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu or 1,
            use_dynamic_bsz=critic.use_dynamic_bsz, max_token_len=critic.ppo_max_token_len_per_gpu,
            forward_micro_batch_size=getattr(critic, "forward_micro_batch_size_per_gpu", None),
            forward_max_token_len=getattr(critic, "forward_max_token_len_per_gpu", None),
            ppo_epochs=critic.ppo_epochs or actor.ppo_epochs, shuffle=actor.shuffle, seed=critic.megatron.seed,
            use_remove_padding=critic.model.use_remove_padding,
            share_prompt_prefix=getattr(critic.model, "share_prompt_prefix", False), loss_agg_mode=critic.loss_agg_mode,
            cliprange_value=critic.cliprange_value, grad_clip=critic.grad_clip, cuda_graphs=critic.megatron.cuda_graphs)

    @classmethod
    def from_ref(cls, ref, model, rollout, router_replay: str = "disabled") -> "EngineConfig":
        """From `actor_rollout_ref.ref` (RefConfig): forward-only, no optimizer; `router_replay`: the actor's mode
        (R3 replays the rollout's routes in the reference pass too)."""
        return cls(
            role="ref", micro_batch_size=ref.log_prob_micro_batch_size_per_gpu or 1,
            use_dynamic_bsz=ref.log_prob_use_dynamic_bsz, max_token_len=ref.log_prob_max_token_len_per_gpu,
            use_remove_padding=model.use_remove_padding, seed=ref.megatron.seed,
            share_prompt_prefix=getattr(model, "share_prompt_prefix", False),
            temperature=rollout.temperature if rollout.temperature > 0 else 1.0,
            logprob_backend=getattr(ref, "logprob_backend", "auto"), cuda_graphs=ref.megatron.cuda_graphs,
            router_replay=router_replay)


def _per_rank(prompts: int, n: int, dp_size: int, key: str) -> int:
    seqs = prompts * n
    if seqs % dp_size:
        raise ValueError(f"{key}={prompts} prompts × rollout.n={n} = {seqs} sequences is not divisible by the "
                         f"data-parallel size {dp_size}; use a multiple of {dp_size}")
    return seqs // dp_size
