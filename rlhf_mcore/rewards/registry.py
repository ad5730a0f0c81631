"""Rule rewards chosen by each row's `data_source`.

A reward function has veRL's custom-reward signature and returns a float, or a dict with a "score" key
(other keys are passed through as extra information)::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

Built in: `openai/gsm8k` and `synthetic/arithmetic` (GSM8K strict), the MATH sources (boxed answer +
math-verify). Add a source with `@register_reward("my/source")`, or point
`reward.custom_reward_function.path`/`.name` at a file (see :mod:`rlhf_mcore.rewards.custom`), which then
scores every row. This module imports nothing heavy: reward worker processes import it at start-up.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlhf_mcore.registry import Registry
from rlhf_mcore.rewards import gsm8k, math_reward

__all__ = [
    "RewardFn",
    "register_reward",
    "get_reward_fn",
    "list_reward_sources",
    "default_compute_score",
    "RegistryDispatch",
]

RewardFn = Callable[..., Any]
_REWARD_FNS: Registry[RewardFn] = Registry(
    "reward for data_source", "Register one with @rlhf_mcore.rewards.register_reward(...) or set "
    "reward.custom_reward_function.path/.name")

GSM8K_SOURCES = ("openai/gsm8k", "synthetic/arithmetic")  # synthetic: rlhf_mcore.data.synthetic.DATA_SOURCE
MATH_SOURCES = ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500")


def register_reward(*data_sources: str, override: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: score rows whose `data_source` is one of `data_sources` with the decorated function."""
    if not data_sources:
        raise ValueError("register_reward needs at least one data_source name")

    def decorator(fn: RewardFn) -> RewardFn:
        for source in data_sources:
            _REWARD_FNS.add(source, fn, override=override)
        return fn

    return decorator


def get_reward_fn(data_source: str) -> RewardFn:
    """The reward function registered for `data_source`; a ValueError says how to add one otherwise."""
    return _REWARD_FNS.get(data_source, key="data_source")


def list_reward_sources() -> list[str]:
    """Every data_source with a registered reward."""
    return _REWARD_FNS.names()


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
    """Dispatch to the reward registered for `data_source` (veRL's `default_compute_score`)."""
    return get_reward_fn(data_source)(
        data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
    )


class RegistryDispatch:
    """A frozen copy of the registry that dispatches by `data_source`; pickles as its table of functions.

    Reward worker processes start fresh (spawn) and would only see the built-in rewards; sending them this
    snapshot carries registrations made in the trainer process too (as references to importable functions).
    """

    def __init__(self, table: dict[str, RewardFn] | None = None):
        self.table = _REWARD_FNS.snapshot() if table is None else dict(table)

    def unknown(self, data_sources) -> list[str]:
        """The data sources in `data_sources` that have no reward here."""
        return sorted(set(data_sources) - set(self.table))

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        if data_source not in self.table:
            raise ValueError(f"no reward function for data_source={data_source!r}; known: {sorted(self.table)}")
        return self.table[data_source](
            data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
        )


@register_reward(*GSM8K_SOURCES)
def _gsm8k_strict(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    return gsm8k.compute_score(solution_str, ground_truth)


@register_reward(*MATH_SOURCES)
def _math_verify(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    return math_reward.compute_score(solution_str, ground_truth)
