"""Config keys that were set but do nothing in the chosen setup, said in one notice instead of ignored silently.

A veRL command line carries keys by habit that a given setup never reads: `critic.*` under GRPO (no critic is
built), `algorithm.kl_ctrl.kl_coef` with `algorithm.use_kl_in_reward=false`, `actor_rollout_ref.ref.*` when no KL
term needs a reference policy. Refusing them would break the one-to-one translation of veRL command lines, so
:func:`report_unused_keys` (called by `load_config`) prints one line on rank 0 naming them and why they are
unused. A path among them that does not exist is named as such in the same line: it is never opened (the section
is not built), so it cannot fail the run, but a typo in it must not pass unseen either -- it would fail the day the
section is switched on.

"Set" means given in the YAML file or on the command line (a key left at its schema default is not reported).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Iterable

from rlhf_mcore.config.checks import value_at
from rlhf_mcore.config.cross import critic_enabled, estimator_needs, lora_enabled, reference_enabled
from rlhf_mcore.config.errors import ConfigError

# (section or key prefix, keys under it that stay meaningful, "is it unused?", why). Conditions are evaluated only
# when a set key falls under their prefix: critic_enabled imports the estimator registry (torch).
_Rule = tuple[str, tuple[str, ...], Callable, Callable]


def _critic_off(cfg) -> bool:
    try:
        return not critic_enabled(cfg)
    except ConfigError:  # an estimator from trainer.plugins, registered later: validate_config decides
        return False


def _reference_off(cfg) -> bool:
    return not reference_enabled(cfg)


def _old_pass_kept(cfg) -> str:
    """Why the old-log-prob pass always takes every row in this setup (rlhf_mcore.trainer.learner.Learner.
    old_from_update) whatever `actor.old_log_prob_from_update` says; "" when the key decides (a MoE actor, known
    only once its model is read, keeps the pass too)."""
    actor, alg = cfg.actor_rollout_ref.actor, cfg.algorithm
    rc = alg.rollout_correction
    if actor.use_rollout_log_probs:
        return "actor_rollout_ref.actor.use_rollout_log_probs=true: there is no old-log-prob pass"
    if alg.use_kl_in_reward:
        return "algorithm.use_kl_in_reward=true: the advantages read the old log-probs, the pass always runs"
    if rc.rollout_is is not None or rc.rollout_rs is not None or rc.rollout_token_veto_threshold is not None:
        return "algorithm.rollout_correction is on: it reads the old log-probs, the pass always runs"
    return ""


def _values_pass_kept(cfg) -> str:
    """Why the values pass always takes every row (rlhf_mcore.trainer.learner.Learner.values_from_update) whatever
    `critic.values_from_update` says; "" when the key decides (or no critic is built: the `critic.` rule says so)."""
    try:
        needs = estimator_needs(cfg)
    except ConfigError:  # an estimator from trainer.plugins, registered later: the learner decides
        return ""
    if not needs.needs_critic and cfg.critic.enable is not True:
        return ""
    if not needs.lam1_returns_free_of_values:
        return (f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} does not declare its returns free of the "
                "values (lam1_returns_free_of_values): the values pass always runs")
    if cfg.algorithm.lam != 1:
        return (f"algorithm.lam={cfg.algorithm.lam} < 1: GAE's returns read the values, the values pass always "
                "runs")
    return ""  # PRIME needs rloo: its estimator is named above


_FP8_SECTIONS = ("actor_rollout_ref.actor.megatron", "critic.megatron", "actor_rollout_ref.ref.megatron",
                 "reward.reward_model.megatron")
_RULES: tuple[_Rule, ...] = (
    ("critic.", ("critic.enable",), _critic_off,
     lambda c: ("critic.enable=false" if c.critic.enable is False else
                f"algorithm.adv_estimator={c.algorithm.adv_estimator}") + " builds no critic"),
    ("algorithm.kl_ctrl.", (), lambda c: not c.algorithm.use_kl_in_reward,
     lambda c: "algorithm.use_kl_in_reward=false: no KL penalty in the reward"),
    ("algorithm.kl_penalty", (), lambda c: not c.algorithm.use_kl_in_reward,
     lambda c: "algorithm.use_kl_in_reward=false: no KL penalty in the reward"),
    ("actor_rollout_ref.actor.kl_loss_", (), lambda c: not c.actor_rollout_ref.actor.use_kl_loss,
     lambda c: "actor_rollout_ref.actor.use_kl_loss=false: no KL loss"),
    ("actor_rollout_ref.ref.", (), _reference_off,
     lambda c: "no KL term or PRIME needs a reference policy, so none is built"),
    ("reward.reward_model.", ("reward.reward_model.enable", "reward.reward_model.reward_manager",
                              "reward.reward_model.overlong_buffer."),
     lambda c: not c.reward.reward_model.enable, lambda c: "reward.reward_model.enable=false: no reward model"),
    ("reward.reward_model.overlong_buffer.", ("reward.reward_model.overlong_buffer.enable",),
     lambda c: not c.reward.reward_model.overlong_buffer.enable,
     lambda c: "reward.reward_model.overlong_buffer.enable=false: no overlong shaping"),
    ("reward.judge.", ("reward.judge.enable",), lambda c: not c.reward.judge.enable,
     lambda c: "reward.judge.enable=false: no judge"),
    ("algorithm.filter_groups.", ("algorithm.filter_groups.enable",), lambda c: not c.algorithm.filter_groups.enable,
     lambda c: "algorithm.filter_groups.enable=false: no dynamic sampling"),
    ("actor_rollout_ref.rollout.multi_turn.", ("actor_rollout_ref.rollout.multi_turn.enable",),
     lambda c: not c.actor_rollout_ref.rollout.multi_turn.enable,
     lambda c: "actor_rollout_ref.rollout.multi_turn.enable=false: single-turn rollouts"),
    ("algorithm.reward_", (), lambda c: c.reward.reward_model.reward_manager != "prime",
     lambda c: "reward.reward_model.reward_manager is not prime"),
    ("actor_rollout_ref.ref.", (), lora_enabled,
     lambda c: "actor_rollout_ref.model.lora_rank > 0: the reference is the actor with its adapters off (the actor's "
               "settings), no reference model is built"),
    *((f"{m}.lora_alpha", (), lambda c, m=m: value_at(c, f"{m}.lora_rank") == 0,
       lambda c, m=m: f"{m}.lora_rank=0: no LoRA adapters") for m in ("actor_rollout_ref.model", "critic.model")),
    *((f"{m}.target_modules", (), lambda c, m=m: value_at(c, f"{m}.lora_rank") == 0,
       lambda c, m=m: f"{m}.lora_rank=0: no LoRA adapters") for m in ("actor_rollout_ref.model", "critic.model")),
    *((f"{m}.fp8_recipe", (), lambda c, m=m: value_at(c, f"{m}.fp8") is None,
       lambda c, m=m: f"{m}.fp8=null: no FP8 GEMMs") for m in _FP8_SECTIONS),
    *((f"{m}.fp8_weight_cache", (), lambda c, m=m: value_at(c, f"{m}.fp8") is None,
       lambda c, m=m: f"{m}.fp8=null: no FP8 GEMMs") for m in _FP8_SECTIONS),
    *((f"{m}.fp8_amax_history_len", (), lambda c, m=m: value_at(c, f"{m}.fp8") is None,
       lambda c, m=m: f"{m}.fp8=null: no FP8 GEMMs") for m in _FP8_SECTIONS),
    ("actor_rollout_ref.actor.old_log_prob_from_update", (), _old_pass_kept, _old_pass_kept),
    ("critic.values_from_update", (), _values_pass_kept, _values_pass_kept),
    ("actor_rollout_ref.rollout.lora_sync", (), lambda c: not lora_enabled(c),
     lambda c: "actor_rollout_ref.model.lora_rank=0: the actor has no adapters"),
)
# Keys holding a file or directory path: one that does not exist is named in the notice.
_PATH_KEYS = ("critic.model.path", "reward.reward_model.model.path", "reward.reward_model.model.input_tokenizer",
              "reward.judge.model_path", "actor_rollout_ref.rollout.multi_turn.tool_config_path")


def given_keys(tree: dict | None, overrides: Iterable[str] = ()) -> set[str]:
    """The dotted leaf keys of a (veRL-unaliased) YAML mapping, plus the keys of normalised `key=value` overrides."""
    out: set[str] = set()

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        elif prefix:
            out.add(prefix[:-1])

    walk(tree or {}, "")
    out.update(ov.split("=", 1)[0] for ov in overrides)
    return out


def unused_keys(cfg, given: Iterable[str]) -> list[tuple[str, str]]:
    """(key, why it is unused) for each key in `given` that the setup `cfg` never reads, in key order."""
    found: dict[str, str] = {}
    decided: dict[int, bool] = {}
    for key in sorted(set(given)):
        for i, (prefix, kept, is_unused, why) in enumerate(_RULES):
            if not key.startswith(prefix) or any(key == k or (k.endswith(".") and key.startswith(k)) for k in kept):
                continue
            if i not in decided:
                decided[i] = bool(is_unused(cfg))
            if decided[i]:
                reason = why(cfg)
                if key in _PATH_KEYS:
                    value = value_at(cfg, key)
                    if value and not Path(value).exists():
                        reason += f"; and {key}={value!r} does not exist"
                found[key] = reason
                break
    return sorted(found.items())


def report_unused_keys(cfg, given: Iterable[str]) -> list[tuple[str, str]]:
    """Print the unused keys in one notice line on stderr (rank 0 only; nothing when there are none); returns
    them. Grouped by reason: `notice: unused in this setup (accepted as veRL sets them, but nothing reads them):
    critic.optim.lr, critic.model.path (algorithm.adv_estimator=grpo builds no critic); ...`."""
    unused = unused_keys(cfg, given)
    if unused and int(os.environ.get("RANK", "0")) == 0:
        by_reason: dict[str, list[str]] = {}
        for key, reason in unused:
            by_reason.setdefault(reason, []).append(key)
        parts = "; ".join(f"{', '.join(keys)} ({reason})" for reason, keys in by_reason.items())
        print(f"notice: config keys unused in this setup (accepted, as veRL command lines set them, but nothing "
              f"reads them; remove them to silence this): {parts}.", file=sys.stderr, flush=True)
    return unused
