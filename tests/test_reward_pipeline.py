"""The reward pipeline (rlhf_mcore.rewards.pipeline) against a naive composition of its stages, written out per row:
rule score (an environment's reward in its place) -> learned score combined -> overlong penalty added."""
import random
from dataclasses import dataclass, field
from typing import Optional

import pytest

from rlhf_mcore.rewards.overlong import overlong_penalty
from rlhf_mcore.rewards.pipeline import OverlongShaping, compose, set_rule_scores

MAX_LEN, BUF, FACTOR = 10, 4, 1.5
RW, RULE_W = 2.0, 0.5  # reward_weight, rule_weight


@dataclass
class FakeRow:
    prompt_pos: int
    response_ids: list
    score: float = 0.0
    reward_extra: dict = field(default_factory=dict)
    agent: Optional[dict] = None
    baseline_ids: Optional[list] = None
    baseline_score: Optional[float] = None


class FakeLearned:
    """A learned scorer as RewardModelScorer.score_rows behaves: covered rows (data_source "rm") get
    RW * model + RULE_W * rule, the rule score read from reward_extra["acc"]; the model's score is a function of the
    response."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def model_score(r) -> float:
        return 0.1 * sum(r.response_ids) - 1.0

    def score_rows(self, rows, items, local=False):
        self.calls.append(local)
        for r in rows:
            r.reward_extra.setdefault("acc", r.score)
            if items[r.prompt_pos]["data_source"] == "rm":
                r.score = RW * self.model_score(r) + RULE_W * r.reward_extra["acc"]
        return {"reward_model/num_scored": float(sum(it["data_source"] == "rm" for it in items))}


def naive(rule: float, env: Optional[float], covered: bool, model: float, length: int, shaping: bool) -> float:
    score = rule if env is None else env  # 1. an environment's reward stands in for the rule score
    if covered:
        score = RW * model + RULE_W * score  # 2. the learned score combined
    if shaping:
        score += min(-(length - (MAX_LEN - BUF)) / BUF * FACTOR, 0.0)  # 3. DAPO's overlong penalty
    return score


def case(seed: int):
    rng = random.Random(seed)
    items = [{"data_source": rng.choice(["rm", "rule"])} for _ in range(6)]
    rows, rules, envs = [], [], []
    for k in range(24):
        env = rng.choice([None, None, rng.uniform(-1, 1)])
        rows.append(FakeRow(k % 6, [rng.randrange(5) for _ in range(rng.randrange(1, MAX_LEN + 1))],
                            agent=None if env is None and rng.random() < 0.5 else {"reward": env}))
        rules.append(rng.choice([0.0, 1.0]))
        envs.append(env)
    return items, rows, rules, envs


@pytest.mark.parametrize("enable", [True, False])
def test_compose_matches_the_naive_composition(enable):
    """Mutations: drop the overlong term from compose (`r.score += p`) -> fails; apply the environment's reward after
    the learned score or after the shaping (the row's final score replaced) -> fails; combine the learned score with
    the shaped score (shaping before the learned stage) -> fails."""
    shaping = OverlongShaping(enable=enable, max_response_length=MAX_LEN, buffer_len=BUF, penalty_factor=FACTOR)
    items, rows, rules, envs = case(0)
    set_rule_scores(rows, rules)
    learned = FakeLearned()
    metrics = compose(rows, items, shaping, learned=learned)
    want = [naive(rule, env, items[r.prompt_pos]["data_source"] == "rm", FakeLearned.model_score(r),
                  len(r.response_ids), enable) for r, rule, env in zip(rows, rules, envs)]
    assert [r.score for r in rows] == pytest.approx(want)
    assert any(e is not None for e in envs) and any(it["data_source"] == "rm" for it in items)
    assert metrics == {"reward_model/num_scored": float(sum(it["data_source"] == "rm" for it in items))}
    assert [r.reward_extra["acc"] for r in rows] == [rule if env is None else env for rule, env in zip(rules, envs)]
    lengths = [len(r.response_ids) for r in rows]
    assert [r.reward_extra["overlong_penalty"] for r in rows] == (
        overlong_penalty(lengths, MAX_LEN, BUF, FACTOR) if enable else [0.0] * len(rows))
    if enable:
        assert any(r.reward_extra["overlong_penalty"] < 0 for r in rows)


def test_composing_again_with_the_learned_score_equals_composing_once():
    """The asynchronous trainers' path: the rollout pool composes without a learned score, the training pool again
    with its reward model (local=True); the scores are those of one composition with the reward model.
    Mutation: compose adding the penalty to the incoming score instead of rebuilding from `acc` (the penalty
    twice, the old subtract-and-add-back) -> fails."""
    shaping = OverlongShaping(enable=True, max_response_length=MAX_LEN, buffer_len=BUF, penalty_factor=FACTOR)
    items, rows, rules, _ = case(1)
    set_rule_scores(rows, rules)
    compose(rows, items, shaping)  # the rollout pool
    twice = FakeLearned()
    compose(rows, items, shaping, learned=twice, local=True)  # the training pool
    assert twice.calls == [True]
    items2, once_rows, rules2, _ = case(1)
    set_rule_scores(once_rows, rules2)
    compose(once_rows, items2, shaping, learned=FakeLearned())
    assert [r.score for r in rows] == pytest.approx([r.score for r in once_rows])


def test_greedy_baselines_are_shaped_like_the_samples():
    """ReMax: each row's greedy baseline gets the overlong penalty of its own length, once (composing again keeps
    it). Mutation: drop the baseline's shaping (`baseline` ignored) -> fails."""
    shaping = OverlongShaping(enable=True, max_response_length=MAX_LEN, buffer_len=BUF, penalty_factor=FACTOR)
    rows = [FakeRow(0, [1] * 3, baseline_ids=[1] * 9, baseline_score=1.0),
            FakeRow(0, [1] * 10, baseline_ids=[1] * 2, baseline_score=0.0)]
    set_rule_scores(rows, [1.0, 1.0])
    for _ in range(2):
        compose(rows, None, shaping, baseline=True)
    assert [r.baseline_score for r in rows] == pytest.approx([1.0 - 3 / 4 * FACTOR, 0.0])
    assert [r.score for r in rows] == pytest.approx([1.0, 1.0 - FACTOR])


def test_shaping_reads_the_config_and_logs_only_when_asked():
    from types import SimpleNamespace

    ob = SimpleNamespace(enable=True, len=BUF, penalty_factor=FACTOR, log=False)
    cfg = SimpleNamespace(reward=SimpleNamespace(reward_model=SimpleNamespace(overlong_buffer=ob)),
                          data=SimpleNamespace(max_response_length=MAX_LEN))
    shaping = OverlongShaping.from_config(cfg)
    assert shaping == OverlongShaping(True, MAX_LEN, BUF, FACTOR, False)
    rows = [FakeRow(0, [1] * 10, reward_extra={"overlong_penalty": -FACTOR})]
    assert shaping.metrics(rows) == {}
    ob.log = True
    assert OverlongShaping.from_config(cfg).metrics(rows) == {"reward/overlong_penalty": -FACTOR,
                                                             "reward/overlong_fraction": 1.0}
