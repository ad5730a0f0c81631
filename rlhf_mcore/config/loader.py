"""Schema defaults <- YAML file <- ``key=value`` overrides, through OmegaConf: unknown keys refused with the
closest ones, veRL's top-level aliases moved under `reward`, a scalar standing for a one-element list, type errors
named by key; then the single-key rules (:mod:`.checks`), the rules between keys (:mod:`.cross`) and the notice for
keys the setup never reads (:mod:`.unused`)."""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import fields, is_dataclass
from functools import cache
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlhf_mcore.config.checks import check_sections, choice_error, choice_hint, field_rule, literal_choices, value_error
from rlhf_mcore.config.cross import check_relations
from rlhf_mcore.config.errors import ConfigError
from rlhf_mcore.config.schema import RLConfig
from rlhf_mcore.config.unused import given_keys, report_unused_keys
from rlhf_mcore.config.vla import check_vla_keys

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
                raise ConfigError(f"config key 'reward' must be a section when '{old}' is given too.")
            leaf = new.split(".")[1]
            if leaf in section:
                raise ConfigError(f"config sets both '{old}' and '{new}' (the same section): keep one.")
            section[leaf] = raw[old]
    return out


def _strip_optional(hint: Any) -> Any:
    if get_origin(hint) is not None and type(None) in get_args(hint):
        return next(a for a in get_args(hint) if a is not type(None))
    return hint


def _schema_node(path: list[str]) -> tuple[Any, Optional[type], str]:
    """(the type at a dotted path of the schema, its dataclass, the field name), or raise ConfigError with
    suggestions. The type is a dataclass (a section) or a leaf type, Optional removed."""
    node: Any = RLConfig
    parent, walked = None, []
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
        parent, node = node, _strip_optional(hints[key])
    return node, parent, (path[-1] if path else "")


@cache
def _all_keys(node: type = RLConfig, prefix: str = "") -> tuple[str, ...]:
    keys: list[str] = []
    for f in fields(node):
        hint = get_type_hints(node)[f.name]
        if isinstance(hint, type) and is_dataclass(hint):
            keys += _all_keys(hint, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return tuple(keys)


def _is_section(node: Any) -> bool:
    return isinstance(node, type) and is_dataclass(node)


def _check_keys(tree: Any, path: list[str]) -> None:
    """Walk a user-supplied mapping and fail on the first key the schema does not have."""
    node = _schema_node(path)[0] if path else RLConfig
    if isinstance(tree, dict) and _is_section(node):
        for key, value in tree.items():
            _check_keys(value, path + [str(key)])


def _coerce_overrides(overrides: list[str]) -> list[str]:
    """Validate override keys and let a scalar stand for a one-element list (veRL's `trainer.logger=console`)."""
    out = []
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override '{ov}' is not of the form key=value (e.g. data.train_batch_size=256).")
        key, value = ov.split("=", 1)
        key = _unalias(key.lstrip("+"))
        node = _schema_node(key.split("."))[0]
        if _is_section(node):
            raise ConfigError(f"'{key}' is a section, not a value: set one of its keys, e.g. '{key}.<key>=...'.")
        if get_origin(node) is list and not value.strip().startswith("["):
            value = f"[{value}]" if value.strip() else "[]"
        out.append(f"{key}={value}")
    return out


def _wrap_scalar_lists(tree: Any, path: list[str]) -> Any:
    if not isinstance(tree, dict):
        return tree
    result = {}
    for key, value in tree.items():
        node = _schema_node(path + [str(key)])[0]
        if get_origin(node) is list and value is not None and not isinstance(value, (list, tuple)):
            value = [value]
        result[key] = _wrap_scalar_lists(value, path + [str(key)]) if isinstance(value, dict) else value
    return result


def _omegaconf_message(err: OmegaConfBaseException) -> ConfigError:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
    value = getattr(err, "value", None)
    try:
        expected, section, name = _schema_node(str(key).split("."))
    except ConfigError:
        expected, section, name = None, None, ""
    choices = literal_choices(expected)
    if choices is not None:  # a value outside a Literal: the same message as the walker's
        return choice_error(str(key), value, choices, choice_hint(section, name))
    rule = field_rule(section, name)
    if rule is not None and get_origin(expected) is Union:  # `trainer.trace=1`: what it must be, not "a valid Union"
        return value_error(str(key), value, rule.what)
    expected_name = getattr(expected, "__name__", "?" if expected is None else str(expected))
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    if "Value" in first or "cannot be converted" in first or "Invalid" in first or "type" in first.lower():
        return ConfigError(f"config key '{key}' has value {value!r}, which is not a valid {expected_name}. ({first})")
    return ConfigError(f"config key '{key}': {first}")


def load_config(config_path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RLConfig:
    """Schema defaults <- YAML file <- ``key=value`` overrides, type-checked; returns the dataclass tree.

    Cross-field checks that need the world size or the model live in :func:`~rlhf_mcore.config.validate_config`.
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
        raise _omegaconf_message(e) from None
    check_sections(cfg)
    given = given_keys(raw, coerced)
    check_vla_keys(cfg, given)  # a VLA run refuses the text trainer's keys; a text run any vla.* key
    if not cfg.vla.enable:
        check_relations(cfg)
        report_unused_keys(cfg, given)  # set, but nothing reads them here: one notice line
    return cfg


def to_yaml(cfg: RLConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RLConfig) -> dict:
    return dataclasses.asdict(cfg)
