"""PRIME's math (rlhf_mcore.algos.prime) against plain Python loops written from the formulas; then PRIME inside the
training loop (rlhf_mcore.trainer.prime, DP=2 under torchrun): each step's advantages, metrics and PRM update
recomputed by the same loops from what a step hook recorded, DP=2 against DP=1 on the same rows, the resume; and
the label range and the config rules, in-process."""
import math
import random

import pytest
import torch

from rlhf_mcore.algos.prime import (
    implicit_process_rewards,
    masked_rloo,
    prime_advantages,
    prime_ce_loss,
    prime_dpo_accuracy,
    prime_norm,
)

pytestmark = pytest.mark.cost(30)

B, R, N = 8, 6, 4  # two groups of four samples


def close(got: torch.Tensor, want: list, tol: float = 1e-12) -> bool:
    return torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=tol, rtol=0)


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [1 + (3 * b + seed) % R for b in range(B)]
    mask = torch.zeros(B, R)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    prm = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3
    acc = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    index = torch.tensor([0] * N + [1] * N)
    return prm, ref, mask.double(), lengths, acc, index


def naive_rewards(prm, ref, lengths, beta, granularity):
    """Process rewards per row (lists): beta * (prm - ref) on the first `lengths[b]` tokens, or their sum on the
    last one (`whole`)."""
    out = [[0.0] * len(prm[0]) for _ in prm]
    for b in range(len(prm)):
        rs = [beta * (float(prm[b][t]) - float(ref[b][t])) for t in range(lengths[b])]
        if granularity == "token":
            out[b][:lengths[b]] = rs
        else:
            out[b][lengths[b] - 1] = sum(rs)
    return out


@pytest.mark.parametrize("granularity", ["token", "whole"])
def test_process_rewards_match_a_loop(granularity):
    prm, ref, mask, lengths, _, _ = batch()
    scores, q = implicit_process_rewards(prm, ref, mask, beta=0.05, granularity=granularity)
    assert close(scores, naive_rewards(prm, ref, lengths, 0.05, granularity))
    for b in range(B):  # q: the log-ratio on the response, 0 after it
        for t in range(R):
            want = float(prm[b, t] - ref[b, t]) if t < lengths[b] else 0.0
            assert float(q[b, t]) == pytest.approx(want)


def naive_batch_norm(rows):
    """The scores over the largest |return-to-go| of all rows (+1e-6)."""
    biggest = max(abs(sum(row[t:])) for row in rows for t in range(len(row)))
    return [[x / (biggest + 1e-6) for x in row] for row in rows]


def test_batch_norm_matches_a_loop():
    prm, ref, mask, lengths, _, _ = batch(1)
    scores, _ = implicit_process_rewards(prm, ref, mask, beta=0.05)
    assert close(prime_norm(scores, "batch_norm"), naive_batch_norm(scores.tolist()))
    assert torch.equal(prime_norm(scores, "none"), scores)
    with pytest.raises(ValueError, match="prime_norm='layer'"):
        prime_norm(scores, "layer")


def naive_rloo(rewards, mask, groups):
    R = len(rewards[0])
    out = [[0.0] * R for _ in rewards]
    for members in groups:
        n = len(members)
        means = {i: sum(rewards[i][t] for t in range(R) if mask[i][t]) / max(1, sum(mask[i])) for i in members}
        for i in members:
            others = sum(means[j] for j in members if j != i) / (n - 1)
            for t in range(R):
                if mask[i][t]:
                    # r * n/(n-1) - sum_j m_j/(n-1)  ==  r + (r - m_i)/(n-1) - mean_{j != i} m_j
                    out[i][t] = rewards[i][t] + (rewards[i][t] - means[i]) / (n - 1) - others
    return out


def test_rloo_matches_a_loop_and_is_leave_one_out_for_outcomes():
    prm, ref, mask, lengths, acc, index = batch(2)
    scores, _ = implicit_process_rewards(prm, ref, mask, beta=0.05)
    groups = [list(range(N)), list(range(N, B))]
    assert close(masked_rloo(scores, mask, index), naive_rloo(scores.tolist(), mask.tolist(), groups))
    # one reward per sample: r_i - mean of the others
    outcome = torch.zeros(B, R, dtype=torch.float64)
    last = torch.zeros(B, R)
    for b in range(B):
        outcome[b, lengths[b] - 1], last[b, lengths[b] - 1] = acc[b], 1
    rl = masked_rloo(outcome, last, index)
    for b in range(B):
        others = [float(acc[j]) for j in groups[b // N] if j != b]
        assert float(rl[b, lengths[b] - 1]) == pytest.approx(float(acc[b]) - sum(others) / len(others))
    with pytest.raises(ValueError, match="RLOO needs rollout.n >= 2"):
        masked_rloo(scores, mask, torch.arange(B))


def naive_advantages(scores, acc, lengths, groups, dpo_coef, gt_coef):
    """(advantages, returns) as lists: RLOO of the process scores (on the response) and of the outcome (on the last
    token) within each group, weighted and summed, returns-to-go, whitened over every response token (unbiased)."""
    B, R = len(scores), len(scores[0])
    proc = naive_rloo(scores, [[t < lengths[b] for t in range(R)] for b in range(B)], groups)
    outcome_rewards = [[0.0] * R for _ in range(B)]
    last_mask = [[0] * R for _ in range(B)]
    for b in range(B):
        outcome_rewards[b][lengths[b] - 1], last_mask[b][lengths[b] - 1] = float(acc[b]), 1
    outc = naive_rloo(outcome_rewards, last_mask, groups)
    total = [[dpo_coef * proc[b][t] + gt_coef * outc[b][t] for t in range(R)] for b in range(B)]
    returns = [[sum(total[b][t:lengths[b]]) if t < lengths[b] else 0.0 for t in range(R)] for b in range(B)]
    valid = [returns[b][t] for b in range(B) for t in range(lengths[b])]
    mean = sum(valid) / len(valid)
    var = sum((x - mean) ** 2 for x in valid) / (len(valid) - 1)
    adv = [[(returns[b][t] - mean) / math.sqrt(var + 1e-8) if t < lengths[b] else 0.0 for t in range(R)]
           for b in range(B)]
    return adv, returns


def naive_ce(prm, ref, lengths, acc, beta):
    """Mean over rows of the binary cross-entropy of sigmoid(beta * sum_t (prm - ref)) against the label."""
    want = 0.0
    for b in range(len(prm)):
        s = 1 / (1 + math.exp(-beta * sum(float(prm[b][t]) - float(ref[b][t]) for t in range(lengths[b]))))
        want -= (float(acc[b]) * math.log(s) + (1 - float(acc[b])) * math.log(1 - s)) / len(prm)
    return want


def naive_dpo_accuracy(sums, acc, groups):
    per_group = []
    for members in groups:
        num = den = 0.0
        for a in range(len(members)):
            for c in range(a + 1, len(members)):
                i, j = members[a], members[c]
                w = abs(float(acc[i]) - float(acc[j]))
                num += w * (((sums[i] - sums[j]) > 0) == ((float(acc[i]) - float(acc[j])) > 0))
                den += w
        per_group.append(num / den if den else 0.5)
    return sum(per_group) / len(per_group)


@pytest.mark.parametrize("dpo_coef, gt_coef", [(5.0, 5.0), (0.0, 1.0), (2.0, 0.0)])
def test_advantages_match_a_loop(dpo_coef, gt_coef):
    prm, ref, mask, lengths, acc, index = batch(3)
    scores = prime_norm(implicit_process_rewards(prm, ref, mask, beta=0.05)[0])
    adv, ret = prime_advantages(scores, acc, mask, index, reward_dpo_coef=dpo_coef, reward_gt_coef=gt_coef)
    groups = [list(range(N)), list(range(N, B))]
    want, returns = naive_advantages(scores.tolist(), acc.tolist(), lengths, groups, dpo_coef, gt_coef)
    assert close(ret, returns)
    assert close(adv, want, 1e-9)
    # split over two "ranks" whose partial sums are added: the same advantages as the whole batch
    from rlhf_mcore.algos.prime import _whiten

    halves = [slice(0, N), slice(N, B)]
    parts = [torch.stack([(ret[h] * mask[h]).sum(), (ret[h] ** 2 * mask[h]).sum(), mask[h].sum()]) for h in halves]
    for k, h in enumerate(halves):
        assert close(_whiten(ret[h], mask[h], lambda t, k=k: t + parts[1 - k]) * mask[h], want[h.start:h.stop], 1e-9)


def test_ce_loss_matches_a_loop_and_trains_q():
    prm, ref, mask, lengths, acc, _ = batch(4)
    prm = prm.clone().requires_grad_(True)
    _, q = implicit_process_rewards(prm, ref, mask, beta=0.05)
    loss = prime_ce_loss(q, acc, mask, beta=0.05)
    assert float(loss.detach()) == pytest.approx(naive_ce(prm.detach(), ref, lengths, acc, 0.05), rel=1e-10)
    loss.backward()
    # the gradient raises the log-probs of correct samples and lowers those of wrong ones, on the response only
    for b in range(B):
        g = prm.grad[b, :lengths[b]]
        assert bool((g < 0).all()) if acc[b] == 1 else bool((g > 0).all())
        assert not prm.grad[b, lengths[b]:].any()


def test_dpo_accuracy_matches_a_loop():
    rng = random.Random(0)
    for seed in range(5):
        prm, ref, mask, lengths, acc, index = batch(seed)
        acc = torch.tensor([float(rng.random() < 0.5) for _ in range(B)], dtype=torch.float64)
        _, q = implicit_process_rewards(prm, ref, mask, beta=0.05)
        sums = [float(q[b].sum()) for b in range(B)]
        want = naive_dpo_accuracy(sums, acc.tolist(), [list(range(N)), list(range(N, B))])
        assert float(prime_dpo_accuracy(q, acc, mask, index)) == pytest.approx(want)


# ------------------------------------------------------------------------------------- PRIME inside the loop

PRIME = ["algorithm.adv_estimator=rloo", "reward_model.enable=true", "reward_model.reward_manager=prime",
         "reward_model.model.optim.lr=1e-3", "trainer.export_hf_final=false"]
BETA, COEF = 0.05, 5.0  # reward_model.model.beta_train, algorithm.reward_dpo_coef / reward_gt_coef (the defaults)
# fp32 in the trainer (16 rows x 8 tokens, sums of a few dozen terms of size <= 10), float64 in the loops here:
# their differences measured <= 3e-7 on advantages of size ~1
ATOL = 2e-5
RUNS = [
    {"name": "before", "overrides": ["trainer.total_training_steps=2", "trainer.save_freq=1"]},
    # from the step-1 checkpoint of "before": step 2 again, with the PRM (and its optimizer) as saved there
    {"name": "resumed", "overrides": ["trainer.total_training_steps=2", "trainer.save_freq=1"],
     "resume_from": "before"},
    # step 1 scores with the initial PRM (= the reference: q = 0), step 2 with the PRM updated once
    {"name": "after_whole", "overrides": ["trainer.total_training_steps=2", "trainer.save_freq=-1",
                                          "reward_model.model.update=after", "reward_model.prime_granularity=whole"]},
]


@pytest.fixture(scope="module")
def prime_runs(tmp_path_factory, tiny_model_dir):
    """The runs of RUNS under one torchrun launch of tests/scripts/prime_runs.py (2 ranks, DP=2; the parity task of
    e2e_helpers: 4 prompts x 4 samples a step, rewards 0/1). Returns (out dir, {name: {step: (rows of both ranks,
    each with its "rank", metrics, calls)}}, {name: the run's overrides})."""
    import json

    import launcher
    from e2e_helpers import parity_task

    tmp = tmp_path_factory.mktemp("prime")
    base = parity_task(tmp, tiny_model_dir("qwen2")) + PRIME
    (tmp / "spec.json").write_text(json.dumps({"base": base, "runs": RUNS}))
    out = tmp / "out"
    out.mkdir()
    launcher.run("tests/scripts/prime_runs.py", "--spec", str(tmp / "spec.json"), "--out", str(out), nproc=2,
                 timeout=900)
    runs = {}
    for run in RUNS:
        ranks = [json.loads((out / f"{run['name']}.rank{r}.json").read_text()) for r in (0, 1)]
        runs[run["name"]] = {
            s["step"]: ([{**row, "rank": r} for r, rank in enumerate(ranks) for row in rank[k]["rows"]],
                        s["metrics"], s["calls"]) for k, s in enumerate(ranks[0])}
    return out, runs, {run["name"]: base + run["overrides"] for run in RUNS}


def check_step(rows, metrics, calls, granularity, update):
    """One step's advantages, returns, metrics and PRM update against the loops above, over both ranks' rows."""
    lengths = [r["length"] for r in rows]
    width = len(rows[0]["mask"])
    for r in rows:  # single-turn responses: the mask is a prefix
        assert r["mask"] == [1.0] * r["length"] + [0.0] * (width - r["length"])
    groups = {}
    for b, r in enumerate(rows):
        groups.setdefault(r["index"], []).append(b)
    assert all(len({rows[b]["rank"] for b in g}) == 1 for g in groups.values())  # groups do not span ranks
    assert len(groups) == 4 and {len(g) for g in groups.values()} == {4}
    groups = list(groups.values())
    prm, ref, acc = [r["prm"] for r in rows], [r["ref"] for r in rows], [r["acc"] for r in rows]
    scores = naive_batch_norm(naive_rewards(prm, ref, lengths, BETA, granularity))  # the max over both ranks
    adv, ret = naive_advantages(scores, acc, lengths, groups, COEF, COEF)  # whitened over both ranks' tokens
    for b, r in enumerate(rows):
        assert r["ret"] == pytest.approx(ret[b], abs=ATOL), b
        assert r["adv"] == pytest.approx(adv[b], abs=ATOL), b
    assert any(abs(x) > 0.1 for row in scores for x in row)  # the PRM has moved off the reference: q != 0
    assert metrics["prime/process_reward_mean"] == pytest.approx(sum(map(sum, scores)) / len(rows), abs=1e-6)
    sums = [sum(p[t] - q[t] for t in range(n)) for p, q, n in zip(prm, ref, lengths)]
    assert metrics["prime/dpo_acc"] == pytest.approx(naive_dpo_accuracy(sums, acc, groups))
    # the PRM's update: one optimizer step on this batch's cross-entropy, which falls on the same batch
    assert metrics["prime_rm/num_optimizer_steps"] == 1 and metrics["prime_rm/grad_norm"] > 0
    before_update = metrics["prime_rm/ce_loss"]  # the update's own loss: the PRM before it
    after_update = naive_ce([r["prm_end"] for r in rows], ref, lengths, acc, BETA)
    assert after_update < before_update - 1e-4, (before_update, after_update)
    if update == "before":  # updated, then scored: the process rewards come from the updated PRM
        assert calls == ["update", "log_probs"]
        assert all(r["prm"] == pytest.approx(r["prm_end"], abs=1e-6) for r in rows)
    else:  # scored, then updated: the process rewards come from the PRM before the update
        assert calls == ["log_probs", "update"]
        assert naive_ce(prm, ref, lengths, acc, BETA) == pytest.approx(before_update, abs=1e-5)


@pytest.mark.slow
def test_prime_advantages_and_prm_update_in_the_loop(prime_runs):
    """Every step of the DP=2 runs (update=before with token rewards; update=after with whole rewards): the
    trainer's advantages and returns equal the loops above on both ranks' rows together (the batch-norm max and
    the whitening over all ranks), `prime/dpo_acc` and `prime/process_reward_mean` equal theirs, and the PRM's
    cross-entropy on the step's batch falls through its update.

    Mutations, each in ImplicitPRM.compute_advantages: `prime_advantages(scores * 0, ...)` (the process rewards
    left out) -> fails; the batch-norm max taken on this rank only (`group_all_reduce(..., MAX)` dropped) -> fails;
    `batch_sums=None` (whitening per rank) -> fails; `update == "before"` / `== "after"` negated (the two orders
    swapped) -> fails; `"token"` passed for `self.rm.prime_granularity` -> fails."""
    _, runs, _ = prime_runs
    for name, granularity, update in (("before", "token", "before"), ("after_whole", "whole", "after")):
        assert sorted(runs[name]) == [1, 2]
        for step, (rows, metrics, calls) in runs[name].items():
            if update == "after" and step == 1:  # the initial PRM is the reference: q = 0, no process reward
                assert all(r["prm"] == r["ref"] for r in rows) and metrics["prime/process_reward_mean"] == 0
                continue
            check_step(rows, metrics, calls, granularity, update)


class RecordedPRM:
    """A PRM engine that returns the log-probs a run recorded (the union of its ranks' rows) and trains nothing."""

    def __init__(self, log_probs):
        self.log_probs = log_probs

    def compute_log_probs(self, batch, with_entropy=False):
        return self.log_probs, None

    def update(self, batch):
        return {}


@pytest.mark.slow
def test_dp2_equals_dp1_on_the_same_batch(prime_runs):
    """DP=2 against DP=1 on the same samples: the union of both ranks' rows of each recorded step, through
    ImplicitPRM.compute_advantages at DP=1 (no DP group), gives the advantages each rank computed with its
    all-reduced batch-norm max and whitening sums, and the same `prime/*` metrics. (Two launches at DP=1 and DP=2
    sample different responses: the rollout keys each request by its position in the DP plan's prompt order.)

    Mutation: the batch-norm max taken on this rank only (no `group_all_reduce(..., MAX)`) -> fails; whitening without
    `batch_sums` -> fails."""
    from rlhf_mcore.config import load_config
    from rlhf_mcore.trainer.prime import ImplicitPRM

    _, runs, overrides = prime_runs
    for name in ("before", "after_whole"):
        cfg = load_config(None, overrides[name])
        for step, (rows, metrics, _) in runs[name].items():
            mask = torch.tensor([r["mask"] for r in rows])
            scores = torch.zeros_like(mask)
            scores[torch.arange(len(rows)), torch.tensor([r["length"] - 1 for r in rows])] = torch.tensor(
                [r["acc"] for r in rows])
            batch = {"response_mask": mask, "token_level_scores": scores, "ref_log_prob": torch.tensor(
                [r["ref"] for r in rows]), "index": torch.tensor([r["index"] for r in rows])}
            prm = ImplicitPRM(RecordedPRM(torch.tensor([r["prm"] for r in rows])), cfg.reward.reward_model,
                              cfg.algorithm)
            one = prm.compute_advantages(batch)
            for got, r in zip(batch["advantages"].tolist(), rows):
                assert got == pytest.approx(r["adv"], abs=1e-5), (name, step)
            for k in ("prime/dpo_acc", "prime/process_reward_mean"):
                assert one[k] == pytest.approx(metrics[k], abs=1e-6), (name, step, k)


@pytest.mark.slow
def test_prime_resumes_with_its_prm(prime_runs):
    """Resumed from the step-1 checkpoint, step 2 sees the PRM (and its optimizer) as trained through step 1: the
    same metrics as the uninterrupted run's step 2.

    Mutation: the PRM's checkpoint not loaded on resume (`self.prime.engine.load_checkpoint` skipped) -> fails."""
    from e2e_helpers import records

    out, runs, _ = prime_runs
    first, again = records(out / "before"), records(out / "resumed")
    assert [r["step"] for r in first] == [1, 2] and [r["step"] for r in again] == [1, 2]
    for k in ("prime_rm/ce_loss", "prime/dpo_acc", "prime/process_reward_mean", "actor/pg_loss"):
        assert again[1][k] == first[1][k], (k, again[1][k], first[1][k])
    assert sorted(runs["resumed"]) == [2]
    assert [r["adv"] for r in runs["resumed"][2][0]] == [r["adv"] for r in runs["before"][2][0]]


@pytest.mark.parametrize("label", [1.5, -0.5])
def test_labels_outside_0_1_are_a_clear_error(label):
    """An outcome label (the response's summed rule score, overlong penalty included) outside [0, 1] stops the step
    before the PRM is touched, naming the range found and the fix.

    Mutation: the range check in ImplicitPRM.compute_advantages removed -> fails (the step goes on)."""
    from rlhf_mcore.config import load_config
    from rlhf_mcore.trainer.prime import ImplicitPRM

    cfg = load_config(None, CONFIG_BASE)
    prm, ref, mask, lengths, acc, index = batch(5)
    scores = torch.zeros(B, R)
    for b in range(B):
        scores[b, lengths[b] - 1] = label if b == 2 else float(acc[b])
    engine = RecordedPRM(prm.float())
    run = ImplicitPRM(engine, cfg.reward.reward_model, cfg.algorithm)
    with pytest.raises(ValueError, match=rf"outcome labels must lie in \[0, 1\].*rule scores in "
                                         rf"\[{min(label, 0):g}, {max(label, 1):g}\]: use a 0/1 reward function"):
        run.compute_advantages({"response_mask": mask.float(), "token_level_scores": scores, "index": index,
                                "ref_log_prob": ref.float()})


CONFIG_BASE = ["actor_rollout_ref.model.path=/models/policy", *PRIME[:3]]


@pytest.mark.parametrize("overrides, message", [
    (["reward_model.enable=false"], r"'reward.reward_model.enable' has value False; it must be true with "
                                    r"reward_manager=prime"),
    (["reward_model.model.path=/models/other"], r"'reward.reward_model.model.path' has value '/models/other'; it "
                                                r"must be unset or the actor's model \(/models/policy\)"),
    (["algorithm.adv_estimator=grpo"], r"'algorithm.adv_estimator' has value 'grpo'; it must be rloo"),
    (["algorithm.use_kl_in_reward=true"], r"'algorithm.use_kl_in_reward' has value True; it must be false"),
    (["critic.enable=true"], r"'critic.enable' has value True; it must be false or unset"),
    (["reward_model.model.beta_train=0"], r"'reward.reward_model.model.beta_train' has value 0.0; it must be > 0"),
    (["reward_model.model.beta_train=nan"], r"'reward.reward_model.model.beta_train' has value nan; it must be > 0"),
    (["algorithm.reward_dpo_coef=inf"], r"'algorithm.reward_dpo_coef' has value inf; it must be a finite number"),
    (["algorithm.reward_gt_coef=nan"], r"'algorithm.reward_gt_coef' has value nan; it must be a finite number"),
    (["algorithm.reward_dpo_coef=0", "algorithm.reward_gt_coef=0"],
     r"'algorithm.reward_dpo_coef' has value 0.0; it must be non-zero, or algorithm.reward_gt_coef non-zero"),
    (["reward_model.model.optim.lr=-1"], r"'reward.reward_model.model.optim.lr' has value -1.0; it must be >= 0"),
    (["reward_model.prime_granularity=step"], r"'reward.reward_model.prime_granularity' has value 'step'; choose "
                                              r"one of token, whole"),
    (["reward_model.prime_norm=layer"], r"'reward.reward_model.prime_norm' has value 'layer'; choose one of "
                                        r"batch_norm, none"),
    (["reward_model.model.update=during"], r"'reward.reward_model.model.update' has value 'during'; choose one of "
                                           r"before, after"),
])
def test_prime_config_rules(overrides, message):
    """Each PRIME rule of rlhf_mcore.config (`_check_prime` and the choices) rejects its key with the value and what
    it must be.

    Mutation: any one `need(...)` line of `_check_prime` deleted -> its case fails."""
    from rlhf_mcore.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, CONFIG_BASE + overrides)


@pytest.mark.parametrize("overrides", [[], ["reward_model.model.path=/models/policy"], ["algorithm.reward_dpo_coef=0"],
                                       ["reward_model.prime_granularity=whole", "reward_model.prime_norm=none",
                                        "reward_model.model.update=after", "algorithm.reward_gt_coef=0"]])
def test_prime_configs_the_rules_accept(overrides):
    """The other side of each rule: the actor's path as the PRM's, one coefficient at 0, the other choices."""
    from rlhf_mcore.config import load_config

    cfg = load_config(None, CONFIG_BASE + overrides)
    assert cfg.reward.reward_model.reward_manager == "prime"


def test_prime_with_an_asynchronous_trainer_is_rejected():
    """PRIME updates its PRM inside the synchronous step: the asynchronous modes say so (a launch-layout check).

    Mutation: the `reward_manager != "prime"` requirement of the async checks removed -> fails."""
    from rlhf_mcore.config import ConfigError, load_config, validate_config

    for mode in ("one_step_off", "fully_async"):
        cfg = load_config(None, CONFIG_BASE + [f"async_training.mode={mode}", "rollout.n_gpus_per_node=1",
                                               "trainer.n_gpus_per_node=1"])
        with pytest.raises(ConfigError, match=rf"reward_manager=prime updates its implicit PRM inside the synchronous "
                                              rf"step.*async_training.mode={mode} has no such step"):
            validate_config(cfg, 2)
