"""Trainer building blocks without models: checkpoint atomicity and pruning, the coordinator's plan, the batch
layout, metric reduction and logging sinks, and what colocation offloads around generation."""
import json
import random
from pathlib import Path

import pytest
import torch

from rlhf_mcore.data.batch import build_batch
from rlhf_mcore.trainer.checkpoint import COMPLETE, CheckpointError, CheckpointManager, list_complete, resolve_resume
from rlhf_mcore.trainer.logging import MetricLogger, reduce_metrics
from rlhf_mcore.trainer.plan import plan_step


def save(mgr, step, payload=None):
    def engines(path: Path):
        (path / "actor").mkdir()
        (path / "actor" / "weights.bin").write_bytes(b"x" * 10)
    return mgr.save(step, {"step": step, "payload": payload}, engines)


def test_checkpoint_atomic_keep_last_and_resume(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2, rank=0)
    for step in (10, 20, 30):
        save(mgr, step)
    assert [s for s, _ in list_complete(tmp_path)] == [20, 30]  # only the last two kept
    # a save killed midway: a .tmp directory without COMPLETE, and a step dir without COMPLETE
    (tmp_path / "global_step_40.tmp-123-1").mkdir()
    (tmp_path / "global_step_50").mkdir()
    assert resolve_resume(tmp_path, "auto").name == "global_step_30"
    assert resolve_resume(tmp_path, "disable") is None
    with pytest.raises(CheckpointError, match="not a usable checkpoint: incomplete"):
        resolve_resume(tmp_path, str(tmp_path / "global_step_50"))
    random.seed(5)
    torch.manual_seed(5)
    path = save(mgr, 60, payload="hello")
    expected_next = (random.random(), torch.rand(1).item())
    assert not list(tmp_path.glob("*.tmp-*")), "stale temporary checkpoints are removed on the next save"
    assert (path / COMPLETE).is_file()
    random.seed(0)
    torch.manual_seed(0)
    state = mgr.load_trainer_state(path)  # restores the host RNGs as they were at save time
    assert state["payload"] == "hello" and state["step"] == 60
    assert (random.random(), torch.rand(1).item()) == expected_next
    assert resolve_resume(tmp_path, "auto").name == "global_step_60"
    assert resolve_resume(tmp_path, "auto") == resolve_resume(tmp_path, str(path))
    assert resolve_resume(tmp_path / "missing", "auto") is None


def test_plan_keeps_groups_whole_and_balances():
    ids = list(range(100, 116))
    lengths = [5, 50, 7, 40, 3, 60, 9, 30, 11, 20, 13, 10, 15, 8, 17, 6]
    parts = plan_step(ids, lengths, dp_size=4)
    assert sorted(i for p in parts for i in p) == ids and all(len(p) == 4 for p in parts)
    loads = [sum(lengths[ids.index(i)] for i in p) for p in parts]
    naive = [sum(lengths[k:k + 4]) for k in range(0, 16, 4)]
    assert max(loads) - min(loads) < max(naive) - min(naive)
    assert max(loads) - min(loads) <= max(lengths) // 2


def test_build_batch_layout():
    prompts = [[1, 2, 3], [4, 5]]
    responses = [[6, 7], [8, 9, 10, 11]]
    b = build_batch(prompts, responses, [[-0.1, -0.2], [-0.3, -0.4, -0.5, -0.6]], ["stop", "length"], [7, 7],
                    {"data_source": ["a", "b"]}, pad_token_id=0, pad_multiple=4)
    assert b["prompts"].tolist() == [[0, 1, 2, 3], [0, 0, 4, 5]]  # left padded
    assert b["responses"].tolist() == [[6, 7, 0, 0], [8, 9, 10, 11]]  # right padded
    assert b["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]]
    assert b["position_ids"][1].tolist() == [0, 0, 0, 1, 2, 3, 4, 5]
    assert b["response_mask"].sum(1).tolist() == [2, 4]
    assert b["rollout_log_probs"][1].tolist() == pytest.approx([-0.3, -0.4, -0.5, -0.6])
    assert b["truncated"].tolist() == [False, True] and b["index"].tolist() == [7, 7]
    assert b["data_source"] == ["a", "b"]  # per-row meta lists are carried as they are


def test_reduce_metrics_single_process_is_identity():
    m = {"a": 1.0, "b/max": 3.0}
    assert reduce_metrics(m) == m


def test_metric_logger_writes_jsonl_and_tensorboard(tmp_path, capsys):
    log = MetricLogger(["console", "jsonl", "tensorboard"], tmp_path, total_steps=2)
    log.log(1, {"critic/score/mean": 0.5, "timing_s/step": 1.5, "bad": float("nan")})
    log.log(1, {"val/acc": 0.25}, kind="val")
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 1, "kind": "train", "critic/score/mean": 0.5, "timing_s/step": 1.5}
    assert rows[1]["kind"] == "val" and rows[1]["val/acc"] == 0.25
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    out = capsys.readouterr().out
    assert "step 1/2" in out and "reward 0.500" in out


class _Engine:
    """Stands in for a TrainEngine: records offload/onload calls; flags as `build_engine` sets them."""

    def __init__(self, log, name, params=False, grads=False, optimizer=False):
        self.log, self.name = log, name
        self.param_offload, self.grad_offload, self.optimizer_offload = params, grads, optimizer

    def offload(self, **kw):
        self.log.append(("offload", self.name, kw))

    def onload(self, **kw):
        self.log.append(("onload", self.name))


class _Rollout:
    def __init__(self, log):
        self.log = log

    def wake(self):
        self.log.append(("wake",))

    def sleep(self, level):
        self.log.append(("sleep", level))


def test_colocated_rollout_offloads_only_what_the_config_asks(monkeypatch):
    from rlhf_mcore.trainer import roles

    monkeypatch.setattr(roles.torch.cuda, "synchronize", lambda *a, **k: None)

    def session(actor, critic, ref, sync_at_wake=None):
        return roles.colocated_rollout(_Rollout(log), [actor, critic, ref], free_cache=True, sync_at_wake=sync_at_wake)

    log = []  # default flags (all off): nothing moves, on GPU as on CPU
    with session(_Engine(log, "actor"), _Engine(log, "critic"), _Engine(log, "ref")) as wake_metrics:
        log.append(("generate",))
    assert log == [("wake",), ("generate",), ("sleep", 1)]
    assert wake_metrics == {}

    log = []  # the 7B config's actor flags, a reference parking its parameters, a critic keeping everything
    with session(_Engine(log, "actor", True, True, True), _Engine(log, "critic"), _Engine(log, "ref", params=True)):
        log.append(("generate",))
    assert log == [("offload", "actor", {"params": True, "grads": True, "optimizer": True}),
                   ("offload", "ref", {"params": True, "grads": False, "optimizer": False}),
                   ("wake",), ("generate",), ("sleep", 1), ("onload", "actor"), ("onload", "ref")]
    assert roles.offload_plan(_Engine(log, "x", grads=True)) == {"params": False, "grads": True, "optimizer": False}

    log = []  # sleep level 2: the weights are synced after the offload and the wake; the sync's metrics come out

    def sync():
        log.append(("sync",))
        return {"sync/seconds": 0.5}

    with session(_Engine(log, "actor", optimizer=True), None, None, sync_at_wake=sync) as wake_metrics:
        log.append(("generate",))
    assert wake_metrics == {"sync/seconds": 0.5}
    assert log == [("offload", "actor", {"params": False, "grads": False, "optimizer": True}), ("wake",), ("sync",),
                   ("generate",), ("sleep", 2), ("onload", "actor")]


def _reduce_worker(rank: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out = reduce_metrics({"a": float(rank), "b/max": float(rank), "c/min": float(rank)})
        assert out == {"a": 0.5, "b/max": 1.0, "c/min": 0.0}, out
    finally:
        dist.destroy_process_group()


def test_reduce_metrics_over_two_ranks():
    """Mean, max and min over 2 gloo ranks (on NCCL the values travel on CUDA: the default group of a GPU run
    has no CPU backend)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_reduce_worker, args=(port,), nprocs=2)


def test_rollout_gap_metrics_match_a_naive_loop():
    import math

    from rlhf_mcore.trainer.stats import rollout_gap_metrics

    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(3, 5, generator=g) * 3  # (B, R) log-probs
    actor = rollout + torch.randn(3, 5, generator=g) * 0.1
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    diffs, k3s = [], []
    for b in range(3):
        for t in range(5):
            if mask[b, t]:
                r = float(actor[b, t]) - float(rollout[b, t])
                diffs.append(abs(r))
                k3s.append(math.exp(r) - r - 1)
    got = rollout_gap_metrics(rollout, actor, mask)
    assert got["rollout/logprob_diff_abs"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-9)
    assert got["rollout/k3_kl"] == pytest.approx(sum(k3s) / len(k3s), rel=1e-9)
    assert got["rollout/k3_kl/max"] == pytest.approx(max(k3s), rel=1e-9)
    assert rollout_gap_metrics(rollout, rollout, mask)["rollout/k3_kl"] == 0.0


def test_rollout_gap_limit_trips_with_both_numbers():
    """An injected mismatch (rollout log-probs shifted by 0.5) trips the limit; warn mode only logs; top-p
    sampling (renormalised rollout log-probs) is exempt."""
    from rlhf_mcore.config import load_config
    from rlhf_mcore.trainer.errors import RolloutMismatchError
    from rlhf_mcore.trainer.run import check_rollout_gap
    from rlhf_mcore.trainer.stats import rollout_gap_metrics

    mask = torch.ones(2, 4)
    lp = torch.full((2, 4), -1.0)
    shifted = rollout_gap_metrics(lp - 0.5, lp, mask)  # k3 = e^0.5 - 1.5 = 0.149 per token
    texts = []

    def check(metrics, *overrides):
        cfg = load_config(None, ["actor_rollout_ref.model.path=/m", *overrides])
        check_rollout_gap(metrics, cfg, 3, texts.append, renormalised=True)

    check(rollout_gap_metrics(lp, lp, mask))  # same weights, same numbers: fine
    with pytest.raises(RolloutMismatchError, match=r"step 3: the rollout's log-probs are 0.149 \(mean k3 KL.*"
                                                   r"over trainer.max_rollout_logprob_gap=0.02"):
        check(shifted)
    check(shifted, "trainer.rollout_logprob_gap_action=warn")
    assert len(texts) == 1 and texts[0].startswith("warning: step 3") and "0.149" in texts[0]
    check(shifted, "actor_rollout_ref.rollout.top_p=0.9")
    check(shifted, "trainer.max_rollout_logprob_gap=0.2")
    assert len(texts) == 1


def test_the_coordinator_dispatches_the_rollout_pools_messages_by_class():
    """The coordinator's pump files each typed message (trainer/messages.py) where its loop looks for it, calls
    `on_message` after each, and refuses anything else by name (an old tuple message included).
    Mutation: drop the `case StepStats` branch of TrainingPool.pump (it then falls to the refusal) -> fails."""
    from types import SimpleNamespace

    from rlhf_mcore.trainer.databus import GroupMeta
    from rlhf_mcore.trainer.messages import GroupReady, StepStats, ValResult
    from rlhf_mcore.trainer.training_pool import TrainingPool

    meta = GroupMeta(uid=7, src=1, nbytes=10, prompt=3, tokens=5, min_version=0, max_version=0)
    inbox = [GroupReady(meta), StepStats(1, {"a": 1.0}), ValResult(2, {"val/x": 0.5}, [{"score": 1.0}])]
    box = SimpleNamespace(get=lambda timeout_s: inbox.pop(0))
    run = SimpleNamespace(state=SimpleNamespace(is_coordinator=True))
    pool = TrainingPool(run, SimpleNamespace(layout=None, mailbox=lambda name: box), dp_ranks=[[0]])
    seen = []
    pool.on_message = lambda: seen.append(len(inbox))
    pool.pump(lambda: 2 in pool.val, "validation")
    assert list(pool.ledger.queue) == [7] and pool.stats == {1: {"a": 1.0}}
    assert pool.val[2].metrics == {"val/x": 0.5} and pool.val[2].samples == [{"score": 1.0}] and seen == [2, 1, 0]
    inbox.append(("group", meta))
    with pytest.raises(RuntimeError, match="the coordinator: unexpected message tuple"):
        pool.pump(lambda: False, "anything")
