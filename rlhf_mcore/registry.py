"""Name -> function registries (advantage estimators, policy losses, loss aggregation modes, KL estimators,
rewards by data_source, log-prob backends).

One small mechanism behind each extension point: registering a taken name fails unless `override=True`, and an
unknown name fails with the known names and how to add one.
"""
from __future__ import annotations

from typing import Generic, TypeVar

F = TypeVar("F")  # a function, or a record of facts around one


class Registry(Generic[F]):
    def __init__(self, what: str, unknown_hint: str):
        self.what = what  # e.g. "policy loss"; used in messages
        self.unknown_hint = unknown_hint  # appended to the unknown-name error: how to register one
        self._table: dict[str, F] = {}

    def add(self, name: str, fn: F, *, override: bool = False) -> F:
        old = self._table.get(name)
        if not override and old is not None and old != fn:  # functions compare by identity, records by fields
            where = getattr(old, "fn", old)  # a record of facts around a function names the function
            raise ValueError(f"{self.what} {name!r} is already registered ({where.__module__}.{where.__qualname__}); "
                             "pick another name or pass override=True")
        self._table[name] = fn
        return fn

    def get(self, name: str, *, key: str) -> F:
        """`key` is the config key the name came from, for the error message."""
        if name not in self._table:
            raise ValueError(f"unknown {key}={name!r}; known: {sorted(self._table)}. {self.unknown_hint}")
        return self._table[name]

    def snapshot(self) -> dict[str, F]:
        """A copy of the table as it is now."""
        return dict(self._table)

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: str) -> bool:
        return name in self._table
