"""Discriminative reward models (rlhf_mcore.rewards.reward_model, rlhf_mcore.engine.reward_engine).

- Scores from the Megatron engine equal transformers' `AutoModelForSequenceClassification` logits (1e-4) for tiny
  Qwen2, Llama and Qwen3 reward models at TP=1 (DP=2), TP=2 and PP=2, packed and padded; one Bradley-Terry update
  gives the same loss (equal to the loss computed from transformers' scores) and the same new scores at every
  layout, and lowers the loss on the same pairs (recomputed from those scores). One torchrun launch of
  tests/scripts/reward_model_cases.py on 2 CPU processes.
- Re-templating for a reward model with another chat template gives the token ids a user builds by hand.
- How the reward-model score and the rule score combine, per data_source and by weights.
- Bad inputs: a reward-model path that does not exist, a causal LM given as reward model, a tokenizer mismatch, a
  preference file missing a column: each a clear error naming the key or file.
"""
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from launcher import CPU, QUIET, run

from rlhf_mcore.rewards.reward_model import RewardModelError, check_reward_model_dir, combine, rm_token_ids

pytestmark = pytest.mark.cost(20)

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "reward_model_cases.py"
ARCHS = ("qwen2", "llama", "qwen3")
LAYOUTS = ("1x1", "2x1", "1x2")  # TPxPP on 2 processes (1x1: DP=2)
TEXTS = [("What is 3?", "#### 3"), ("Mia has 47 apples. How many apples does Mia have now?", "#### 47."),
         ("What is 12 + 30?", "12 + 30 = 42\n#### 42"), ("Hi", "ok"), ("What is 7?", "#### 8"),
         ("Tom has 5 pens. Then he gets 2 more. How many pens does Tom have now?", "5 + 2 = 7\n#### 7"),
         ("What is 99?", "#### 99")]


def make_reward_model(causal_dir: Path, out: Path, seed: int = 0) -> Path:
    """A `*ForSequenceClassification` (one label) from a tiny causal LM, its score head from transformers' init."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(causal_dir, num_labels=1, dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(causal_dir).save_pretrained(out)
    return out


def chat_ids(tok, prompt: str, response: str) -> list[int]:
    p = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    p = list(p["input_ids"] if hasattr(p, "keys") else p)
    return p + tok(response, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]


def hf_scores(model_dir: Path, sequences: list[list[int]]) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    with torch.no_grad():  # one sequence at a time: no padding, the score is the last position's
        return [float(model(torch.tensor([s])).logits[0, 0]) for s in sequences]


@pytest.fixture(scope="module")
def reward_models(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    return {arch: make_reward_model(tiny_model_dir(arch), root / arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def parity(reward_models, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reward_models["qwen2"])  # the three share the tiny tokenizer
    seqs = [chat_ids(tok, p, r) for p, r in TEXTS]
    pairs = [[seqs[0], seqs[1]], [seqs[2], seqs[4]], [seqs[5], seqs[3]], [seqs[6], seqs[1]]]
    tmp = tmp_path_factory.mktemp("rm_parity")
    spec = {"models": {a: str(d) for a, d in reward_models.items()}, "sequences": seqs, "pairs": pairs,
            "layouts": list(LAYOUTS)}
    (tmp / "spec.json").write_text(json.dumps(spec))
    # fp32 on the CPU, what the 1e-4 against transformers is calibrated for
    run(WORKER, "--spec", str(tmp / "spec.json"), "--out", str(tmp / "out.json"), nproc=2, env_extra={**CPU, **QUIET})
    want = {a: hf_scores(d, seqs) for a, d in reward_models.items()}
    return json.loads((tmp / "out.json").read_text()), want, seqs, pairs


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scores_match_transformers(parity, arch, layout):
    got, want, _, _ = parity
    r = got[f"{arch}@{layout}"]
    assert len(set(want[arch])) == len(want[arch])  # distinct scores: a wrong position would show
    for key in ("packed", "padded"):
        assert r[key] == pytest.approx(want[arch], abs=1e-4), key


def naive_bt_loss(scores: list[float], index: dict, pairs) -> float:
    """Mean over pairs of -log sigmoid(r_chosen - r_rejected), one pair at a time."""
    total = 0.0
    for c, r in pairs:
        margin = scores[index[tuple(c)]] - scores[index[tuple(r)]]
        total += -math.log(1 / (1 + math.exp(-margin)))
    return total / len(pairs)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_bradley_terry_update_is_layout_independent(parity, arch):
    """The engine's Bradley-Terry loss equals -log sigmoid(r_chosen - r_rejected) on transformers' scores, and one
    update lowers it on the same pairs (recomputed from the scores after it); every layout agrees.

    Mutation: `bradley_terry_loss` returning `-loss * ctx.scale` for the backward (gradient ascent, the logged
    loss kept) -> fails: the scores still move, but the loss rises."""
    got, want, seqs, pairs = parity
    index = {tuple(s): i for i, s in enumerate(seqs)}
    margins = torch.tensor([want[arch][index[tuple(c)]] - want[arch][index[tuple(r)]] for c, r in pairs])
    naive = naive_bt_loss(want[arch], index, pairs)
    ref = got[f"{arch}@1x1"]
    assert ref["bt_loss"] == pytest.approx(naive, abs=1e-5)
    assert ref["accuracy"] == pytest.approx(float((margins > 0).float().mean()))
    after = naive_bt_loss(ref["after"], index, pairs)  # the same pairs, scored by the updated model
    assert after < naive - 1e-3, (naive, after)
    for layout in LAYOUTS[1:]:
        other = got[f"{arch}@{layout}"]
        assert other["bt_loss"] == pytest.approx(ref["bt_loss"], abs=1e-5)
        assert other["after"] == pytest.approx(ref["after"], abs=1e-4), layout


# ----------------------------------------------------------------------------------------------- single process


def test_retemplating_gives_the_hand_built_conversation(tiny_model_dir, tmp_path):
    """A reward model whose chat template differs from the policy's reads the conversation in its own template."""
    from transformers import AutoTokenizer

    policy = AutoTokenizer.from_pretrained(tiny_model_dir("qwen2"))
    rm_dir = tmp_path / "rm_tok"
    other = AutoTokenizer.from_pretrained(tiny_model_dir("qwen2"))
    other.chat_template = "{% for m in messages %}{{ '### ' + m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    other.save_pretrained(rm_dir)
    rm_tok = AutoTokenizer.from_pretrained(rm_dir)
    messages = [{"role": "user", "content": "What is 3 + 5?"}]
    prompt_ids = policy.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    response_ids = policy("3 + 5 = 8\n#### 8", add_special_tokens=False)["input_ids"] + [
        policy.convert_tokens_to_ids("<|im_end|>")]
    got = rm_token_ids(prompt_ids, response_ids, messages, input_tokenizer=policy, rm_tokenizer=rm_tok)
    by_hand = rm_tok("### user: What is 3 + 5?\n### assistant: 3 + 5 = 8\n#### 8\n", add_special_tokens=False)
    assert got == by_hand["input_ids"]
    assert rm_tok.decode(got) == "### user: What is 3 + 5?\n### assistant: 3 + 5 = 8\n#### 8\n"
    # without an input tokenizer the policy's ids go through unchanged
    assert rm_token_ids(prompt_ids, response_ids, messages) == prompt_ids + response_ids


def test_combine_rule():
    assert combine([1.0, 0.0, 1.0], [0.5, None, -2.0], reward_weight=1.0, rule_weight=0.0) == [0.5, 0.0, -2.0]
    assert combine([1.0, 0.0], [0.5, None], reward_weight=2.0, rule_weight=0.5) == [1.5, 0.0]


def test_scorer_combines_per_data_source():
    """Rows outside reward_model.data_sources keep their rule score; `acc` keeps the rule score for all."""
    from rlhf_mcore.data.rows import Row
    from rlhf_mcore.rewards.reward_model import RewardModelScorer

    class FakeScorer(RewardModelScorer):
        def __init__(self, cfg):
            self.cfg, self.input_tokenizer, self.rm_tokenizer = cfg, None, None

        def score_ids(self, sequences):
            return [float(len(s)) for s in sequences]

    cfg = SimpleNamespace(data_sources=["a"], reward_weight=0.5, rule_weight=1.0, max_length=4)
    rows = [Row(0, 0, [1, 2], [3, 4, 5], [], "stop", score=1.0), Row(1, 0, [1], [2], [], "stop", score=1.0)]
    items = [{"data_source": "a"}, {"data_source": "b"}]
    metrics = FakeScorer(cfg).score_rows(rows, items)
    assert rows[0].score == 0.5 * 4 + 1.0  # cut to max_length=4 tokens, then combined
    assert rows[1].score == 1.0 and "rm_score" not in rows[1].reward_extra
    assert [r.reward_extra["acc"] for r in rows] == [1.0, 1.0]
    assert metrics["reward_model/num_scored"] == 1 and metrics["reward_model/num_truncated"] == 1


@pytest.mark.parametrize("local", [False, True])
def test_rule_score_is_logged_beside_the_model_score(local, monkeypatch):
    """A reward-model step logs the rule score's mean over the rows the model scored (`reward_model/rule_score_mean`)
    beside the model's (`score_mean`), so reward hacking shows while training. `local=False` is the synchronous
    trainer's call, `local=True` the asynchronous trainers' (one_step_off and fully_async), gathered over replicas.
    Rows the model does not cover, and rows scored while they streamed (rm_score already set), count as in
    `score_mean`. Mutation: log `score_mean`'s value as `rule_score_mean` -> fails; mutation: drop the key -> fails."""
    from rlhf_mcore.data.rows import Row
    from rlhf_mcore.rewards.reward_model import RewardModelScorer

    class FakeScorer(RewardModelScorer):  # the model's score of a sequence: its length
        def __init__(self, cfg):
            self.cfg, self.input_tokenizer, self.rm_tokenizer = cfg, None, SimpleNamespace(pad_token_id=0)
            self.engine, self.state, self.offload = None, None, False

        def score_ids(self, sequences):
            return [float(len(s)) for s in sequences]

    cfg = SimpleNamespace(data_sources=["a"], reward_weight=2.0, rule_weight=0.0, max_length=None)
    rows = [Row(0, 0, [1], [2, 3], [], "stop", score=1.0), Row(0, 1, [1], [2], [], "stop", score=0.0),
            Row(1, 0, [1], [2, 3, 4], [], "stop", score=1.0), Row(2, 0, [1], [2], [], "stop", score=0.5)]
    rows[2].reward_extra["rm_score"] = 7.0  # scored while it streamed
    items = [{"data_source": "a"}, {"data_source": "a"}, {"data_source": "b"}]
    monkeypatch.setattr("rlhf_mcore.rewards.reward_model.forward_scores",  # local=True: this replica's engine
                        lambda engine, seqs, pad, offload: [float(len(s)) for s in seqs])
    metrics = FakeScorer(cfg).score_rows(rows, items, local=local)
    assert [r.reward_extra["acc"] for r in rows] == [1.0, 0.0, 1.0, 0.5]  # the rule scores, kept
    assert [r.score for r in rows] == [6.0, 4.0, 14.0, 0.5]  # 2 x the model's score; row 3 (source b): its rule
    assert metrics["reward_model/num_scored"] == 3
    assert metrics["reward_model/score_mean"] == pytest.approx((3 + 2 + 7) / 3)
    assert metrics["reward_model/rule_score_mean"] == pytest.approx((1.0 + 0.0 + 1.0) / 3)


def test_bad_reward_model_paths_are_clear_errors(tiny_model_dir, tmp_path):
    with pytest.raises(RewardModelError, match=r"reward_model.model.path='/no/such/rm' is not a Hugging Face model"):
        check_reward_model_dir("/no/such/rm")
    with pytest.raises(RewardModelError, match=r"is a Qwen2ForCausalLM, not a reward model.*train_rm"):
        check_reward_model_dir(str(tiny_model_dir("qwen2")))
    rm = tmp_path / "two_labels"
    shutil.copytree(tiny_model_dir("qwen2"), rm)
    cfg = json.loads((rm / "config.json").read_text())
    cfg.update(architectures=["Qwen2ForSequenceClassification"], num_labels=2)
    (rm / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RewardModelError, match="num_labels=2; a reward model has one label"):
        check_reward_model_dir(str(rm))
    cfg["num_labels"] = 1
    (rm / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RewardModelError, match="no `score.weight` tensor"):
        check_reward_model_dir(str(rm))


def test_reward_model_config_keys():
    from rlhf_mcore.config import ConfigError, load_config

    model = ["actor_rollout_ref.model.path=/m"]
    cfg = load_config(None, model + ["reward_model.enable=true", "reward_model.model.path=/rm",
                                     "reward_model.model.input_tokenizer=/m", "reward_model.micro_batch_size_per_gpu=4",
                                     "reward_model.max_length=256", "reward_model.data_sources=[a,b]"])
    rm = cfg.reward.reward_model
    assert (rm.enable, rm.model.path, rm.model.input_tokenizer, rm.micro_batch_size_per_gpu, rm.max_length,
            rm.data_sources) == (True, "/rm", "/m", 4, 256, ["a", "b"])
    with pytest.raises(ConfigError, match="reward_weight' has value 0.0"):
        load_config(None, model + ["reward_model.enable=true", "reward_model.model.path=/rm",
                                   "reward_model.reward_weight=0"])
    with pytest.raises(ConfigError, match="not remax with reward_model.enable=true"):
        load_config(None, model + ["reward_model.enable=true", "reward_model.model.path=/rm",
                                   "algorithm.adv_estimator=remax"])


def test_preference_file_missing_a_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_mcore.data import DataError
    from rlhf_mcore.data.preferences import read_preference_rows

    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "chosen": "a"}]), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p.parquet' lacks column\(s\) \['rejected'\].*prompt', 'chosen', 'rejected"):
        read_preference_rows(tmp_path / "p.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "chosen": "a", "rejected": 3}]), tmp_path / "q.parquet")
    with pytest.raises(DataError, match="row 0: 'rejected' must be a string or a list of chat messages"):
        read_preference_rows(tmp_path / "q.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}],
                                          "rejected": "b"}]), tmp_path / "ok.parquet")
    assert read_preference_rows(tmp_path / "ok.parquet") == [([{"role": "user", "content": "q"}], "a", "b")]


def test_tokenizer_mismatch_asks_for_input_tokenizer(tiny_model_dir, tmp_path):
    """A reward model with another vocabulary cannot read the policy's ids: the error names the key to set."""
    from transformers import AutoTokenizer

    from rlhf_mcore.config import load_config
    from rlhf_mcore.trainer.roles import build_rm_scorer

    policy = tiny_model_dir("qwen2")
    rm = make_reward_model(tiny_model_dir("qwen2", vocab=512), tmp_path / "rm_other_vocab")
    cfg = load_config(None, [f"actor_rollout_ref.model.path={policy}", "reward_model.enable=true",
                             f"reward_model.model.path={rm}"])
    with pytest.raises(RewardModelError, match=rf"set reward_model.model.input_tokenizer={policy} to re-template"):
        build_rm_scorer(cfg, None, AutoTokenizer.from_pretrained(policy))
