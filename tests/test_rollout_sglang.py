"""SGLang backend.

`test_sglang_engine_generates` runs the real SGLang engine and is skipped where sglang is not importable
(always, on this project's machines). The other tests replace the `sglang` module with a fake that records
calls and answers in SGLang's documented output format: they check OUR translation (sampling parameters,
n-expansion, seeds, output parsing, sleep/wake tags, weight updates) — not SGLang's behaviour.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from rlhf_mcore.rollout import SamplingParams, build_rollout_engine


class FakeEngine:
    """Answers each request with 3 tokens: 100 + request index, 200, then 959 (a stop id) for even requests."""

    instances: list["FakeEngine"] = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []
        FakeEngine.instances.append(self)

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False):
        self.calls.append(("generate", input_ids, sampling_params, return_logprob))
        outs = []
        for i, sp in enumerate(sampling_params):
            ids = [100 + i, 200] + ([959] if i % 2 == 0 else [])
            ids = ids[:sp["max_new_tokens"]]
            outs.append({"output_ids": ids, "meta_info": {
                "output_token_logprobs": [(-0.5 * (k + 1), t, None) for k, t in enumerate(ids)],
                "finish_reason": {"type": "stop", "matched": 959} if ids[-1] == 959 else {"type": "length",
                                                                                         "length": len(ids)},
                "completion_tokens": len(ids)}})
        return outs

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", [n for n, _ in named_tensors], load_format, flush_cache))

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))

    def flush_cache(self):
        self.calls.append(("flush",))

    def shutdown(self):
        self.calls.append(("shutdown",))


@pytest.fixture
def fake_sglang(monkeypatch):
    FakeEngine.instances.clear()
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeEngine))
    return FakeEngine


def test_engine_construction_and_generate_translation(fake_sglang, tiny_model_dir):
    d = tiny_model_dir("qwen2")
    engine = build_rollout_engine("sglang", d, tp_size=2, mem_fraction_static=0.4, base_gpu_id=3)
    fake = fake_sglang.instances[-1]
    assert fake.kwargs == dict(model_path=str(d), tp_size=2, mem_fraction_static=0.4, enable_memory_saver=True,
                               base_gpu_id=3, skip_tokenizer_init=True, random_seed=0)
    prompts = [[1, 2, 3], [4, 5]]
    outs = engine.generate(prompts, SamplingParams(n=2, temperature=0.8, top_k=5, max_new_tokens=7, seed=1))
    _, input_ids, sps, return_logprob = fake.calls[-1]
    assert return_logprob and input_ids == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]  # n expanded per prompt
    assert all(sp["temperature"] == 0.8 and sp["top_k"] == 5 and sp["top_p"] == 1.0 and sp["max_new_tokens"] == 7
               and sp["stop_token_ids"] == [959, 957] and "ignore_eos" not in sp for sp in sps)
    assert len({sp["sampling_seed"] for sp in sps}) == 4  # one stream per (request, sample)
    assert [len(o.samples) for o in outs] == [2, 2]
    s0, s1 = outs[0].samples
    assert s0.token_ids == [100, 200, 959] and s0.finish_reason == "stop" and s0.logprobs == [-0.5, -1.0, -1.5]
    assert s1.token_ids == [101, 200] and s1.finish_reason == "length"
    # greedy and "never stop": temperature 0, no top-k (-1), ignore_eos, no seed
    engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=2, stop_token_ids=()))
    sp = fake.calls[-1][2][0]
    assert sp["temperature"] == 0.0 and sp["top_k"] == -1 and sp["ignore_eos"] is True
    assert "sampling_seed" not in sp and "stop_token_ids" not in sp


def test_aborted_request_raises(fake_sglang, tiny_model_dir):
    engine = build_rollout_engine("sglang", tiny_model_dir("qwen2"))
    fake = fake_sglang.instances[-1]
    fake.generate = lambda **kw: [{"meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "abort"}}}]
    with pytest.raises(RuntimeError, match="abort"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))


def test_weights_sleep_and_wake(fake_sglang, tiny_model_dir):
    engine = build_rollout_engine("sglang", tiny_model_dir("qwen2"))
    fake = fake_sglang.instances[-1]
    engine.update_weights(iter([("model.norm.weight", torch.ones(64)), ("model.embed_tokens.weight", torch.ones(2))]))
    assert fake.calls[-1] == ("update", ["model.norm.weight", "model.embed_tokens.weight"], None, True)
    engine.sleep(1)
    assert fake.calls[-1] == ("release", ["kv_cache"])
    engine.wake()
    assert fake.calls[-2:] == [("resume", ["kv_cache"]), ("flush",)]
    engine.sleep(2)
    assert fake.calls[-1] == ("release", ["kv_cache", "weights", "cuda_graph"])
    engine.wake()
    assert fake.calls[-2] == ("resume", ["kv_cache", "weights", "cuda_graph"])
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2))
    engine.update_weights([("model.norm.weight", torch.ones(64))])
    assert len(engine.generate([[1]], SamplingParams(max_new_tokens=2))) == 1
    engine.shutdown()
    assert fake.calls[-1] == ("shutdown",)


def test_missing_sglang_gives_actionable_error(monkeypatch, tiny_model_dir):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import fails
    with pytest.raises(ImportError, match="rollout.name=native"):
        build_rollout_engine("sglang", tiny_model_dir("qwen2"))


def test_sglang_engine_generates(tiny_model_dir):
    """The real thing: needs sglang and a GPU."""
    pytest.importorskip("sglang")
    if not torch.cuda.is_available():
        pytest.skip("SGLang needs a CUDA GPU")
    engine = build_rollout_engine("sglang", tiny_model_dir("qwen2"), mem_fraction_static=0.2)
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
