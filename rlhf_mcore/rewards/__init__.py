"""Rule rewards by `data_source`, user reward functions by file path, and a batch scorer with a worker pool.

- :mod:`.registry` — `register_reward`, `get_reward_fn`, `default_compute_score` (veRL's dispatch);
- :mod:`.gsm8k` — GSM8K strict/flexible (also scores `synthetic/arithmetic`);
- :mod:`.math_reward` — last `\\boxed{}` + math-verify equivalence for the MATH sources;
- :mod:`.custom` — `load_custom_reward_fn(path, name)`;
- :mod:`.scorer` — `RewardScorer` / `score_batch`: worker processes or in-process (:mod:`.inline`), a per-item
  timeout in both, failed items score 0 and are counted, too many raise `RewardFunctionError`;
- :mod:`.overlong` — DAPO's overlong reward shaping (`reward_model.overlong_buffer`);
- :mod:`.outcome` — one call's result or failure; :mod:`.errors` — `RewardFileError`, `RewardFunctionError`.

Importing this package does not import torch or sympy (reward workers start fast).
"""
from rlhf_mcore.rewards.custom import CustomRewardFunction, load_custom_reward_fn
from rlhf_mcore.rewards.errors import RewardError, RewardFileError, RewardFunctionError
from rlhf_mcore.rewards.outcome import normalize_reward
from rlhf_mcore.rewards.registry import default_compute_score, get_reward_fn, list_reward_sources, register_reward
from rlhf_mcore.rewards.scorer import RewardScorer, failure_error, reward_metrics, score_batch

__all__ = [
    "CustomRewardFunction",
    "load_custom_reward_fn",
    "RewardError",
    "RewardFileError",
    "RewardFunctionError",
    "failure_error",
    "reward_metrics",
    "default_compute_score",
    "get_reward_fn",
    "list_reward_sources",
    "register_reward",
    "RewardScorer",
    "normalize_reward",
    "score_batch",
]
