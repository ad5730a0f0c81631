"""The Hugging Face reference backend: log-probs of the distribution actually sampled from, stop handling,
weight updates, and agreement with the native engine.

Both engines run on the CPU in fp32, on a GPU machine too: their greedy agreement is exact only in fp32 with the same
attention (bf16 or TF32 on a GPU flips near-tied tokens)."""

from __future__ import annotations

import pytest
import torch

from rlhf_mcore.rollout import SamplingParams, build_rollout_engine
from rlhf_mcore.rollout.native.weights import iter_safetensors

DEVICE = "cpu"  # see the module docstring


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny shapes run as fast on one thread, and stay fast when other jobs load the shared CPUs."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 900, (int(k),), generator=g).tolist() for k in torch.randint(3, 30, (n,), generator=g)]


def tokens(outputs):
    return [[s.token_ids for s in o.samples] for o in outputs]


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    return build_rollout_engine("hf", tiny_model_dir("qwen2"), batch_size=3, device=DEVICE)


def forward_logits(engine, prompt, response):
    with torch.inference_mode():
        return engine.model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()


def test_logprobs_follow_the_sampled_distribution(hf_engine):
    prompts = make_prompts(4, seed=1)  # batch_size=3: two left-padded batches
    out = hf_engine.generate(prompts, SamplingParams(n=2, temperature=0.7, max_new_tokens=10, seed=0,
                                                     stop_token_ids=()))
    for p, o in zip(prompts, out):
        assert o.prompt_ids == p and len(o.samples) == 2
        for s in o.samples:
            assert len(s.token_ids) == len(s.logprobs) == 10 and s.finish_reason == "length"
            logits = forward_logits(hf_engine, p, s.token_ids) / 0.7
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=0)
    # top-k: log-probs are renormalised over the kept tokens
    out = hf_engine.generate(prompts[:2], SamplingParams(temperature=1.0, top_k=3, max_new_tokens=6, seed=0,
                                                         stop_token_ids=()))
    for p, o in zip(prompts, out):
        s = o.samples[0]
        top = torch.topk(forward_logits(hf_engine, p, s.token_ids), 3)
        renorm = torch.log_softmax(top.values, -1)
        ref = [renorm[i, row.tolist().index(t)].item() for i, (t, row) in enumerate(zip(s.token_ids, top.indices))]
        assert s.logprobs == pytest.approx(ref, abs=1e-4)


def test_seeded_runs_reproduce(hf_engine):
    prompts = make_prompts(2, seed=2)
    p = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=4, stop_token_ids=())
    assert tokens(hf_engine.generate(prompts, p)) == tokens(hf_engine.generate(prompts, p))


def test_stop_tokens_cut_responses(hf_engine):
    prompts = make_prompts(3, seed=3)
    free = hf_engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=()))
    stop = free[1].samples[0].token_ids[2]
    cut = hf_engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,)))
    for f, c in zip(free, cut):
        full = f.samples[0].token_ids
        expect = full[:full.index(stop) + 1] if stop in full else full
        assert c.samples[0].token_ids == expect
        assert c.samples[0].finish_reason == ("stop" if stop in full else "length")


def test_native_and_hf_agree_in_validation_mode(tiny_model_dir, hf_engine):
    """Greedy validation mode, several stop ids, different prompt lengths: identical samples and finish reasons."""
    native = build_rollout_engine("native", tiny_model_dir("qwen2"), max_num_seqs=4, max_model_len=96,
                                  device=DEVICE)
    assert native.default_stop_token_ids == hf_engine.default_stop_token_ids == (959, 957)
    prompts = make_prompts(5, seed=4)
    free = native.generate(prompts, SamplingParams.for_validation(max_new_tokens=30, stop_token_ids=()))
    stops = (free[0].samples[0].token_ids[5], free[2].samples[0].token_ids[11], 959)
    params = SamplingParams.for_validation(max_new_tokens=30, stop_token_ids=stops)
    a, b = hf_engine.generate(prompts, params), native.generate(prompts, params)
    assert tokens(a) == tokens(b)
    reasons = [o.samples[0].finish_reason for o in a]
    assert reasons == [o.samples[0].finish_reason for o in b] and "stop" in reasons
    for x, y in zip(a, b):
        assert x.samples[0].logprobs == pytest.approx(y.samples[0].logprobs, abs=1e-4)


def test_update_weights_and_sleep(tiny_model_dir):
    engine = build_rollout_engine("hf", tiny_model_dir("llama"), device=DEVICE)
    other = build_rollout_engine("hf", tiny_model_dir("llama", seed=1), device=DEVICE)
    prompts = make_prompts(2, seed=5)
    params = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=())
    target = tokens(other.generate(prompts, params))
    assert tokens(engine.generate(prompts, params)) != target
    engine.update_weights(iter_safetensors(tiny_model_dir("llama", seed=1)))
    assert tokens(engine.generate(prompts, params)) == target
    assert engine.sleep(1) == 0  # transformers keeps no KV cache between calls
    engine.wake()
    assert tokens(engine.generate(prompts, params)) == target
    with pytest.raises(KeyError, match="not a parameter"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
