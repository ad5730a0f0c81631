"""SGLang backend against a fake `sglang` module that enforces SGLang's contract (tests/scripts/fake_sglang.py).

They check OUR side: the translation of sampling parameters and outputs, weight-update sessions and statuses
(begin/end from 0.5.21, a failing status raises, the cache flushed once per sync), the hosting process left as
it was (environment, signal handlers, start method), shutdown ending only the engine's processes, the memory
sizing and ports, and — under torchrun, 4 gloo ranks — one engine per rollout TP group. That the names exist
in the real SGLang is tests/test_sglang_contract.py's job; `test_sglang_engine_generates` runs the real engine
and is skipped where sglang is not importable (always, on this project's machines).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from pathlib import Path

import launcher
import psutil
import pytest
import torch

pytestmark = pytest.mark.cost(8)

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

import fake_sglang  # noqa: E402
from fake_sglang import FakeEngine, FakeSessionEngine, full_vocab_logprob  # noqa: E402

from rlhf_mcore.rollout import SamplingParams, build_rollout_engine  # noqa: E402
from rlhf_mcore.rollout.sglang_backend import SEED_MASK, check_status  # noqa: E402
from rlhf_mcore.rollout.sglang_colocation import (  # noqa: E402
    ProcessState,
    engine_ports,
    static_memory_fraction,
)

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = {"engine_kwargs": {"mem_fraction_static": 0.4}}  # the memory sizing needs CUDA; tested on its own below


@pytest.fixture
def fake_sglang_module(monkeypatch):
    """Factory: install a fake `sglang` of a given version."""
    FakeEngine.instances.clear()
    monkeypatch.setattr(FakeEngine, "spawn_child", False)

    def install(version="0.5.23"):
        monkeypatch.setitem(sys.modules, "sglang", fake_sglang.make_module(version))
        return FakeEngine.instances

    yield install
    for e in FakeEngine.instances:
        e.loop.close()


@pytest.fixture
def engine(fake_sglang_module, tiny_model_dir):
    fake_sglang_module("0.5.23")
    e = build_rollout_engine("sglang", tiny_model_dir("qwen2"), **NO_GPU)
    yield e, FakeEngine.instances[-1]
    e.processes.pids.clear()
    e.shutdown()


def test_engine_construction_and_generate_translation(fake_sglang_module, tiny_model_dir, monkeypatch):
    fake_sglang_module("0.5.23")
    # a CPU layout (the fake engine runs anywhere); on a GPU machine rank 0's GPU 0 is not base_gpu_id 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    d = tiny_model_dir("qwen2")
    engine = build_rollout_engine("sglang", d, base_gpu_id=3, max_model_len=64, port_base=40000, **NO_GPU)
    fake = FakeEngine.instances[-1]
    assert fake.kwargs == dict(model_path=str(d), tp_size=1, mem_fraction_static=0.4, enable_memory_saver=True,
                               base_gpu_id=3, skip_tokenizer_init=True, random_seed=0, port=40006, nccl_port=40007,
                               context_length=64)
    prompts = [[1, 2, 3], [4, 5]]
    outs = engine.generate(prompts, SamplingParams(n=2, temperature=0.8, top_k=5, max_new_tokens=7, seed=1))
    _, input_ids, sps, return_logprob = fake.calls[-1]
    assert return_logprob and input_ids == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]  # n expanded per prompt
    assert all(sp["temperature"] == 0.8 and sp["top_k"] == 5 and sp["top_p"] == 1.0 and sp["max_new_tokens"] == 7
               and sp["stop_token_ids"] == [959, 957] and "ignore_eos" not in sp for sp in sps)
    seeds = [sp["sampling_seed"] for sp in sps]
    assert len(set(seeds)) == 4 and all(0 <= s <= SEED_MASK for s in seeds)  # int32-safe (0.5.3 stores int32)
    assert [len(o.samples) for o in outs] == [2, 2]
    s0, s1 = outs[0].samples
    assert s0.token_ids == [100, 200, 959] and s0.finish_reason == "stop"
    assert s1.token_ids == [101, 200] and s1.finish_reason == "length"
    # greedy and "never stop": temperature 0, no top-k (-1), ignore_eos, no seed
    engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=2, stop_token_ids=()))
    sp = fake.calls[-1][2][0]
    assert sp["temperature"] == 0.0 and sp["top_k"] == -1 and sp["ignore_eos"] is True
    assert "sampling_seed" not in sp and "stop_token_ids" not in sp
    engine.processes.pids.clear()
    engine.shutdown()


def test_logprobs_are_full_vocabulary_under_top_k(engine):
    """SGLang's log-probs under top-k are log_softmax(logits / T) over the whole vocabulary — what the actor
    recomputes — not renormalised over the kept tokens like the native engine's; the backend says so."""
    e, _ = engine
    assert e.logprobs_renormalised is False
    T, k = 0.7, 5
    s = e.generate([[7, 8]], SamplingParams(temperature=T, top_k=k, max_new_tokens=3, stop_token_ids=()))[0].samples[0]
    prev = [8] + s.token_ids[:-1]
    trainer = [full_vocab_logprob(p, t, T) for p, t in zip(prev, s.token_ids)]
    assert s.logprobs == pytest.approx(trainer, abs=1e-12)  # the rollout-vs-trainer difference is numerics only


def test_aborted_request_raises(engine):
    e, fake = engine
    fake.generate = lambda **kw: [{"meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "abort"}}}]
    with pytest.raises(RuntimeError, match="abort"):
        e.generate([[1, 2]], SamplingParams(max_new_tokens=3))


def buckets():
    return [[("model.norm.weight", torch.ones(64))], [("model.embed_tokens.weight", torch.ones(2))],
            [("lm_head.weight", torch.ones(3))]]


@pytest.mark.parametrize("version", ["0.5.23", "0.5.3"])
def test_one_session_per_sync_and_one_flush(fake_sglang_module, tiny_model_dir, version):
    fake_sglang_module(version)
    e = build_rollout_engine("sglang", tiny_model_dir("qwen2"), **NO_GPU)
    fake = FakeEngine.instances[-1]
    sessions = isinstance(fake, FakeSessionEngine)
    assert sessions == (version == "0.5.23")
    for b in buckets():
        e.update_weights(b)
    begin = ["begin"] if sessions else []
    assert fake.names() == begin + ["update"] * 3
    assert all(c[3] is False for c in fake.calls if c[0] == "update")  # no flush per bucket
    e.generate([[1]], SamplingParams(max_new_tokens=2))
    assert fake.names() == begin + ["update"] * 3 + (["end"] if sessions else []) + ["flush", "generate"]
    # trainer order at sleep level 1: sleep -> sync -> wake: the session closes before resume, one flush after it
    fake.calls.clear()
    e.sleep(1)
    for b in buckets():
        e.update_weights(b)
    e.wake()
    assert fake.names() == ["release"] + begin + ["update"] * 3 + (["end"] if sessions else []) + \
        ["resume", "flush"]
    assert fake.calls[0] == ("release", ["kv_cache"]) and fake.calls[-2] == ("resume", ["kv_cache"])
    # level 2: weights dropped, sync after wake
    fake.calls.clear()
    e.sleep(2)
    e.wake()
    with pytest.raises(RuntimeError, match="update_weights"):
        e.generate([[1]], SamplingParams(max_new_tokens=2))
    e.update_weights(buckets()[0])
    assert len(e.generate([[1]], SamplingParams(max_new_tokens=2))) == 1
    assert fake.names() == ["release", "resume", "flush"] + begin + ["update"] + (["end"] if sessions else []) + \
        ["flush", "generate"]
    assert fake.calls[0] == ("release", ["kv_cache", "weights", "cuda_graph"])
    e.processes.pids.clear()
    e.shutdown()


def test_fake_refuses_updates_outside_a_session():
    """The fake models 0.5.21's scheduler: an update outside begin/end is refused in its returned status only."""
    state = ProcessState.capture()
    fake = FakeSessionEngine(model_path="m")  # changes the process as SGLang would: put back below
    try:
        ret = fake.update_weights_from_tensor([("w", torch.ones(1))], load_format=None, flush_cache=False)
        assert ret[0] is False
        with pytest.raises(RuntimeError, match="must run between begin_weight_update"):
            check_status("update_weights_from_tensor", ret)
    finally:
        fake.loop.close()
        state.restore()


def test_failed_update_raises_with_sglangs_message(engine):
    e, fake = engine
    e.update_weights(buckets()[0])
    fake.fail_next_update = "Failed to update weights: shape mismatch for model.norm.weight"
    with pytest.raises(RuntimeError, match="shape mismatch for model.norm.weight"):
        e.update_weights(buckets()[1])


def test_failed_flush_raises(engine):
    e, fake = engine
    e.update_weights(buckets()[0])
    fake.flush_ok = False
    with pytest.raises(RuntimeError, match="flush_cache failed"):
        e.generate([[1]], SamplingParams(max_new_tokens=2))


def test_old_sglang_and_original_logprob_env_are_refused(fake_sglang_module, tiny_model_dir, monkeypatch):
    fake_sglang_module("0.5.1")
    with pytest.raises(ImportError, match=r"sglang>=0\.5\.3 \(found 0\.5\.1\)"):
        build_rollout_engine("sglang", tiny_model_dir("qwen2"), **NO_GPU)
    fake_sglang_module("0.5.23")
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        build_rollout_engine("sglang", tiny_model_dir("qwen2"), **NO_GPU)


def test_hosting_process_is_left_as_it_was(fake_sglang_module, tiny_model_dir, monkeypatch):
    fake_sglang_module("0.5.23")
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    mine = signal.getsignal(signal.SIGQUIT)
    term = signal.getsignal(signal.SIGTERM)
    start = mp.get_start_method(allow_none=True)
    e = build_rollout_engine("sglang", tiny_model_dir("qwen2"), **NO_GPU)
    fake = FakeEngine.instances[-1]
    assert os.environ["NCCL_CUMEM_ENABLE"] == "1" and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    assert "SGLANG_RUN_ID" not in os.environ
    assert signal.getsignal(signal.SIGQUIT) is mine and mp.get_start_method(allow_none=True) == start
    e.generate([[1]], SamplingParams(max_new_tokens=2))
    assert fake._loop_handlers  # the fake did add its loop handler ...
    assert fake.loop.remove_signal_handler(signal.SIGTERM) is False  # ... and it was taken off again
    assert signal.getsignal(signal.SIGTERM) is term
    e.processes.pids.clear()
    e.shutdown()


def test_process_state_restores_what_changed(monkeypatch):
    monkeypatch.setenv("KEEP_ME", "a")
    state = ProcessState.capture()
    os.environ["KEEP_ME"] = "b"
    os.environ["ADDED_BY_SGLANG"] = "x"
    state.restore()
    assert os.environ["KEEP_ME"] == "a" and "ADDED_BY_SGLANG" not in os.environ


def test_shutdown_ends_only_the_engines_processes(fake_sglang_module, tiny_model_dir, monkeypatch):
    """A child started before the engine (a reward worker) survives; the engine's own child is ended."""
    fake_sglang_module("0.5.23")
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        monkeypatch.setattr(FakeEngine, "spawn_child", True)
        e = build_rollout_engine("sglang", tiny_model_dir("qwen2"), **NO_GPU)
        child = FakeEngine.instances[-1].child
        assert e.processes.pids == {child.pid}
        e.shutdown()  # the fake's Engine.shutdown() would raise: it is not called
        assert child.wait(timeout=30) is not None
        assert worker.poll() is None and psutil.Process(worker.pid).is_running()
        e.shutdown()  # idempotent
    finally:
        worker.kill()
        worker.wait()


def test_static_memory_fraction():
    gib = 2 ** 30
    # 40% of an 80 GiB GPU with 50 GiB free (actor etc. hold 30): SGLang's fraction of what is free
    assert static_memory_fraction(0.4, 80 * gib, 50 * gib, 2 * gib) == pytest.approx(32 / 50)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.6 asks SGLang for 48.00 GiB.*at most 0.562"):
        static_memory_fraction(0.6, 80 * gib, 50 * gib)
    with pytest.raises(ValueError, match="nothing is left for the KV cache"):
        static_memory_fraction(0.05, 80 * gib, 50 * gib, 5 * gib)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\)"):
        static_memory_fraction(1.0, 80 * gib, 80 * gib)


def test_engine_ports():
    assert engine_ports(30000, 0, 1) == (30000, 30001)
    assert engine_ports(30000, 7, 1) == (30014, 30015)
    assert engine_ports(30000, 6, 2) == (30006, 30007)  # the owner of GPUs 6-7 is engine 3 on its node
    with pytest.raises(ValueError, match="port_base=65534"):
        engine_ports(65534, 2, 1)


def test_no_cuda_without_explicit_fraction_is_an_error(fake_sglang_module, tiny_model_dir):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    fake_sglang_module("0.5.23")
    with pytest.raises(RuntimeError, match="needs CUDA GPUs"):
        build_rollout_engine("sglang", tiny_model_dir("qwen2"))
    assert FakeEngine.instances == []


def test_missing_sglang_gives_actionable_error(monkeypatch, tiny_model_dir):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import fails
    with pytest.raises(ImportError, match="rollout.name=native"):
        build_rollout_engine("sglang", tiny_model_dir("qwen2"))


def test_one_engine_per_tp_group(tiny_model_dir, tmp_path):
    """torchrun, 4 gloo ranks, rollout TP=2: tests/scripts/sglang_tp_cases.py."""
    # CPU ranks (gloo), also on a GPU machine: 4 ranks on fewer GPUs would share one, which the layout check refuses
    launcher.run("tests/scripts/sglang_tp_cases.py", "--model", str(tiny_model_dir("qwen2")), "--out", str(tmp_path),
                 nproc=4, env_extra=launcher.CPU)
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["engines"] == [1, 0, 1, 0]  # one engine per group, on its first rank
    assert r["ports"] == [[30000, 30001], None, [30002, 30003], None]
    assert r["tp_size"] == [2, None, 2, None]
    # ranks 0 and 1 sent the same prompts: generated once; ranks 2 and 3 sent different prompts: one call
    assert r["generate_calls"] == [[2], None, [4], None]
    assert r["outputs"][0] == r["outputs"][1] and r["outputs"][2] != r["outputs"][3]
    assert r["first_tokens"] == [[100, 101], [100, 101], [100, 101, 102], [103]]
    assert r["update_calls"] == [["begin", "update", "update", "end", "flush"], None] * 2
    assert all("boom" in msg for msg in r["failure"])  # the owner's failure is raised on every rank of its group
    assert "on rank 0, which owns" in r["failure"][1] and "on rank 2, which owns" in r["failure"][3]


def test_sglang_engine_generates(tiny_model_dir):
    """The real thing: needs sglang and a GPU."""
    pytest.importorskip("sglang")
    if not torch.cuda.is_available():
        pytest.skip("SGLang needs a CUDA GPU")
    engine = build_rollout_engine("sglang", tiny_model_dir("qwen2"), gpu_memory_utilization=0.2)
    try:
        prompts = [[1, 2, 3, 4], [5, 6, 7]]
        params = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=())
        a = engine.generate(prompts, params)
        assert [len(o.samples[0].token_ids) for o in a] == [8, 8]
        assert all(s.finish_reason == "length" for o in a for s in o.samples)
        assert engine.sleep(2) >= 0
        engine.wake()
        from rlhf_mcore.rollout.native.weights import iter_safetensors

        engine.update_weights(iter_safetensors(tiny_model_dir("qwen2")))
        assert [o.samples[0].token_ids for o in engine.generate(prompts, params)] == \
            [o.samples[0].token_ids for o in a]
    finally:
        engine.shutdown()
