"""The `vla` section: a vision-language-action run (rlhf_mcore/trainer/vla.py) instead of a text one.

`vla.enable=true` makes `launch/train.py` run the VLA trainer: GRPO (the default) or PPO with a value head on task
success against a vectorized simulated env. What it reads besides this section: `actor_rollout_ref.model.path` (a
LLaVA directory), `.actor.optim`, the actor's loss keys (`clip_ratio*`, `entropy_coeff`, `ppo_epochs`,
`ppo_max_token_len_per_gpu`, `grad_clip`), `.rollout.n` (one GRPO group = n episodes from one initial state) and
`.rollout.temperature`, `algorithm.adv_estimator` (grpo, the VLA default when unset, or gae), with grpo
`algorithm.norm_adv_by_std_in_grpo`, with gae `algorithm.gamma`, `algorithm.lam` and the critic's keys in
`_CRITIC_READ` (`critic.enable`, `.model.path` (default: the actor's), `.optim`, `.ppo_epochs`, ...), and
`trainer.*` (steps, checkpoints, validation, loggers, seed, device). The text trainer's keys (data files and
lengths, the rollout engine, rewards, the reference, async modes, the critic's mini/micro-batch sizes, ...) and the
keys of the estimator not chosen do nothing here, so a run that sets them is refused (:func:`check_vla_keys`: the
key, its value and the fix) rather than silently ignoring them.

Sizes: `num_envs` episodes per step = `num_envs / rollout.n` initial states drawn from the training range, each
`rollout.n` times. The action dimension comes from the env (ReachPush: 2), not from the config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhf_mcore.config.checks import at_least, checked, within
from rlhf_mcore.config.errors import ConfigError

TASKS = ("reach", "push")
COLORS = ("red", "green", "blue", "yellow")  # rlhf_mcore.vla.envs.reach_push.COLORS (not imported: numpy-free config)


@dataclass
class VLAConfig:
    enable: bool = False  # true: launch/train.py runs the VLA trainer
    env: Literal["reach_push"] = "reach_push"
    num_envs: int = checked(16, ok=at_least(1), what=">= 1 (episodes per step: num_envs / rollout.n states)")
    num_workers: int = checked(0, ok=at_least(0), what=">= 0 (0: the envs step in the trainer's process)")
    chunk: int = checked(4, ok=at_least(1), what=">= 1 (action steps per policy call)")
    num_bins: int = checked(16, ok=at_least(2), what=">= 2 (action bins per dimension, on the last ids)")
    max_steps: int = checked(24, ok=at_least(1), what=">= 1 (env steps before an episode is truncated)")
    image_size: int = checked(16, ok=at_least(16), what=">= 16 (the rendered image; the tower's image_size)")
    tasks: list[str] = checked(factory=lambda: ["reach"], ok=lambda v: bool(v) and all(t in TASKS for t in v),
                               what=f"a non-empty list from {list(TASKS)} (the task mix: each scene draws one)")
    colors: list[str] = checked(factory=lambda: ["red", "green", "blue"],
                                ok=lambda v: 1 <= len(v) <= 4 and len(set(v)) == len(v) and all(c in COLORS for c in v),
                                what=f"1-4 distinct colours from {list(COLORS)} (the blocks of each scene)")
    freeze_vision: bool = False  # the SigLIP tower gets no gradients (the projector and the text model train)
    held_out_states: int = checked(64, ok=at_least(1), what=">= 1 (held-out initial states of validation)")
    # DAPO's group filter (SimpleVLA-RL): train only on groups whose success rate lies in [filter_low, filter_high]
    filter_groups: bool = False
    filter_low: float = checked(0.1, ok=within(0.0, 1.0), what="in [0, 1]")
    filter_high: float = checked(0.9, ok=within(0.0, 1.0), what="in [0, 1]")
    overlap: bool = True  # two env stages: the policy generates for one while the other steps (needs num_workers)
    # the action statistics (q01/q99) and the behaviour-cloning warm start: scripted-expert demonstrations
    demo_episodes: int = checked(128, ok=at_least(1), what=">= 1 (expert episodes for the action statistics)")
    # an imperfect expert with one consistent habit (as the text demo's warm start ends 70% of its answers with a
    # full stop the strict reward rejects): in this fraction of the demonstration episodes the expert heads for the
    # next colour after the named one (vla.colors' cyclic order: red -> green -> blue -> red), for a warm start that
    # finds blocks but greedily takes the wrong one. Measured: the demo's tiny policy does not read the instruction's
    # colour, so it cannot learn this habit nor GRPO flip it (README, "VLA"); make demo-vla uses demo_stop_short
    demo_wrong_target: float = checked(0.0, ok=within(0.0, 1.0), what="in [0, 1] (a fraction of the demonstrations)")
    # the other habit (reach scenes only): in this fraction of the demonstrations the expert stops 0.2 short of the
    # block (the task needs 0.02) and stands there, so the warm start greedily stops short while its samples
    # sometimes go on, and GRPO flips it (make demo-vla: 0.7); disjoint from demo_wrong_target's episodes (the two
    # sum to <= 1)
    demo_stop_short: float = checked(0.0, ok=within(0.0, 1.0), what="in [0, 1] (a fraction of the demonstrations)")
    bc_steps: int = checked(0, ok=at_least(0), what=">= 0 (behaviour-cloning steps before RL; 0: none)")
    bc_batch_size: int = checked(64, ok=at_least(1), what=">= 1")
    # the behaviour-cloning learning rate (the GRPO steps use actor.optim.lr)
    bc_lr: float = checked(1e-3, ok=lambda v: v > 0, what="> 0")
    # start the RL steps with fresh Adam moments: BC's (large, NLL) gradient history would otherwise set the scale
    # of the first policy-gradient steps (1/sqrt(v) with beta2=0.999 forgets it over ~1000 steps) and its momentum
    # would keep pushing along BC's direction
    bc_reset_optimizer: bool = True


# Keys a VLA run reads outside its own section; everything else the user sets is refused.
_READ = ("actor_rollout_ref.model.path", "actor_rollout_ref.model.use_remove_padding",
         "actor_rollout_ref.actor.optim.", "actor_rollout_ref.actor.clip_ratio",
         "actor_rollout_ref.actor.clip_ratio_low",
         "actor_rollout_ref.actor.clip_ratio_high", "actor_rollout_ref.actor.clip_ratio_c",
         "actor_rollout_ref.actor.entropy_coeff", "actor_rollout_ref.actor.ppo_epochs",
         "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.actor.grad_clip",
         "actor_rollout_ref.actor.loss_agg_mode", "actor_rollout_ref.actor.policy_loss",
         "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
         "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size", "actor_rollout_ref.actor.megatron.seed",
         "actor_rollout_ref.actor.megatron.use_distributed_optimizer", "actor_rollout_ref.rollout.n",
         "actor_rollout_ref.rollout.temperature", "algorithm.adv_estimator",
         "algorithm.norm_adv_by_std_in_grpo", "algorithm.gamma", "algorithm.lam", "trainer.", "vla.")
# The critic's keys a PPO run (algorithm.adv_estimator=gae) reads (rlhf_mcore/trainer/vla.py: build_critic); part of
# _READ, refused with grpo (check_vla_relations). The rest of `critic.*` is refused by _FIXES.
_CRITIC_READ = ("critic.enable", "critic.model.path", "critic.model.use_remove_padding", "critic.optim.",
                "critic.ppo_epochs", "critic.ppo_max_token_len_per_gpu", "critic.grad_clip", "critic.cliprange_value",
                "critic.loss_agg_mode", "critic.megatron.seed", "critic.megatron.use_distributed_optimizer")
_READ = _READ + _CRITIC_READ
_GRPO_ONLY = ("algorithm.norm_adv_by_std_in_grpo",)  # read with grpo, refused with gae
_GAE_ONLY = ("algorithm.gamma", "algorithm.lam") + _CRITIC_READ  # read with gae, refused with grpo
# Set-but-unread keys the refusal names a specific fix for (by prefix); the rest get the general one.
_FIXES = (
    ("data.", "the VLA trainer draws initial states from the env, not prompts from files: remove it (episodes per "
              "step are vla.num_envs, held-out states vla.held_out_states)"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", "a VLA step trains on all its rows in one mini-batch per epoch "
                                                     "(actor.ppo_epochs): remove it"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size", "VLA rows are micro-batched by tokens: set "
                                                      "actor_rollout_ref.actor.ppo_max_token_len_per_gpu instead"),
    ("actor_rollout_ref.rollout.", "the policy decodes its action chunks itself (rlhf_mcore.models.vision.decode): "
                                   "only rollout.n and rollout.temperature apply"),
    ("actor_rollout_ref.ref.", "the VLA trainer has no reference policy (no KL term): remove it"),
    ("critic.ppo_mini_batch_size", "a VLA step trains the critic on all its rows in one mini-batch per epoch "
                                   "(critic.ppo_epochs): remove it"),
    ("critic.ppo_micro_batch_size", "VLA rows are micro-batched by tokens: set critic.ppo_max_token_len_per_gpu "
                                    "instead"),
    ("critic.model.lora", "the VLA critic (a LLaVA with a value head) has no LoRA: remove it"),
    ("critic.", "the VLA critic reads only critic.enable, .model.path, .model.use_remove_padding, .optim.*, "
                ".ppo_epochs, .ppo_max_token_len_per_gpu, .grad_clip, .cliprange_value, .loss_agg_mode and "
                ".megatron.seed: remove it"),
    ("reward.", "the reward is the env's task success: remove it"),
    ("async_training.", "the VLA trainer is synchronous: remove it"),
    ("rollout.", "the VLA trainer has no rollout pool: remove it"),
)


def _reads(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in _READ)


def check_vla_keys(cfg, given) -> None:
    """With `vla.enable`: refuse every key in `given` (set in the YAML or on the command line) that a VLA run does
    not read, naming the key, its value and the fix; then the rules between VLA keys. Without it: refuse any
    `vla.*` key but `vla.enable` (they would do nothing). An unset `algorithm.adv_estimator` becomes grpo (the VLA
    trainer's default; the text trainer's is gae), so the config says which estimator runs."""
    from rlhf_mcore.config.checks import value_at

    if not cfg.vla.enable:
        stray = sorted(k for k in given if k.startswith("vla.") and k != "vla.enable")
        if stray:
            raise ConfigError(f"config key '{stray[0]}' has value {value_at(cfg, stray[0])!r}, but vla.enable=false "
                              "runs the text trainer, which reads no vla.* key: set vla.enable=true or remove it.")
        return
    for key in sorted(given):
        if _reads(key):
            continue
        fix = next((f for prefix, f in _FIXES if key.startswith(prefix)), "a VLA run does not read it: remove it")
        raise ConfigError(f"config key '{key}' has value {value_at(cfg, key)!r}, which does not apply to a VLA run "
                          f"(vla.enable=true): {fix}.")
    if "algorithm.adv_estimator" not in given:
        cfg.algorithm.adv_estimator = "grpo"
    check_vla_relations(cfg, given)


def check_vla_relations(cfg, given=()) -> None:
    """The rules between the keys a VLA run reads (`given`: the keys set, as for :func:`check_vla_keys`)."""
    v, n = cfg.vla, cfg.actor_rollout_ref.rollout.n
    if v.num_envs % n:
        raise ConfigError(f"config key 'vla.num_envs' has value {v.num_envs}; it must be a multiple of "
                          f"actor_rollout_ref.rollout.n={n} (each initial state runs n times: one GRPO group).")
    if cfg.trainer.total_training_steps is None:
        raise ConfigError("config key 'trainer.total_training_steps' has value None; a VLA run has no epochs over a "
                          "data set: set trainer.total_training_steps (GRPO steps).")
    est = cfg.algorithm.adv_estimator
    if est not in ("grpo", "gae"):
        raise ConfigError(f"config key 'algorithm.adv_estimator' has value {est!r}; a VLA run trains with grpo "
                          "(group-normalised task success) or gae (PPO with a value head): set one of them.")
    _check_estimator_keys(cfg, given, est)
    if v.demo_wrong_target > 0 and len(v.colors) < 2:
        raise ConfigError(f"config key 'vla.demo_wrong_target' has value {v.demo_wrong_target}; the habit heads for "
                          f"another colour than the named one, and vla.colors={v.colors} has one: add a colour or "
                          "set vla.demo_wrong_target=0.")
    if v.demo_wrong_target + v.demo_stop_short > 1:
        raise ConfigError(f"config key 'vla.demo_stop_short' has value {v.demo_stop_short}; with "
                          f"vla.demo_wrong_target={v.demo_wrong_target} the habits' fractions sum to more than 1: "
                          "lower one of them.")
    if v.demo_stop_short > 0 and "reach" not in v.tasks:
        raise ConfigError(f"config key 'vla.demo_stop_short' has value {v.demo_stop_short}; the habit stops a reach "
                          f"short, and vla.tasks={v.tasks} has no reach: add reach or set vla.demo_stop_short=0.")
    if v.filter_low > v.filter_high:
        raise ConfigError(f"config key 'vla.filter_low' has value {v.filter_low}; it must be <= vla.filter_high "
                          f"({v.filter_high}).")
    if v.overlap and v.num_workers == 1:
        raise ConfigError("config key 'vla.num_workers' has value 1; the two-stage overlap (vla.overlap=true) steps "
                          "its stages in separate workers: set vla.num_workers >= 2, 0 (in-process, no overlap) or "
                          "vla.overlap=false.")
    if v.overlap and v.num_workers >= 2 and v.num_envs < 2:
        raise ConfigError(f"config key 'vla.num_envs' has value {v.num_envs}; two overlapped stages need >= 2 envs.")
    if cfg.actor_rollout_ref.rollout.temperature <= 0:
        raise ConfigError(f"config key 'actor_rollout_ref.rollout.temperature' has value "
                          f"{cfg.actor_rollout_ref.rollout.temperature}; RL needs sampled episodes: set it > 0.")


def _check_estimator_keys(cfg, given, est: str) -> None:
    """The keys of the estimator not chosen are refused; gae needs the critic and takes no group filter."""
    from rlhf_mcore.config.checks import value_at

    for key in sorted(given):
        if est == "grpo" and any(key == k or (k.endswith(".") and key.startswith(k)) for k in _GAE_ONLY):
            raise ConfigError(f"config key '{key}' has value {value_at(cfg, key)!r}, which only PPO with a value "
                              "head reads: set algorithm.adv_estimator=gae (with critic.enable=true) or remove it.")
        if est == "gae" and key in _GRPO_ONLY:
            raise ConfigError(f"config key '{key}' has value {value_at(cfg, key)!r}, which only grpo reads (gae "
                              "whitens the advantages over the batch): remove it or set algorithm.adv_estimator=grpo.")
    if est == "gae" and cfg.critic.enable is False:
        raise ConfigError("config key 'critic.enable' has value False; algorithm.adv_estimator=gae needs the critic's "
                          "values: set critic.enable=true or algorithm.adv_estimator=grpo.")
    if est == "gae" and cfg.vla.filter_groups:
        raise ConfigError("config key 'vla.filter_groups' has value True; DAPO's group filter keeps GRPO groups by "
                          "their success rate, and gae has no groups (each episode is its own): set "
                          "vla.filter_groups=false or algorithm.adv_estimator=grpo.")
