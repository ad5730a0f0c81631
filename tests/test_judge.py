"""Generative reward models (rlhf_mcore.rewards.judge): parsers, the template, counting unreadable verdicts, and a
real native-engine judge (a tiny random model, whose verdicts are garbage: every one scores 0 and is counted)."""
from types import SimpleNamespace

import pytest

from rlhf_mcore.data.rows import Row
from rlhf_mcore.rewards.judge import (
    JudgeScorer,
    check_template,
    get_judge_parser,
    register_judge_parser,
    render_judge_prompt,
)


@pytest.mark.parametrize("parser, text, want", [
    ("score_tag", "The answer is right. <score>1</score>", 1.0),
    ("score_tag", "<score>0</score> wait, <score> 0.75 </score>", 0.75),
    ("score_tag", "score: 1", None),
    ("rating", "Reasoning...\nRating: 7", 7.0),
    ("rating", "SCORE = -2.5", -2.5),
    ("rating", "no number here", None),
    ("yes_no", "Yes, it is correct.", 1.0),
    ("yes_no", "no.", 0.0),
    ("yes_no", "Maybe", None),
    ("yes_no", "", None),
])
def test_parsers(parser, text, want):
    assert get_judge_parser(parser)(text) == want


def test_unknown_parser_names_the_key():
    with pytest.raises(ValueError, match="reward.judge.parser"):
        get_judge_parser("no_such_parser")


def test_template_fields():
    check_template("Q: {prompt} A: {response} ({ground_truth}) {{literal}}")
    with pytest.raises(ValueError, match=r"uses \['question'\]; the fields are"):
        check_template("{question} {response}")
    with pytest.raises(ValueError, match="has no {response}"):
        check_template("{prompt}")
    with pytest.raises(ValueError, match="not a valid format string"):
        check_template("{response")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2?"}]
    assert render_judge_prompt("{prompt}|{response}|{ground_truth}", messages, "#### 2", 2) == "What is 2?|#### 2|2"


class FakeTokenizer:
    """Characters as token ids: enough for the scorer's encode/decode round trip."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return [ord(c) for c in messages[-1]["content"]]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeEngine:
    def __init__(self, verdicts):
        self.verdicts, self.awake, self.calls = verdicts, True, 0

    def sleep(self, level=1):
        self.awake = False

    def wake(self):
        self.awake = True

    def generate(self, prompts, params):
        assert self.awake
        self.calls += 1
        return [SimpleNamespace(samples=[SimpleNamespace(token_ids=[ord(c) for c in v])])
                for v in self.verdicts[:len(prompts)]]


def judge_cfg(**kw):
    base = dict(prompt_template="{prompt} -> {response}", parser="score_tag", temperature=0.0, max_new_tokens=8,
                data_sources=[], reward_weight=1.0, rule_weight=0.0)
    return SimpleNamespace(**{**base, **kw})


@register_judge_parser("test_raises")
def _raises(text):
    raise RuntimeError("a buggy parser")


def test_unreadable_verdicts_score_zero_and_are_counted():
    tok = FakeTokenizer()
    engine = FakeEngine(["<score>1</score>", "I refuse", "<score>nan</score>", "<score>0.5</score>"])
    scorer = JudgeScorer(engine, tok, tok, judge_cfg(rule_weight=0.5, data_sources=["a"]))
    assert not engine.awake  # asleep until it scores
    rows = [Row(i, 0, [1], [ord(c) for c in "#### 1"], [], "stop", score=1.0) for i in range(5)]
    items = [{"data_source": "a", "raw_prompt": [{"role": "user", "content": f"q{i}"}], "ground_truth": "1"}
             for i in range(4)] + [{"data_source": "b", "raw_prompt": [], "ground_truth": "1"}]
    metrics = scorer.score_rows(rows, items)
    assert [r.score for r in rows] == [1.5, 0.5, 0.5, 1.0, 1.0]  # judge + 0.5 * rule; row 4 is not judged
    assert metrics["judge/num_unparseable"] == 2 and metrics["judge/num_scored"] == 4
    assert metrics["judge/unparseable_fraction"] == 0.5 and not engine.awake and engine.calls == 1
    assert [r.reward_extra["acc"] for r in rows] == [1.0] * 5
    buggy = JudgeScorer(FakeEngine(["<score>1</score>"]), tok, tok, judge_cfg(parser="test_raises"))
    row = Row(0, 0, [1], [65], [], "stop", score=1.0)
    assert buggy.score_rows([row], items[:1])["judge/num_unparseable"] == 1 and row.score == 0.0


def test_native_judge_with_garbage_verdicts(tiny_model_dir):
    """A real second native engine: a random tiny model never writes <score>..</score>, so every row scores 0 and
    is counted as unparseable."""
    from transformers import AutoTokenizer

    from rlhf_mcore.config import load_config
    from rlhf_mcore.trainer.roles import build_judge

    model = tiny_model_dir("qwen2")
    cfg = load_config(None, [f"actor_rollout_ref.model.path={model}", "reward.judge.enable=true",
                             f"reward.judge.model_path={model}", "reward.judge.max_new_tokens=6",
                             "reward.judge.max_num_seqs=4", "reward.judge.max_model_len=512"])
    tok = AutoTokenizer.from_pretrained(model)
    judge = build_judge(cfg, SimpleNamespace(device="cpu"), tok)
    response = tok("#### 3", add_special_tokens=False)["input_ids"]
    rows = [Row(i, 0, [1], response, [], "stop", score=1.0) for i in range(3)]
    items = [{"data_source": "x", "raw_prompt": [{"role": "user", "content": "What is 3?"}], "ground_truth": "3"}] * 3
    metrics = judge.score_rows(rows, items)
    assert metrics["judge/num_unparseable"] == 3 and [r.score for r in rows] == [0.0] * 3
    assert [r.reward_extra["acc"] for r in rows] == [1.0] * 3


def test_missing_judge_model_is_a_clear_error(tmp_path):
    from rlhf_mcore.config import load_config
    from rlhf_mcore.rewards.reward_model import RewardModelError
    from rlhf_mcore.trainer.roles import build_judge

    cfg = load_config(None, ["actor_rollout_ref.model.path=/m", "reward.judge.enable=true",
                             f"reward.judge.model_path={tmp_path / 'none'}"])
    with pytest.raises(RewardModelError, match="reward.judge.model_path=.* is not a Hugging Face model directory"):
        build_judge(cfg, SimpleNamespace(device="cpu"), None)
