"""DAPO: overlong reward shaping (veRL's formula, hand-computed numbers), dynamic sampling's group filter and
refill loop against naive versions, the trainer's generate step with both on (a fake rollout engine and
scorer, no model), and the config checks of the new keys."""
import random
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest

from rlhf_mcore.algos.dynamic_sampling import DynamicSamplingError, GroupPool, informative_groups
from rlhf_mcore.config import ConfigError, load_config, validate_config
from rlhf_mcore.rewards.overlong import overlong_metrics, overlong_penalty

pytestmark = pytest.mark.cost(15)

MODEL = ["actor_rollout_ref.model.path=/models/m"]


# ------------------------------------------------------------------------------------------ overlong shaping


def test_overlong_penalty_hand_computed():
    # L_max = 20, buffer 4: expected length 16; the penalty falls 0.25 per token past it, to -1 at 20
    assert overlong_penalty([0, 10, 16, 17, 18, 20], 20, 4, 1.0) == [0.0, 0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty([17, 20], 20, 4, 0.5) == [-0.125, -0.5]
    # the DAPO recipe's numbers: 20480 = 16384 + a 4096 buffer; 2048 tokens into the buffer is half the penalty
    assert overlong_penalty([16384, 18432, 20480], 20480, 4096, 1.0) == [0.0, -0.5, -1.0]
    assert overlong_penalty([7, 8], 8, 8, 2.0) == [-1.75, -2.0]  # the buffer may be the whole response length
    with pytest.raises(ValueError, match="buffer len=0"):
        overlong_penalty([1], 20, 0, 1.0)


def test_overlong_penalty_matches_verl_formula_elementwise():
    rng = random.Random(0)
    for _ in range(200):
        l_max = rng.randint(1, 64)
        l_buf = rng.randint(1, l_max)
        factor = rng.choice([0.0, 0.5, 1.0, 2.0])
        lengths = [rng.randint(0, l_max) for _ in range(8)]
        expected_len = l_max - l_buf
        want = [min(-(n - expected_len) / l_buf * factor, 0) for n in lengths]  # veRL's reward manager
        assert overlong_penalty(lengths, l_max, l_buf, factor) == pytest.approx(want, abs=0)


def test_overlong_metrics():
    assert overlong_metrics([0.0, -0.5, 0.0, -1.0]) == {"reward/overlong_penalty": -0.375,
                                                        "reward/overlong_fraction": 0.5}
    assert overlong_metrics([]) == {}


# ------------------------------------------------------------------------------------------ dynamic sampling


def naive_keep(index, values):
    """A group is informative when its values are not all the same, or when it has one sample."""
    groups = {}
    for i, v in zip(index, values):
        groups.setdefault(i, []).append(v)
    return [len(groups[i]) == 1 or len(set(groups[i])) > 1 for i in index]


def test_informative_groups_matches_naive_and_numpy_std():
    rng = random.Random(1)
    for _ in range(300):
        n_groups, n = rng.randint(1, 6), rng.randint(1, 5)
        index = [g for g in range(n_groups) for _ in range(n)]
        rng.shuffle(index)  # samples of a group need not be adjacent
        values = [float(rng.randint(0, 1 if rng.random() < 0.7 else 3)) for _ in index]
        keep = informative_groups(index, values)
        assert keep == naive_keep(index, values)
        by = {}
        for i, v in zip(index, values):
            by.setdefault(i, []).append(v)
        assert keep == [np.std(by[i]) > 0 or len(by[i]) == 1 for i in index]  # veRL's test, on exact values


def test_informative_groups_equal_floats_are_not_informative():
    # np.std([0.1] * 3) is a rounding residue above 0; equal values are dropped all the same
    assert np.std([0.1, 0.1, 0.1]) > 0
    assert informative_groups([0, 0, 0, 1, 1, 1], [0.1, 0.1, 0.1, 0.1, 0.2, 0.1]) == [False] * 3 + [True] * 3
    assert informative_groups([5], [1.0]) == [True]
    with pytest.raises(ValueError, match="index has 2 entries but values 1"):
        informative_groups([0, 0], [1.0])


def naive_refill(batches, target, max_num_gen_batches):
    """veRL's loop: add each generation batch's informative groups; stop when `target` are collected (keep the
    first `target`), or fail when the limit is reached first."""
    kept, used = [], 0
    for groups, keep in batches:
        used += 1
        kept += [g for g, k in zip(groups, keep) if k]
        if len(kept) >= target:
            return kept[:target], used
        if 0 < max_num_gen_batches <= used:
            return None, used
    raise AssertionError("the test ran out of batches")


def test_group_pool_refill_loop_matches_naive():
    rng = random.Random(2)
    for trial in range(300):
        target, gen, n = rng.randint(1, 6), rng.randint(1, 8), rng.randint(2, 4)
        max_batches = rng.choice([0, -1, 1, 2, 3, 5])
        p_informative = rng.choice([0.0, 0.2, 0.5, 1.0]) if max_batches > 0 else rng.choice([0.3, 0.7, 1.0])
        batches, next_id = [], 0
        for _ in range(200):
            groups = list(range(next_id, next_id + gen))
            next_id += gen
            batches.append((groups, [rng.random() < p_informative for _ in groups]))
        want, want_used = naive_refill(batches, target, max_batches)

        pool = GroupPool(target=target, max_num_gen_batches=max_batches)
        for groups, keep in batches:
            # sample values of the n responses: all equal for a dropped group, two values for a kept one
            sample_group = [k for k in range(len(groups)) for _ in range(n)]
            values = [float(j == 0) if keep[k] else 1.0 for k in range(len(groups)) for j in range(n)]
            order = list(range(len(values)))
            rng.shuffle(order)
            pool.add(groups, [sample_group[i] for i in order], [values[i] for i in order])
            if not pool.wants_more():
                break
        assert pool.num_gen_batches == want_used, trial
        assert pool.drawn == want_used * gen
        if want is None:
            with pytest.raises(DynamicSamplingError, match=r"fewer than data.train_batch_size=\d+.*Raise "
                                                           r"max_num_gen_batches \(0: no limit\)"):
                pool.take()
        else:
            assert pool.take() == want, trial
        m = pool.metrics()
        assert m["dynamic_sampling/num_gen_batches"] == want_used
        assert m["dynamic_sampling/informative_groups"] == len(pool.groups)


def test_group_pool_stop_condition():
    pool = GroupPool(target=2, max_num_gen_batches=2)
    pool.add(["a", "b"], [0, 0, 1, 1], [1.0, 1.0, 0.0, 0.0])  # nothing informative
    assert pool.wants_more() and not pool.full
    pool.add(["c", "d"], [0, 0, 1, 1], [1.0, 0.0, 0.0, 0.0])  # one: still short, but the limit is reached
    assert not pool.wants_more() and not pool.full
    with pytest.raises(DynamicSamplingError, match="found 1 informative groups in 4 prompts over 2 generation"):
        pool.take()
    unlimited = GroupPool(target=2, max_num_gen_batches=0)
    for _ in range(50):
        unlimited.add(["x"], [0, 0], [1.0, 1.0])
    assert unlimited.wants_more()  # 0: no limit
    unlimited.add(["y", "z", "w"], [0, 0, 1, 1, 2, 2], [0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    assert not unlimited.wants_more() and unlimited.take() == ["y", "z"]


# ------------------------------------------------------------------------------------------ the trainer step


class FakeEngine:
    """Sample j of every prompt has j + 1 tokens."""

    def generate(self, prompts, params, request_ids=None):
        from rlhf_mcore.rollout.base import Sample

        return [SimpleNamespace(samples=[Sample(token_ids=[7] * (j + 1), logprobs=[-0.1] * (j + 1),
                                                finish_reason="stop") for j in range(params.n)])
                for _ in prompts]


class FakeScorer:
    """`right` scores 1, `wrong` 0, `mixed` 1 for odd response lengths."""

    max_failure_ratio = 0.5

    def score(self, data_sources, texts, ground_truths, extra_infos, check=False):
        scores = [{"right": 1.0, "wrong": 0.0}.get(gt, float(int(t) % 2)) for t, gt in zip(texts, ground_truths)]
        counts = dict(num_items=float(len(texts)), num_failed=0.0, num_exceptions=0.0, num_invalid=0.0,
                      num_timeouts=0.0)
        return scores, counts


def fake_trainer(kinds, *overrides, dp=1, dp_rank=0):
    """The synchronous trainer's parts with fakes for the engines: dataset item k's answer pattern is kinds[k].
    Returns (run, rollout side)."""
    from pathlib import Path

    from rlhf_mcore.trainer.colocated import ColocatedRollout
    from rlhf_mcore.trainer.learner import Learner
    from rlhf_mcore.trainer.run import RunContext

    cfg = load_config(None, MODEL + ["data.shuffle=false", *overrides])
    train_set = [{"input_ids": [1] * (2 + k % 3), "data_source": "fake", "ground_truth": kind}
                 for k, kind in enumerate(kinds)]
    state = SimpleNamespace(is_coordinator=True, dims=SimpleNamespace(dp=dp), dp_rank=dp_rank, cpu_group=None,
                            rank=0, dp_group=None)
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: str(len(ids)), pad_token_id=0)
    run = RunContext(cfg, state, tokenizer=tokenizer, train_set=train_set, val_set=None, scorer=FakeScorer(),
                     run_lock=None, out_dir=Path("unused"))
    run.step = 1
    rollout = ColocatedRollout(run, Learner(cfg, state, actor=None), FakeEngine())
    rollout.session = lambda: nullcontext({})  # no engine to wake
    return run, rollout


DAPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "data.max_response_length=4",
        "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=2",
        "reward_model.overlong_buffer.penalty_factor=1.0", "reward_model.overlong_buffer.log=true"]


def test_generate_shapes_scores_with_the_overlong_penalty():
    run, t = fake_trainer(["right", "mixed"], *DAPO, "data.train_batch_size=2")
    batch, metrics = t.generate(run.plan())
    # lengths 1..4 with L_max 4, buffer 2: penalties 0, 0, -0.5, -1
    raw = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    want = [s + p for s, p in zip(raw, [0.0, 0.0, -0.5, -1.0] * 2)]
    last = batch["response_mask"].sum(1) - 1
    assert batch["token_level_scores"].gather(1, last[:, None]).squeeze(1).tolist() == want
    assert batch["token_level_scores"].sum(1).tolist() == want  # nothing anywhere else
    assert metrics["reward/overlong_penalty"] == -0.375 and metrics["reward/overlong_fraction"] == 0.5
    assert "dynamic_sampling/num_gen_batches" not in metrics


def test_generate_refills_until_the_batch_holds_informative_groups():
    # gen batch 4, train batch 3: the first batch has 2 informative groups (mixed), the second 2 more
    kinds = ["right", "mixed", "wrong", "mixed", "mixed", "right", "mixed", "wrong"]
    ds = [*DAPO, "data.train_batch_size=3", "data.gen_batch_size=4", "algorithm.filter_groups.enable=true",
          "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=3"]
    run, t = fake_trainer(kinds, *ds)
    batch, metrics = t.generate(run.plan())
    assert run.sampler.position == 8  # both generation batches consumed
    assert metrics["dynamic_sampling/num_gen_batches"] == 2.0
    assert metrics["dynamic_sampling/drawn_groups"] == 8.0 and metrics["dynamic_sampling/informative_groups"] == 4.0
    assert metrics["reward/num_timeouts"] == 0.0
    assert batch["ground_truth"] == ["mixed"] * 12  # the first 3 informative groups, 4 responses each
    assert sorted(set(batch["index"].tolist())) == [0, 1, 2] and batch["index"].tolist() == sorted(
        batch["index"].tolist())
    assert batch["token_level_scores"].sum(1).tolist() == [1.0, 0.0, 0.5, -1.0] * 3  # mixed: 1 on odd lengths

    # seq_reward filters on the shaped score: `right` groups become informative (1, 1, 0.5, 0)
    run, t = fake_trainer(kinds, *ds[:-2], "algorithm.filter_groups.metric=seq_reward")
    batch, metrics = t.generate(run.plan())
    assert metrics["dynamic_sampling/num_gen_batches"] == 1.0 and run.sampler.position == 4
    assert batch["ground_truth"] == ["right"] * 4 + ["mixed"] * 4 + ["wrong"] * 4

    # the limit reached with too few informative groups stops the run, as veRL's recipe does
    run, t = fake_trainer(kinds, *ds[:-1], "algorithm.filter_groups.max_num_gen_batches=1")
    with pytest.raises(DynamicSamplingError, match="found 2 informative groups in 4 prompts over 1 generation"):
        t.generate(run.plan())


def test_generate_with_dynamic_sampling_splits_kept_groups_over_dp_ranks():
    kinds = ["mixed", "right", "mixed", "mixed", "wrong", "mixed", "mixed", "right"]
    ds = [*DAPO, "data.train_batch_size=4", "data.gen_batch_size=4", "algorithm.filter_groups.enable=true",
          "algorithm.filter_groups.metric=score"]
    per_rank = []
    for rank in (0, 1):  # every rank holds all rows, so each computes the same kept groups
        run, t = fake_trainer(kinds, *ds, dp=2, dp_rank=rank)
        batch, _ = t.generate(run.plan())
        assert len(batch["index"]) == 2 * 4  # train_batch_size / DP groups of n responses
        per_rank.append(set(batch["index"].tolist()))
    assert per_rank[0].isdisjoint(per_rank[1]) and per_rank[0] | per_rank[1] == {0, 1, 2, 3}


# ------------------------------------------------------------------------------------------ config


def test_dapo_keys_load_under_verl_names():
    cfg = load_config(None, MODEL + [
        "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
        "reward_model.overlong_buffer.len=128", "reward_model.overlong_buffer.penalty_factor=1.0",
        "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=10", "data.train_batch_size=8", "data.gen_batch_size=24",
        "actor_rollout_ref.rollout.n=4", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.use_dynamic_bsz=true"])
    assert cfg.reward.reward_model.overlong_buffer.len == 128 and cfg.data.gen_batch_size == 24
    assert cfg.algorithm.filter_groups.metric == "acc"
    validate_config(cfg, world_size=2)


@pytest.mark.parametrize("overrides,fragments", [
    (["reward.reward_model.overlong_buffer.enable=true", "reward.reward_model.overlong_buffer.len=0"],
     ["'reward.reward_model.overlong_buffer.len' has value 0", "in [1, data.max_response_length=512]"]),
    (["reward.reward_model.overlong_buffer.enable=true", "reward.reward_model.overlong_buffer.len=600"],
     ["has value 600", "data.max_response_length=512"]),
    (["reward.reward_model.overlong_buffer.penalty_factor=-1"],
     ["'reward.reward_model.overlong_buffer.penalty_factor' has value -1.0", ">= 0"]),
    (["reward.reward_model.overlong_buffer.len=-3"], ["overlong_buffer.len' has value -3", ">= 0"]),
    (["algorithm.filter_groups.enable=true", "data.gen_batch_size=4"],
     ["'data.gen_batch_size' has value 4", ">= data.train_batch_size (8)"]),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=null"],
     ["'algorithm.filter_groups.metric' has value None", "one of acc, score, seq_reward, seq_final_reward"]),
    (["algorithm.filter_groups.metric=accuracy"], ["has value 'accuracy'", "one of acc, score"]),
    (["algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=gae"],
     ["'actor_rollout_ref.rollout.n' has value 1", ">= 2 with algorithm.filter_groups.enable=true"]),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward",
      "algorithm.use_kl_in_reward=true"], ["has value 'seq_final_reward'", "the KL penalty is computed after"]),
    (["data.gen_batch_size=24"], ["'data.gen_batch_size' has value 24", "unless algorithm.filter_groups.enable"]),
    (["data.gen_batch_size=0"], ["'data.gen_batch_size' has value 0", "unset or >= 1"]),
    (["reward_model.reward_manager=batch"], ["has value 'batch'", "choose one of naive, dapo, prime"]),
])
def test_dapo_config_errors(overrides, fragments):
    base = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "algorithm.adv_estimator=grpo",
            "algorithm.filter_groups.metric=acc"]
    with pytest.raises(ConfigError) as e:
        load_config(None, MODEL + base + overrides)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))


def test_gen_batch_size_equal_to_train_batch_size_is_accepted_without_filtering():
    cfg = load_config(None, MODEL + ["data.train_batch_size=8", "data.gen_batch_size=8"])
    assert cfg.data.gen_batch_size == 8


def test_dapo_and_rollout_correction_through_train_py_at_dp2(tmp_path, tiny_model_dir):
    """End to end under torchrun (2 ranks, DP=2): dynamic sampling refills from the sampler, overlong shaping and
    token-level IS weights with batch normalisation run through the real engines; the metrics say so. Its output
    is a log file's (not a terminal): plain lines, none said once per rank, one per step and per validation, the
    validation samples' questions whole. Its timeline (trainer.trace=true): a track per rank, each step's phases in
    order, scoring inside the generation, the actor's mini-batch inside the update, the weight sync's buckets inside
    the sync (as many, and as many bytes, as the step logged), the validation after the last step."""
    import ast

    import pandas as pd
    from e2e_helpers import (
        check_buckets,
        check_plain_log,
        parity_task,
        process_names,
        records,
        spans_in,
        step_phases,
        trace_tracks,
    )
    from launcher import run

    out = tmp_path / "run"
    args = parity_task(tmp_path, tiny_model_dir("qwen2")) + [
        "data.gen_batch_size=4", "algorithm.adv_estimator=grpo", "trainer.total_training_steps=2",
        f"trainer.default_local_dir={out}", "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=seq_reward", "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.penalty_factor=1.0",
        "reward_model.overlong_buffer.log=true", "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_batch_normalize=true",
        f"data.val_files=[{tmp_path / 'syn' / 'test.parquet'}]", "trainer.val_before_train=false",
        "trainer.test_freq=2", "trainer.logger=[jsonl,console]"]
    proc = run("launch/train.py", *args, "trainer.trace=true", nproc=2)
    check_plain_log(proc.stdout, proc.stderr, ["step 1/2 | reward", "step 2/2 | reward", "[val @ step 2]",
                                               "run summary: 2 steps"])
    questions = [m[-1]["content"] for m in pd.read_parquet(tmp_path / "syn" / "test.parquet")["prompt"]]
    samples = [x.split(" | ", 1)[1] for x in proc.stdout.splitlines() if x.startswith("[val sample]")]
    shown = [ast.literal_eval(x[:x.rindex(" -> ")]) for x in samples]  # each sample's prompt, as printed (repr)
    assert len(shown) == 3 and all(any(q in x for q in questions) for x in shown), (shown, questions)
    logged = [r for r in records(out) if r["kind"] == "train"]
    assert [r["step"] for r in logged] == [1, 2]
    # the run's timeline (trainer.trace=true: <run dir>/trace.json): a track per rank, each step's phases in order
    names = process_names(out / "trace.json")
    assert sorted(names) == [0, 1] and all("train + rollout · dp" in n for n in names.values()), names
    tracks = trace_tracks(out / "trace.json")
    for rank in (0, 1):
        main = tracks[(rank, 0)]
        assert step_phases(main) == {k: ["plan", "gen", "old_log_prob", "adv", "update", "sync"]
                                     for k in (1, 2)}, rank
        for r in logged:
            phase = {e["name"]: e for e in main if e["args"].get("step") == r["step"]}
            minis = spans_in(main, phase["update"], "actor mini-batch")  # 16 sequences over DP 2, mini-batch 8
            assert [(m["args"]["epoch"], m["args"]["index"], m["args"]["sequences"]) for m in minis] == [(0, 0, 8)]
            check_buckets(main, phase["sync"], r)  # (the 0.5 MB model: one bucket of the default 512 MiB)
            scored = spans_in(main, phase["gen"], "score")  # each rank is a rollout replica: it scores its share
            assert scored and all(e["args"]["items"] > 0 for e in scored), scored
        assert [e["args"]["step"] for e in main if e["name"] == "validation"] == [2]
    for r in logged:
        assert r["dynamic_sampling/informative_groups"] >= 4 and r["dynamic_sampling/num_gen_batches"] >= 1
        assert r["dynamic_sampling/drawn_groups"] == 4 * r["dynamic_sampling/num_gen_batches"]
        assert "reward/overlong_fraction" in r and "rollout_corr/rollout_is_mean" in r
        assert abs(r["rollout_corr/rollout_is_batch_norm_factor"] - 1.0) < 1e-3  # same weights: ratios ~1
