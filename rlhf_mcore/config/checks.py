"""Single-key rules and the one walker that applies them, wherever their dataclass is nested.

A rule sits on the field it constrains: a ``Literal[...]`` type (the values the code knows), or
``checked(default, ok, what)`` (a predicate and what the value must be). :func:`check_sections` walks the whole
config tree, so a rule on :class:`~rlhf_mcore.config.shared.OptimConfig` holds under the actor, the critic and the
reward model alike, and is written once. Every failure reads the same way::

    config key '<dotted key>' has value <value>; it must be <what>.
    config key '<dotted key>' has value <value>; choose one of a, b, c. Did you mean 'a'?

Rules that relate several keys (or the world size, the model, the registries) are in :mod:`.cross`.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from functools import cache
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

from rlhf_mcore.config.errors import ConfigError

_RULE, _HINT = "rlhf_mcore.check", "rlhf_mcore.choice_hint"
_NO_DEFAULT: Any = dataclasses.MISSING


@dataclass(frozen=True)
class Rule:
    ok: Callable[[Any], bool]  # the value is acceptable
    what: str  # what it must be, after "it must be "


def checked(default: Any = _NO_DEFAULT, *, factory: Optional[Callable[[], Any]] = None, ok: Callable[[Any], bool],
            what: str) -> Any:
    """A dataclass field whose value must satisfy `ok`; refused as `...; it must be <what>.`"""
    kw = {"default_factory": factory} if factory is not None else {"default": default}
    return dataclasses.field(**kw, metadata={_RULE: Rule(ok, what)})


def choice(default: Any, *, hint: str) -> Any:
    """A ``Literal`` field whose refused value names another key (`hint`) instead of a close match."""
    return dataclasses.field(default=default, metadata={_HINT: hint})


# Predicates the rules are written with.
def at_least(lo: float) -> Callable[[Any], bool]:
    return lambda v: v >= lo


def above(lo: float) -> Callable[[Any], bool]:
    return lambda v: v > lo


def within(lo: float, hi: float) -> Callable[[Any], bool]:
    return lambda v: lo <= v <= hi


def unset_or(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or ok(v)


def finite(v: float) -> bool:
    return math.isfinite(v)


def value_error(key: str, value: Any, what: str) -> ConfigError:
    """The one shape of a refused value."""
    return ConfigError(f"config key '{key}' has value {value!r}; it must be {what}.")


def choice_error(key: str, value: Any, choices: tuple, hint: Optional[str] = None) -> ConfigError:
    """A value outside its ``Literal``: the choices, and a close match or `hint`."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    extra = f" {hint}." if hint else (f" Did you mean '{close[0]}'?" if close else "")
    return ConfigError(f"config key '{key}' has value {value!r}; choose one of {', '.join(map(str, choices))}.{extra}")


def literal_choices(hint: Any) -> Optional[tuple]:
    """The values of a ``Literal[...]`` (or ``Optional[Literal[...]]``) type, else None."""
    if get_origin(hint) is Union:
        args = [a for a in get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    return get_args(hint) if get_origin(hint) is Literal else None


def _optional(hint: Any) -> bool:
    return get_origin(hint) is Union and type(None) in get_args(hint)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def choice_hint(cls: type, name: str) -> Optional[str]:
    """The `hint` of :func:`choice` on field `name` of dataclass `cls`, if any."""
    return next((f.metadata.get(_HINT) for f in fields(cls) if f.name == name), None)


def field_rule(cls: Optional[type], name: str) -> Optional[Rule]:
    """The :func:`checked` rule on field `name` of dataclass `cls`, if any."""
    return next((f.metadata.get(_RULE) for f in fields(cls) if f.name == name), None) if cls is not None else None


def check_sections(node: Any, prefix: str = "") -> None:
    """Apply every field's rule in the tree under `node` (dataclass instances, nested to any depth); raise a
    :class:`ConfigError` on the first value a rule refuses, named by its full dotted key."""
    hints = _hints(type(node))
    for f in fields(node):
        key, value = prefix + f.name, getattr(node, f.name)
        if is_dataclass(value):
            check_sections(value, f"{key}.")
            continue
        hint = hints[f.name]
        choices = literal_choices(hint)
        if choices is not None and value not in choices and not (value is None and _optional(hint)):
            raise choice_error(key, value, choices, f.metadata.get(_HINT))
        rule = f.metadata.get(_RULE)
        if rule is not None and not rule.ok(value):
            raise value_error(key, value, rule.what)


def value_at(cfg: Any, dotted: str) -> Any:
    """The value at a dotted key of a config tree."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg
