"""The native rollout engine against transformers (greedy tokens, log-probs) and against itself (batching,
seeding, stop/length handling, weight updates, sleep/wake, tensor parallelism, the Triton kernels).

Every engine here runs on the CPU in fp32, on a GPU machine too: greedy parity with transformers is exact only
where both sides compute in fp32 with the same kernels (bf16, TF32 or the Triton attention on a GPU flip near-tied
tokens). The GPU paths are checked against these references by tests/test_rollout_native_gpu.py."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from subprocess_env import child_env

from rlhf_mcore.rollout import SamplingParams, build_rollout_engine
from rlhf_mcore.rollout.base import Request
from rlhf_mcore.rollout.native.engine import NativeRolloutEngine
from rlhf_mcore.rollout.native.weights import iter_safetensors

pytestmark = pytest.mark.cost(65)

ARCHS = ["qwen2", "llama", "qwen3"]
REPO = Path(__file__).resolve().parents[1]
DEVICE = "cpu"  # see the module docstring


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny shapes run as fast on one thread, and stay fast when other jobs load the shared CPUs."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_prompts(n: int, seed: int = 0, vocab: int = 900, lengths=(3, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lengths[0], lengths[1], (n,), generator=g)
    return [torch.randint(0, vocab, (int(n_),), generator=g).tolist() for n_ in lens]


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def teacher_forced_logprobs(model, prompt, response, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at each response token, from one forward pass over prompt + response."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def tokens(outputs) -> list[list[list[int]]]:
    return [[s.token_ids for s in o.samples] for o in outputs]


@pytest.fixture(scope="module")
def hf_models(tiny_model_dir):
    from transformers import AutoModelForCausalLM  # imported here: TP worker processes re-import this module

    return {a: AutoModelForCausalLM.from_pretrained(tiny_model_dir(a)).eval() for a in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers(tiny_model_dir, hf_models, arch):
    prompts = make_prompts(5, seed=1)
    engine = build_rollout_engine("native", tiny_model_dir(arch), max_num_seqs=8, max_model_len=96, device=DEVICE)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=()))
    for p, o in zip(prompts, outs):
        assert o.prompt_ids == p and len(o.samples) == 1
        assert o.samples[0].token_ids == hf_greedy(hf_models[arch], p, 16)
        assert o.samples[0].finish_reason == "length"
    # greedy log-probs are under the temperature-1 distribution
    s = outs[0].samples[0]
    ref = teacher_forced_logprobs(hf_models[arch], prompts[0], s.token_ids, 1.0)
    torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_logprobs_equal_teacher_forcing_with_temperature(tiny_model_dir, hf_models, arch):
    prompts = make_prompts(3, seed=2)
    engine = NativeRolloutEngine(tiny_model_dir(arch), max_num_seqs=4, max_model_len=96, device=DEVICE)
    outs = engine.generate(prompts, SamplingParams(n=2, temperature=0.7, max_new_tokens=12, seed=3,
                                                   stop_token_ids=()))
    for p, o in zip(prompts, outs):
        assert len(o.samples) == 2 and o.samples[0].token_ids != o.samples[1].token_ids
        for s in o.samples:
            assert len(s.logprobs) == len(s.token_ids) == 12
            ref = teacher_forced_logprobs(hf_models[arch], p, s.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_new_tokens=10),
                                    SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=7)],
                         ids=["greedy", "seeded"])
def test_continuous_batching_equals_one_at_a_time(tiny_model_dir, params):
    d = tiny_model_dir("llama")
    prompts = make_prompts(6, seed=4)
    small = NativeRolloutEngine(d, max_num_seqs=2, max_model_len=64, device=DEVICE)  # fewer slots than sequences
    batched = small.generate(prompts, params)
    assert small.last_stats["prefills"] > 1  # sequences were admitted while others were running
    wide = NativeRolloutEngine(d, max_num_seqs=32, max_model_len=64, device=DEVICE).generate(prompts, params)
    alone = [small.generate([p], params, request_ids=[i])[0] for i, p in enumerate(prompts)]
    assert tokens(batched) == tokens(wide) == tokens(alone)
    for a, b in zip(batched, alone):
        for sa, sb in zip(a.samples, b.samples):
            torch.testing.assert_close(torch.tensor(sa.logprobs), torch.tensor(sb.logprobs), atol=1e-5, rtol=0)


def test_one_decode_step_in_flight_and_none_wasted_at_the_cap(tiny_model_dir):
    """The engine launches step t+1 before it reads step t back (engine._decode_once). Rows that all run to their
    caps take exactly cap - 1 decode steps (the first token comes from the prefill): no step is launched once every
    row is certain to be done. A row that stopped at step t and ran once more at t+1 is reported once, with the
    tokens it had at t. Mutations: launching regardless of the caps -> 12 decode steps for 11; reading back the
    flagged rows of a step without skipping those that finished before it -> a KeyError in the compaction;
    num_pending without the rows whose tokens are still being copied back -> the stopped request is never returned."""
    d = tiny_model_dir("llama")
    engine = NativeRolloutEngine(d, max_num_seqs=8, max_model_len=64, device=DEVICE)
    prompts = make_prompts(4, seed=12)
    capped = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3,
                                                     stop_token_ids=()))
    assert all(len(s.token_ids) == 12 for o in capped for s in o.samples)
    assert engine.last_stats["decode_steps"] == 11
    engine.open_stream(SamplingParams(temperature=1.0, max_new_tokens=12, seed=3, stop_token_ids=()))
    engine.submit([Request(0, prompts[0]), Request(1, prompts[1], max_new_tokens=5)])
    assert engine.step() == [] and engine._inflight is not None  # one step launched, not read back yet
    engine.close_stream()
    # stop ids that end rows at different steps: each row once, cut at its own stop, equal to a one-row run
    free = capped[0].samples[0].token_ids
    stops = (free[2], capped[1].samples[0].token_ids[4])
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3, stop_token_ids=stops)
    batched = engine.generate(prompts, params)
    alone = [engine.generate([p], params, request_ids=[i])[0] for i, p in enumerate(prompts)]
    assert tokens(batched) == tokens(alone)
    assert any(s.finish_reason == "stop" for o in batched for s in o.samples)
    # the last row stops with a step still in flight: its tokens are still on their way to the host, and the
    # request counts as pending until the next step() returns it
    greedy = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=())
    third = engine.generate(prompts[:1], greedy)[0].samples[0].token_ids[:3]
    engine.open_stream(SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(third[2],)))
    engine.submit([Request(0, prompts[0])])
    back = []
    while engine.num_pending:
        back += engine.step()
    engine.close_stream()
    assert [(f.sample.token_ids, f.sample.finish_reason) for f in back] == [(third[:third.index(third[2]) + 1],
                                                                              "stop")]
    # rows reaching their caps at different steps: a capped row stays flagged while the others run on
    caps = [3, 12, 6, 9]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3, stop_token_ids=())
    staggered = engine.generate(prompts, params, max_new_tokens=caps)
    assert [[len(s.token_ids) for s in o.samples] for o in staggered] == [[c, c] for c in caps]
    assert tokens(staggered) == [[s.token_ids[:c] for s in o.samples] for o, c in zip(capped, caps)]


def test_several_decode_steps_a_launch_equal_one(tiny_model_dir):
    """`decode_steps_per_launch=3`: three decode steps a launch (one CUDA-graph replay on GPU) before the finished
    flags are read back give the tokens, log-probs, finish reasons and decode-step count of one step a launch --
    rows stopping at different steps inside a launch, staggered caps, more sequences than slots (admission between
    launches), a stream aborted and continued. Mutation: the finished flag not kept inside a launch (a flagged row
    advances and records the next steps' tokens, `done` recomputed from them) -> rows run past their stop tokens
    and caps, fails."""
    d = tiny_model_dir("llama")
    prompts = make_prompts(5, seed=12)
    one = NativeRolloutEngine(d, max_num_seqs=4, max_model_len=64, device=DEVICE)
    three = NativeRolloutEngine(d, max_num_seqs=4, max_model_len=64, device=DEVICE, decode_steps_per_launch=3)
    free = one.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=14, seed=5, stop_token_ids=()))
    stops = (free[0].samples[0].token_ids[4], free[2].samples[1].token_ids[7])
    for params, caps in ((SamplingParams(n=2, temperature=1.0, max_new_tokens=14, seed=5, stop_token_ids=stops),
                          None),
                         (SamplingParams(n=2, temperature=1.0, max_new_tokens=14, seed=5, stop_token_ids=()),
                          [2, 14, 5, 9, 13])):
        a = one.generate(prompts, params, max_new_tokens=caps)
        steps_one = one.last_stats["decode_steps"]
        b = three.generate(prompts, params, max_new_tokens=caps)
        assert tokens(b) == tokens(a)
        assert [[s.finish_reason for s in o.samples] for o in b] == [[s.finish_reason for s in o.samples] for o in a]
        for x, y in zip(a, b):  # the batches differ (finished rows stay to the end of a launch): last bits only
            for sx, sy in zip(x.samples, y.samples):
                torch.testing.assert_close(torch.tensor(sy.logprobs), torch.tensor(sx.logprobs), atol=1e-5, rtol=0)
        assert three.last_stats["generated_tokens"] == one.last_stats["generated_tokens"]
        assert three.last_stats["decode_steps"] >= steps_one
        reasons = {s.finish_reason for o in a for s in o.samples}
        assert reasons == ({"length"} if caps else {"stop", "length"}), reasons
    # abort mid-stream, then continue from the returned tokens: the rows of a launch come back as they stood
    params = SamplingParams(temperature=1.0, max_new_tokens=14, seed=5, stop_token_ids=())
    three.open_stream(params)
    three.submit([Request(i, p) for i, p in enumerate(prompts[:3])])
    for _ in range(3):
        three.step()
    cut = three.abort()
    three.close_stream()
    assert {f.sample.finish_reason for f in cut} == {"abort"}
    assert all(0 < len(f.sample.token_ids) < 14 for f in cut)
    three.open_stream(params)
    three.submit([Request(f.request.request_id, f.request.prompt_ids, prefix=f.sample) for f in cut])
    done = []
    while three.num_pending:
        done += three.step()
    three.close_stream()
    ref = one.generate(prompts[:3], params)
    assert sorted((f.request.request_id, f.sample.token_ids) for f in done) == [
        (i, o.samples[0].token_ids) for i, o in enumerate(ref)]


def test_seeds_reproduce_and_differ(tiny_model_dir):
    engine = NativeRolloutEngine(tiny_model_dir("qwen2"), max_num_seqs=8, max_model_len=64, device=DEVICE)
    prompts = make_prompts(3, seed=5)
    p = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=11, stop_token_ids=())
    a, b = engine.generate(prompts, p), engine.generate(prompts, p)
    c = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=12, stop_token_ids=()))
    assert tokens(a) == tokens(b) and tokens(a) != tokens(c)
    assert all(len(o.samples) == 4 and len({tuple(s.token_ids) for s in o.samples}) > 1 for o in a)


def test_sampling_follows_the_model_distribution(tiny_model_dir, hf_models):
    """First-token frequencies over 400 seeded samples match softmax(logits / T) within 4 standard errors."""
    engine = NativeRolloutEngine(tiny_model_dir("qwen2"), max_num_seqs=400, max_model_len=64, device=DEVICE)
    prompt = make_prompts(1, seed=6)[0]
    n, temp = 400, 1.3
    out = engine.generate([prompt], SamplingParams(n=n, temperature=temp, max_new_tokens=1, seed=0))[0]
    first = torch.tensor([s.token_ids[0] for s in out.samples])
    with torch.inference_mode():
        probs = torch.softmax(hf_models["qwen2"](torch.tensor([prompt])).logits[0, -1] / temp, -1)
    for tok in torch.topk(probs, 3).indices:
        p = probs[tok].item()
        freq = (first == tok).float().mean().item()
        assert abs(freq - p) < 4 * (p * (1 - p) / n) ** 0.5 + 1e-3, (tok, freq, p)


def test_inverse_cdf_sampler_against_a_naive_loop():
    """`sampling.inverse_cdf` (the reference sampler: the first token whose cumulative probability exceeds the
    draw) against a loop that adds probabilities token by token, on rows with excluded (-inf) tokens; a draw
    rounded past the last sum takes the last token of positive probability; `uniform_draw` is a function of
    (key, step) alone and uniform. Mutations: the search's `right=True` -> False with a draw on a boundary
    (row 3) picks the token before; no clamp -> the draw at 1 returns an excluded token (or V)."""
    from rlhf_mcore.rollout.native.sampling import inverse_cdf, uniform_draw

    g = torch.Generator().manual_seed(3)
    x = 2 * torch.randn(5, 64, generator=g)
    x[1, 40:] = float("-inf")  # an excluded tail (top-k / top-p)
    x[2, ::2] = float("-inf")
    x[3] = 0.0  # 64 equal probabilities, exact in binary: a draw of 0.5 lands on the 32nd boundary exactly
    u = torch.tensor([0.3, 1.0, 0.77, 0.5, 1e-12], dtype=torch.float64)
    got = inverse_cdf(x, u)
    for b in range(5):
        p = torch.softmax(x[b].double(), -1)
        acc, want = 0.0, int(torch.nonzero(p > 0).max())  # the clamp: the last token of positive probability
        for i in range(64):
            acc += float(p[i])
            if p[i] > 0 and acc > float(u[b]) * float(p.sum()):
                want = i
                break
        assert int(got[b]) == want, (b, int(got[b]), want)
    assert int(got[1]) == 39 and int(got[3]) == 32
    keys, steps = torch.randint(0, 2**32, (20000,), generator=g), torch.randint(0, 10**6, (20000,), generator=g)
    draws = uniform_draw(keys, steps)
    assert ((draws > 0) & (draws < 1)).all()
    assert torch.equal(uniform_draw(keys[7:9], steps[7:9]), draws[7:9])  # no dependence on the batch
    assert abs(draws.mean().item() - 0.5) < 4 * (1 / 12 / 20000) ** 0.5
    hist = torch.histc(draws.float(), bins=10, min=0, max=1)
    assert (hist - 2000).abs().max() < 4 * (2000 * 0.9) ** 0.5, hist


def test_stop_tokens_max_length_and_defaults(tiny_model_dir):
    d = tiny_model_dir("llama")
    engine = NativeRolloutEngine(d, max_num_seqs=4, max_model_len=64, device=DEVICE)
    assert engine.default_stop_token_ids == (959, 957)  # generation_config: <|im_end|>, <|endoftext|>
    prompts = make_prompts(4, seed=7)
    free = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=()))
    stop = free[0].samples[0].token_ids[3]
    stopped = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,)))
    for f, s in zip(free, stopped):
        full, got = f.samples[0].token_ids, s.samples[0]
        if stop in full:
            cut = full.index(stop) + 1
            assert got.token_ids == full[:cut] and got.finish_reason == "stop"
            assert got.logprobs == pytest.approx(f.samples[0].logprobs[:cut], abs=1e-5)
        else:
            assert got.token_ids == full and got.finish_reason == "length"
    assert stopped[0].samples[0].token_ids[-1] == stop and len(stopped[0].samples[0].token_ids) <= 4
    one = engine.generate(prompts[:2], SamplingParams(temperature=0, max_new_tokens=1, stop_token_ids=()))
    assert [o.samples[0].token_ids for o in one] == [f.samples[0].token_ids[:1] for f in free[:2]]
    # ignore_eos generates exactly max_new_tokens even when a default stop id comes up
    exact = engine.generate(prompts, SamplingParams(n=2, temperature=1.5, max_new_tokens=20, seed=1, ignore_eos=True))
    assert all(len(s.token_ids) == 20 and s.finish_reason == "length" for o in exact for s in o.samples)


def test_top_k_and_top_p(tiny_model_dir, hf_models):
    engine = NativeRolloutEngine(tiny_model_dir("qwen2"), max_num_seqs=8, max_model_len=64, device=DEVICE)
    prompts = make_prompts(3, seed=8)
    greedy = tokens(engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=())))
    for p in (SamplingParams(n=2, temperature=1.0, top_k=1, max_new_tokens=8, seed=0, stop_token_ids=()),
              SamplingParams(n=2, temperature=1.0, top_p=1e-6, max_new_tokens=8, seed=0, stop_token_ids=())):
        out = engine.generate(prompts, p)
        assert [[s.token_ids for s in o.samples] for o in out] == [[g[0], g[0]] for g in greedy]
        assert all(lp == pytest.approx(0.0, abs=1e-6) for o in out for s in o.samples for lp in s.logprobs)
    out = engine.generate(prompts, SamplingParams(n=3, temperature=0.9, top_k=4, max_new_tokens=8, seed=2,
                                                  stop_token_ids=()))
    for prompt, o in zip(prompts, out):
        for s in o.samples:
            with torch.inference_mode():
                logits = hf_models["qwen2"](torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1:-1] / 0.9
            top = torch.topk(logits, 4)
            assert all(t in row.tolist() for t, row in zip(s.token_ids, top.indices))
            renorm = torch.log_softmax(top.values, -1)  # log-prob under the renormalised top-4 distribution
            ref = [renorm[i, row.tolist().index(t)].item() for i, (t, row) in enumerate(zip(s.token_ids, top.indices))]
            assert s.logprobs == pytest.approx(ref, abs=1e-4)


def test_update_weights_equals_engine_built_from_new_weights(tiny_model_dir):
    old, new = tiny_model_dir("qwen3"), tiny_model_dir("qwen3", seed=1)
    prompts = make_prompts(3, seed=9)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=5)
    engine = NativeRolloutEngine(old, max_num_seqs=4, max_model_len=64, device=DEVICE)
    reference = NativeRolloutEngine(new, max_num_seqs=4, max_model_len=64, device=DEVICE).generate(prompts, params)
    before = engine.generate(prompts, params)
    assert tokens(before) != tokens(reference)
    named = list(iter_safetensors(new))
    engine.update_weights(named[: len(named) // 2])  # in buckets, as the weight sync sends them
    engine.update_weights(named[len(named) // 2:])
    after = engine.generate(prompts, params)
    assert tokens(after) == tokens(reference)
    with pytest.raises(KeyError, match="model.layers.7"):
        engine.update_weights([("model.layers.7.mlp.up_proj.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match="expects"):
        engine.update_weights([("model.norm.weight", torch.zeros(65))])


def test_sleep_and_wake(tiny_model_dir):
    d = tiny_model_dir("qwen2")
    prompts = make_prompts(3, seed=10)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=1)
    engine = NativeRolloutEngine(d, max_num_seqs=4, max_model_len=64, weight_offload="drop", device=DEVICE)
    ref = engine.generate(prompts, params)
    cache_bytes = engine.cache.nbytes()
    assert engine.sleep(1) == cache_bytes > 0
    with pytest.raises(RuntimeError, match="wake"):
        engine.generate(prompts, params)
    engine.wake()
    assert tokens(engine.generate(prompts, params)) == tokens(ref)
    weight_bytes = engine.weights.nbytes()
    weight_ref, cache_ref = weakref.ref(engine.weights.layers[0].gate_up), weakref.ref(engine.cache.k)
    assert engine.sleep(2) == cache_bytes + weight_bytes
    gc.collect()
    assert weight_ref() is None and cache_ref() is None  # really released, not just reported
    with pytest.raises(RuntimeError, match="wake"):
        engine.update_weights(iter_safetensors(d))
    engine.wake()
    with pytest.raises(RuntimeError, match="update_weights"):  # dropped weights must be re-sent
        engine.generate(prompts, params)
    engine.update_weights(iter_safetensors(d))
    assert tokens(engine.generate(prompts, params)) == tokens(ref)
    with pytest.raises(ValueError, match="level"):
        engine.sleep(3)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"), (dict(n=0), "n="), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=0, n=4), "greedy"), (dict(seed=-1), "seed"), (dict(stop_token_ids=(-2,)), "stop_token_ids"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_and_engine_args(tiny_model_dir, tmp_path):
    d = tiny_model_dir("qwen2")
    engine = NativeRolloutEngine(d, max_num_seqs=2, max_model_len=32, device=DEVICE)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * 30], SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 5000]], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams(max_new_tokens=4))
    with pytest.raises(FileNotFoundError, match="model_dir"):
        NativeRolloutEngine(tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown rollout engine"):
        build_rollout_engine("vllm", d)


# --------------------------------------------------------------------------------------------------------
def _tp_worker(rank: int, world: int, model_dir: str, port: int, out_file: str, quantization=None,
               n_prompts: int = 4) -> None:
    import torch.distributed as dist

    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native import fp8 as native_fp8
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    torch.set_num_threads(1)
    if quantization:  # FP8 on the CPU: the reference GEMMs, the device check patched out (as tests/test_fp8.py does)
        native_fp8.check_fp8_device = lambda device, key: None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        engine = NativeRolloutEngine(model_dir, max_num_seqs=3, max_model_len=64, tp_group=dist.group.WORLD,
                                     device=DEVICE, quantization=quantization)
        prompts = make_prompts(n_prompts, seed=12)
        greedy = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=()))
        sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=3))
        if rank == 0:
            Path(out_file).write_text(json.dumps({"greedy": tokens(greedy), "sampled": tokens(sampled),
                                                  "lp": [s.logprobs for o in greedy for s in o.samples]}))
    finally:
        dist.destroy_process_group()


def _run_tp2(model_dir, out_file: Path, quantization=None, n_prompts: int = 4) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(2, str(model_dir), port, str(out_file), quantization, n_prompts), nprocs=2,
             join=True)
    return json.loads(out_file.read_text())


def test_tensor_parallel_2_equals_1(tiny_model_dir, tmp_path):
    d = tiny_model_dir("qwen2")  # 4 heads, 2 kv heads, MLP 128: each rank holds half
    tp2 = _run_tp2(d, tmp_path / "tp2.json")
    engine = NativeRolloutEngine(d, max_num_seqs=3, max_model_len=64, device=DEVICE)
    prompts = make_prompts(4, seed=12)
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=()))
    sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=3))
    assert tp2["greedy"] == tokens(greedy) and tp2["sampled"] == tokens(sampled)
    torch.testing.assert_close(torch.tensor(tp2["lp"]), torch.tensor([s.logprobs for o in greedy for s in o.samples]),
                               atol=1e-5, rtol=0)


def test_tensor_parallel_2_fp8_tracks_tp1(tiny_model_dir, tmp_path, monkeypatch):
    """FP8 rollout at TP=2 (CPU: the reference GEMMs; each rank quantizes its own shards, so the row-parallel
    o_proj and down have per-channel scales over half of K) against FP8 at TP=1, greedy, 8 prompts: wherever both
    runs have the same context and token (at least 20 steps), the log-probs within 0.5, FP8's own error here (FP8
    against fp32 at TP=1 on this model: 0.14 mean, 0.39 max over 34 steps; TP=2 against TP=1: 0.11 / 0.27 over 36).
    Mutation: `_out_proj` without the all-reduce when the layer has an FP8 copy -> each rank
    keeps half the sum and not one step matches."""
    from rlhf_mcore.rollout.native import fp8 as native_fp8

    d = tiny_model_dir("qwen2")
    tp2 = _run_tp2(d, tmp_path / "tp2_fp8.json", "fp8", n_prompts=8)
    monkeypatch.setattr(native_fp8, "check_fp8_device", lambda device, key: None)
    engine = NativeRolloutEngine(d, max_num_seqs=3, max_model_len=64, device=DEVICE, quantization="fp8")
    greedy = engine.generate(make_prompts(8, seed=12), SamplingParams(temperature=0, max_new_tokens=10,
                                                                     stop_token_ids=()))
    gaps = []
    for t2, lp2, o in zip(tp2["greedy"], tp2["lp"], greedy):  # one sample a prompt: "lp" has one row a prompt
        for j, (a, b) in enumerate(zip(t2[0], o.samples[0].token_ids)):
            if a != b:
                break
            gaps.append(abs(lp2[j] - o.samples[0].logprobs[j]))
    assert len(gaps) >= 20, f"only {len(gaps)} greedy steps with the same context at TP=2 and TP=1"
    gaps = torch.tensor(gaps)
    print(f"TP=2 vs TP=1 fp8: {len(gaps)} steps, |dlogprob| mean {gaps.mean():.4f} max {gaps.max():.4f}")
    assert gaps.max() <= 0.5


@pytest.mark.skipif(
    torch.cuda.is_available(), reason=
    "on a GPU machine the compiled kernels run for real (the GPU tests of this file and "
    "test_rollout_native_gpu.py); the interpreter of older triton releases (the one torch 2.11 ships) cannot "
    "run the sampler kernel")
def test_triton_kernels_match_torch_references_in_interpreter(tiny_model_dir):
    """The GPU kernels (attention, sampling, the decode GEMMs and their fused epilogues, element-wise ops) and the
    engine using all of them, run by Triton's CPU interpreter in fp32 against the torch paths. (The interpreter
    cannot do bf16 dot products, so bf16 numerics are checked on GPU by tests/test_rollout_native_gpu.py.)"""
    env = child_env(TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "--triton-interpret", str(tiny_model_dir("qwen3"))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ALL OK" in proc.stdout


def _triton_interpret_checks(model_dir: str) -> None:
    """Runs in a subprocess with TRITON_INTERPRET=1 (it must be set before the kernels are defined)."""
    from rlhf_mcore.rollout.native import triton_kernels as tk
    from rlhf_mcore.rollout.native.attention import decode_attention_torch
    from rlhf_mcore.rollout.native.model import rms_norm
    from rlhf_mcore.rollout.native.rope import apply_rope
    from rlhf_mcore.rollout.native.sampling import sample_torch

    _pdl_rule_check(tk)
    g = torch.Generator().manual_seed(0)
    # fused sampling: same tokens and log-probs as the torch sampler, greedy and sampled rows, V not a power of 2
    logits = 3 * torch.randn(6, 3000, generator=g)
    keys, steps = torch.randint(0, 2**32, (6,), generator=g), torch.randint(0, 999, (6,), generator=g)
    inv_t = torch.tensor([1.0, 1 / 0.7, 1.0, 2.0, 1.0, 1.0])
    greedy = torch.tensor([True, False, False, False, True, False])
    t1, l1 = tk.sample_fused(logits, keys, steps, inv_t, greedy)
    t2, l2 = sample_torch(logits, keys, steps, inv_t, greedy)
    assert torch.equal(t1, t2), (t1, t2)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=0)
    big = 3 * torch.randn(3, 20000, generator=g)  # several vocabulary chunks (one of them empty) merged
    t1, l1 = tk.sample_fused(big, keys[:3], steps[:3], inv_t[:3], greedy[:3])
    t2, l2 = sample_torch(big, keys[:3], steps[:3], inv_t[:3], greedy[:3])
    assert torch.equal(t1, t2), (t1, t2)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=0)
    # greedy ties go to the lowest vocabulary id, as torch.argmax, wherever the tied entries sit in the kernel's
    # (chunk, block, lane) layout (V = 20000: 8 chunks of 3 blocks of 1024). Mutation: a kernel that keeps a
    # best value per lane and merges the lanes by tl.argmax (the first lane at the maximum, not the lowest id)
    # -> row 0 picks 1029 (tried with such a kernel in session 10).
    tie = torch.zeros(3, 20000)
    tie[0, [1029, 900]] = 50.0  # lane 5 of a chunk's second block against lane 900 of its first
    tie[1, [2 * 3072 + 10, 3072 + 10]] = 50.0  # two chunks
    tie[2, [1024 + 1023, 1024 + 3, 2 * 1024 + 1]] = 50.0  # one block, and a later block's lower lane
    all_greedy, ones = torch.ones(3, dtype=torch.bool), torch.ones(3)
    t1, l1 = tk.sample_fused(tie, keys[:3], steps[:3], ones, all_greedy)
    t2, l2 = sample_torch(tie, keys[:3], steps[:3], ones, all_greedy)
    assert t2.tolist() == [900, 3072 + 10, 1024 + 3] and torch.equal(t1, t2), (t1, t2)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=0)
    # sampled rows over several chunks (V = 5000: 5 chunks of 1024), excluded (-inf) tokens, a row with one token
    # of positive probability: each row's token is the first whose cumulative probability exceeds its draw, as the
    # fp64 reference finds it. Mutations: the pick's remainder not less the chosen chunk's predecessors (`r = target`)
    # -> most rows differ; exps against the chunk's own max instead of the row's -> rows differ.
    many = 2 * torch.randn(64, 5000, generator=g)
    many[5, 1000:] = float("-inf")
    many[6, :4999] = float("-inf")
    many[7, ::3] = float("-inf")
    k64, s64 = torch.randint(0, 2**32, (64,), generator=g), torch.randint(0, 999, (64,), generator=g)
    sampled, t64 = torch.zeros(64, dtype=torch.bool), torch.full((64,), 1 / 0.9)
    t1, l1 = tk.sample_fused(many, k64, s64, t64, sampled)
    t2, l2 = sample_torch(many, k64, s64, t64, sampled)
    assert torch.equal(t1, t2) and t1[6] == 4999 and t1[5] < 1000 and t1[7] % 3 != 0, (t1, t2)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=0)
    # decode attention over a slot-indexed cache, several splits, lengths 1 .. L, in either program order (a row's kv
    # heads launched together or apart). Mutation: the heads-fastest order's partials indexed by the grid's second
    # dimension (the rows) as the kv-head count -> the split results land on other rows' partials and differ.
    S, L, hkv, d, hq = 5, 70, 2, 16, 8
    kc, vc = torch.randn(S, L, hkv, d, generator=g), torch.randn(S, L, hkv, d, generator=g)
    q = torch.randn(3, hq, d, generator=g)
    slots, lens = torch.tensor([4, 0, 2]), torch.tensor([1, 70, 33])
    ref = decode_attention_torch(q, kc, vc, slots, lens, d ** -0.5, L)
    for splits, heads_fastest in ((1, False), (2, False), (4, False), (1, True), (4, True)):
        cfg = dict(tk.attention_config(3, d), HEADS_FASTEST=heads_fastest)
        torch.testing.assert_close(tk.decode_attention(q, kc, vc, slots, lens, d ** -0.5, splits, config=cfg), ref,
                                   atol=1e-5, rtol=1e-5)
    # residual add + RMSNorm, silu * up
    x, delta, w = torch.randn(4, 96, generator=g), torch.randn(4, 96, generator=g), torch.randn(96, generator=g)
    x_ref = x + delta
    x_new, h = tk.add_rms_norm(x.clone(), delta, w, 1e-6)
    torch.testing.assert_close(x_new, x_ref)
    torch.testing.assert_close(h, rms_norm(x_ref, w, 1e-6), atol=1e-5, rtol=1e-5)
    gu = torch.randn(3, 2 * 1100, generator=g)
    torch.testing.assert_close(tk.silu_mul(gu), torch.nn.functional.silu(gu[:, :1100]) * gu[:, 1100:])
    # the decode GEMMs: plain, with bias, with silu*mul in the epilogue, and K-split partials that add_rms_norm sums
    # (uneven splits, M not a multiple of the row tile). Mutation: the split-K loop of _add_rms_norm_kernel starting
    # at 2 (one partial dropped) -> the partials check fails.
    xa, wa, ba = torch.randn(5, 96, generator=g), torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    torch.testing.assert_close(tk.linear(xa, wa, ba), torch.nn.functional.linear(xa, wa, ba), atol=1e-4, rtol=1e-4)
    ref = torch.nn.functional.silu(xa @ wa[:20].T) * (xa @ wa[20:].T)
    torch.testing.assert_close(tk.linear(xa, wa, silu_mul=True), ref, atol=1e-4, rtol=1e-4)
    xd, wd = torch.randn(20, 200, generator=g), torch.randn(96, 200, generator=g)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=2)
    part = tk.linear(xd, wd, allow_split=True, config=cfg)
    assert part.shape == (3, 20, 96) and part.dtype == torch.float32
    res = torch.randn(20, 96, generator=g)
    r1, h1 = tk.add_rms_norm(res.clone(), part, w, 1e-6)
    torch.testing.assert_close(r1, res + xd @ wd.T, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(h1, rms_norm(r1, w, 1e-6), atol=1e-5, rtol=1e-5)
    # weight-only FP8 (fp8_decode="w8a16"): e4m3 / e5m2 codes widened in the kernel, each output channel's scale
    # on the fp32 sum: x @ (codes * scale).T, plain with bias, with silu*mul (the up half's own scales) and as
    # K-split partials (two row tiles: the grid launches a weight tile's row tiles together, M_FASTEST). Mutations:
    # the up half's scales not applied in the epilogue -> the silu check fails; M_FASTEST reading the program ids
    # the other way round -> the partials check fails.
    from rlhf_mcore.kernels import fp8 as kfp8

    for fmt in (kfp8.E4M3, kfp8.E5M2):
        wq, ws = kfp8.quantize_rows(wa * torch.logspace(-2, 0, 40)[:, None], fmt)
        deq = wq.float() * ws
        torch.testing.assert_close(tk.linear(xa, wq, ba, w_scale=ws), torch.nn.functional.linear(xa, deq, ba),
                                   atol=1e-4, rtol=1e-4)
        ref = torch.nn.functional.silu(xa @ deq[:20].T) * (xa @ deq[20:].T)
        torch.testing.assert_close(tk.linear(xa, wq, silu_mul=True, w_scale=ws), ref, atol=1e-4, rtol=1e-4)
        wdq, wds = kfp8.quantize_rows(wd, fmt)
        part = tk.linear(xd, wdq, allow_split=True, config=cfg, w_scale=wds)
        torch.testing.assert_close(part.sum(0), xd @ (wdq.float() * wds).T, atol=1e-3, rtol=1e-4)
    # FP8 activations too (x_scale: codes with a scale per row, FP8 x FP8 products): plain with bias, silu*mul, K-split
    # partials over two row tiles. Mutation: the activation's scale not applied to the up half -> the silu check fails.
    xq, xs = kfp8.quantize_rows(xa * torch.logspace(-1, 1, 5)[:, None])
    xdeq = xq.float() * xs
    wq, ws = kfp8.quantize_rows(wa * torch.logspace(-2, 0, 40)[:, None])
    deq = wq.float() * ws
    got = tk.linear(xq, wq, ba, w_scale=ws, x_scale=xs, out_dtype=torch.float32)
    torch.testing.assert_close(got, torch.nn.functional.linear(xdeq, deq, ba), atol=1e-4, rtol=1e-4)
    ref = torch.nn.functional.silu(xdeq @ deq[:20].T) * (xdeq @ deq[20:].T)
    torch.testing.assert_close(tk.linear(xq, wq, silu_mul=True, w_scale=ws, x_scale=xs, out_dtype=torch.float32), ref,
                               atol=1e-4, rtol=1e-4)
    xdq, xds = kfp8.quantize_rows(xd)
    wdq, wds = kfp8.quantize_rows(wd)
    part = tk.linear(xdq, wdq, allow_split=True, config=cfg, w_scale=wds, x_scale=xds)
    torch.testing.assert_close(part.sum(0), (xdq.float() * xds) @ (wdq.float() * wds).T, atol=1e-3, rtol=1e-4)
    _w8a16_decode_check(model_dir)
    _out_proj_routing_check(model_dir)
    _large_weight_routing_check(model_dir)
    _fp8_triton_decode_check(model_dir)
    _fp8_rows_kernels_check()
    _shared_prompt_reads_check(model_dir)
    _kv_fp8_check(model_dir)
    # QKV GEMM + bias + rope + per-head q/k norm (and none, at 32 and 64) + cache write (head_dim 16: padded halves).
    # Mutation: the first half's bias dropped in _qkv_rope_cache_kernel (acc1 += 0 * bias) -> the q check fails.
    for d in (16, 32, 64):
        cos, sin, h_in, wqkv, bqkv, qkv, pos, slot = _qkv_case(d, hq, hkv, g)
        for norm_w in ((None,) if d >= 32 else ()) + ((torch.randn(d, generator=g), torch.randn(d, generator=g)),):
            kc2, vc2 = torch.zeros(S, 64, hkv, d), torch.zeros(S, 64, hkv, d)
            q_out = tk.qkv_rope_cache(h_in, wqkv, bqkv, pos, slot, cos, sin, kc2, vc2, hq, hkv,
                                      *(norm_w if norm_w else (None, None)))
            q_ref = qkv[:, :hq * d].view(3, hq, d)
            k_ref = qkv[:, hq * d:(hq + hkv) * d].view(3, hkv, d)
            if norm_w:
                q_ref, k_ref = rms_norm(q_ref, norm_w[0], 1e-6), rms_norm(k_ref, norm_w[1], 1e-6)
            torch.testing.assert_close(q_out, apply_rope(q_ref, cos[pos], sin[pos]), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(kc2[slot, pos], apply_rope(k_ref, cos[pos], sin[pos]), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(vc2[slot, pos], qkv[:, (hq + hkv) * d:].view(3, hkv, d), atol=1e-4, rtol=1e-4)
            assert int((kc2.abs().sum(-1) != 0).sum()) == 3 * hkv, "only the (slot, position) rows are written"
            # the prefill's form (`rope_qkv`, a projection computed by cuBLAS): the same q, k, v as packed rows.
            # Mutation: PACKED_KV's row offset without the HKV factor (rows overlap) -> the run fails (first where
            # `_fp8_triton_decode_check` compares the fused prefill with the unfused one).
            q4, k4, v4 = tk.rope_qkv(qkv, pos, cos, sin, hq, hkv, *(norm_w if norm_w else (None, None)))
            assert q4.is_contiguous() and k4.shape == v4.shape == (3, hkv, d) and k4.is_contiguous()
            torch.testing.assert_close(q4, q_out, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(k4, kc2[slot, pos], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v4, vc2[slot, pos], atol=1e-5, rtol=1e-5)
            if norm_w is None and d == 64:  # two programs a head (16 of each half's 32 columns): the same q, k, v
                # Mutation: the column offset of the second part dropped (i = tl.arange(0, BLOCK_H)) -> fails.
                kc3, vc3 = torch.zeros_like(kc2), torch.zeros_like(vc2)
                q3 = tk.qkv_rope_cache(h_in, wqkv, bqkv, pos, slot, cos, sin, kc3, vc3, hq, hkv, head_split=2)
                for got, want in ((q3, q_out), (kc3, kc2), (vc3, vc2)):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the decode step's bookkeeping: live rows record their token and advance (row 0 samples a stop id, row 1
    # reaches its cap, row 3 runs on); a row already flagged (row 2, several steps a launch) stays exactly as it is.
    # Mutation: the kernel's `live` masks dropped -> row 2 records token 7 and advances, fails.
    resp_t, resp_l = torch.zeros(5, 10, dtype=torch.int64), torch.zeros(5, 10)
    tok, lp = torch.tensor([9, 5, 7, 6]), torch.tensor([-0.5, -1.0, -1.5, -2.0])
    slots, pos, steps = torch.tensor([1, 2, 3, 4]), torch.tensor([4, 5, 6, 7]), torch.tensor([1, 2, 3, 4])
    limit, in_tok = torch.tensor([8, 3, 8, 8]), torch.tensor([0, 0, 4, 0])
    done = torch.tensor([False, False, True, False])
    stop_ids = torch.tensor([9, -1, -1, -1])
    tk.advance_rows(tok, lp, slots, pos, steps, limit, in_tok, done, stop_ids, resp_t, resp_l, 9)
    assert done.tolist() == [True, True, True, False] and steps.tolist() == [2, 3, 3, 5], (done, steps)
    assert pos.tolist() == [5, 6, 6, 8] and in_tok.tolist() == [9, 5, 4, 6], (pos, in_tok)
    assert resp_t[[1, 2, 3, 4], [1, 2, 3, 4]].tolist() == [9, 5, 0, 6] and resp_l[3].abs().sum() == 0
    # the whole engine on the kernels (qwen3: QK-norm) equals the torch paths
    prompts = make_prompts(2, seed=13, lengths=(3, 12))
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=3, seed=1, stop_token_ids=())
    ref_out = NativeRolloutEngine(model_dir, max_num_seqs=4, max_model_len=32, device=DEVICE).generate(
        prompts, params)
    kern = NativeRolloutEngine(model_dir, max_num_seqs=4, max_model_len=32, attention="triton", sampler="triton",
                               fused_kernels=True, device=DEVICE)
    out = kern.generate(prompts, params)
    assert tokens(out) == tokens(ref_out)
    for a, b in zip(out, ref_out):
        for sa, sb in zip(a.samples, b.samples):
            torch.testing.assert_close(torch.tensor(sa.logprobs), torch.tensor(sb.logprobs), atol=1e-4, rtol=0)
    print("ALL OK")


def test_rows_whose_source_slot_left_read_one_live_members_slot():
    """`retarget_sources`: a group whose shared source slot is no longer any live row's own slot moves, all of it, to
    its first live member's slot; groups with a live source stay. Mutation: each row sent to its own slot (the
    group no longer reads one copy) -> fails."""
    import numpy as np

    from rlhf_mcore.rollout.native.engine import retarget_sources

    src = np.array([8, 8, 3, 7, 7, 5])
    own = np.array([2, 9, 3, 7, 4, 5])  # slot 8 left; 7, 3 and 5 are live rows' own slots
    assert retarget_sources(src, own).tolist() == [2, 2, 3, 7, 7, 5]
    assert retarget_sources(src[:0], own[:0]).tolist() == []


def _decode_inputs(eng, rows: int, g: torch.Generator):
    """A random fp32 cache of 72 slots x 33 positions and its twin (a copy for the reference), and `rows` random
    tokens at positions < 31 in distinct slots, for one decode step of `eng`'s model."""
    from rlhf_mcore.rollout.native.model import KVCache

    cache = KVCache.allocate(eng.spec.num_layers, 72, 33, eng.weights.kv_heads, eng.spec.head_dim, DEVICE,
                             torch.float32)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    twin = KVCache(cache.k.clone(), cache.v.clone())
    tokens = torch.randint(0, eng.spec.vocab_size, (rows,), generator=g)
    positions = torch.randint(0, 31, (rows,), generator=g)
    return cache, twin, tokens, positions, torch.randperm(72, generator=g)[:rows]


def _counted_decode(model, tokens, positions, slots, cache):
    """`model.decode` (torch attention over 32 positions), counting the calls of `kernels.fp8.quantize_rows` and of the
    Triton decode GEMM `linear` it makes: (logits, {"quantize": n, "linear": n})."""
    from rlhf_mcore.kernels import fp8 as kfp8
    from rlhf_mcore.rollout.native import triton_kernels as tk

    calls = {"quantize": 0, "linear": 0}
    real_q, real_l = kfp8.quantize_rows, tk.linear

    def count(key, fn):
        def wrapped(*a, **kw):
            calls[key] += 1
            return fn(*a, **kw)
        return wrapped

    kfp8.quantize_rows, tk.linear = count("quantize", real_q), count("linear", real_l)
    try:
        return model.decode(tokens, positions, slots, cache, "torch", 32), calls
    finally:
        kfp8.quantize_rows, tk.linear = real_q, real_l


def _w8a16_decode_check(model_dir: str) -> None:
    """A fused decode step with FP8 weights read by the Triton GEMMs (fp8_decode="w8a16") equals the torch decode
    step of the same model whose qkv, o_proj, gate_up and down are the dequantized FP8 weights (fp32, 1e-4; qkv
    inside the fused QKV + RoPE + cache kernel), on the same
    cache, at 3 rows (gate_up's fused silu*mul path) and 70 (above FUSED_SILU_MAX_ROWS, where bf16 weights would
    take cuBLAS): the FP8 copies are what it multiplies by, activations unquantized -- no quantization runs, and
    each layer makes its three Triton GEMM calls. Mutations: `_decode_weight` returning the bf16 weight -> the
    logits move by the quantization error and the check fails; `_mlp_act` sending FP8 weights above 64 rows to the
    w8a8 `_linear` -> a quantization runs at 70 rows and the count check fails; the QKV kernel's second half without
    its scales -> the logits check fails."""
    import copy

    from rlhf_mcore.rollout.native import fp8 as native_fp8
    from rlhf_mcore.rollout.native.model import NativeModel

    native_fp8.check_fp8_device = lambda device, key: None  # this subprocess: the CPU interpreter stands in
    eng = NativeRolloutEngine(model_dir, max_num_seqs=72, max_model_len=32, device=DEVICE, fused_kernels=True,
                              attention="torch", sampler="torch", cuda_graphs=False, quantization="fp8",
                              fp8_decode="w8a16")
    eng._refresh_fp8()
    fused = eng.model
    assert fused.fp8_decode == "w8a16" and sorted(fused.fp8[0]) == ["down", "gate_up", "o_proj", "qkv"]
    deq = copy.deepcopy(eng.weights)
    for lw, q in zip(deq.layers, eng._fp8.layers):
        for name, fw in q.items():
            setattr(lw, name, fw.dequantize().to(getattr(lw, name).dtype))
    plain = NativeModel(eng.spec, deq, 33, None, fused=False)
    g = torch.Generator().manual_seed(5)
    for rows in (3, 70):
        cache, twin, tokens, positions, slots = _decode_inputs(eng, rows, g)
        got, calls = _counted_decode(fused, tokens, positions, slots, cache)
        assert calls == {"quantize": 0, "linear": 3 * eng.spec.num_layers}, (rows, calls)
        want = plain.decode(tokens, positions, slots, twin, "torch", 32)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _fp8_triton_decode_check(model_dir: str) -> None:
    """Under `model.FP8_TRITON_DECODE` a fused decode step of an FP8 ("w8a8") engine runs gate_up and down as Triton
    GEMMs on FP8 x FP8 products and equals the unfused decode step on the same FP8 copies (cuBLAS's w8a8 form: torch's
    reference here), on the same cache, at 3 and 70 rows (fp32, 1e-4); o_proj (bf16 under w8a8) keeps the bf16
    routing. The inputs come quantized from the kernels before them (`Fp8Rows`: gate_up's from the add+norm, down's
    from gate_up's epilogue maxima), so no separate per-row quantization runs. Off (on is the default), the fused step
    sends the FP8 linears to `_linear`, and there and in the prefill the add+norm and the fused silu*mul quantize:
    none either; the fused prefill equals the unfused one too. Mutations: `_decode_input` leaving the activations
    unquantized under w8a8 -> the logits move by the activations' quantization error and the check fails; gate_up's
    FP8 scales left out of `_mlp_act` -> fails; `_mlp_act`'s silu*mul not told to quantize -> the counts fail (the
    unfused step's, the prefill's); the add+norm's codes left unscaled (`_row_codes` without the division) -> every
    comparison fails."""
    from rlhf_mcore.kernels import fp8 as kfp8
    from rlhf_mcore.kernels.fp8_triton import quantize_rows_cuda
    from rlhf_mcore.rollout.native import fp8 as native_fp8
    from rlhf_mcore.rollout.native import model as nm
    from rlhf_mcore.rollout.native.attention import PackedLayout
    from rlhf_mcore.rollout.native.model import NativeModel

    native_fp8.check_fp8_device = lambda device, key: None  # this subprocess: the CPU interpreter stands in
    # the reference quantizes through the interpreter's fp32 -> e4m3 cast too, as the kernels do (that cast drops
    # the carry at a binade's top, where each row's largest value lands: 447.99 -> 384; see `_kv_fp8_check`)
    real_quantize = kfp8.quantize_rows
    kfp8.quantize_rows = lambda x, dtype=kfp8.E4M3: quantize_rows_cuda(x, dtype)
    try:
        eng = NativeRolloutEngine(model_dir, max_num_seqs=72, max_model_len=32, device=DEVICE, fused_kernels=True,
                                  attention="torch", sampler="torch", cuda_graphs=False, quantization="fp8")
        eng._refresh_fp8()
        fused = eng.model
        assert fused.fp8_decode == "w8a8" and sorted(fused.fp8[0]) == ["down", "gate_up"]
        plain = NativeModel(eng.spec, eng.weights, 33, None, fused=False)
        plain.fp8, plain.fp8_decode = fused.fp8, "w8a8"
        g = torch.Generator().manual_seed(9)
        n = eng.spec.num_layers
        saved = nm.FP8_TRITON_DECODE
        for on, rows in ((True, 3), (True, 70), (False, 3)):
            cache, twin, tokens, positions, slots = _decode_inputs(eng, rows, g)
            nm.FP8_TRITON_DECODE = on
            try:
                got, calls = _counted_decode(fused, tokens, positions, slots, cache)
            finally:
                nm.FP8_TRITON_DECODE = saved
            # on: gate_up and down on Triton (+ o_proj's bf16 Triton GEMM, a small weight here), down's input
            # quantized from gate_up's epilogue maxima; off: both FP8 linears through `_linear`, o_proj on cuBLAS,
            # the silu*mul quantizing
            assert calls == ({"quantize": 0, "linear": 3 * n} if on else {"quantize": 0, "linear": 0}), (on, calls)
            want = plain.decode(tokens, positions, slots, twin, "torch", 32)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # the prefill: packed prompts of 5 and 9 tokens into fresh slots
        layout = PackedLayout([5, 9], DEVICE)
        tokens = torch.randint(0, eng.spec.vocab_size, (14,), generator=g)
        cache, twin, *_ = _decode_inputs(eng, 1, g)
        write = (torch.arange(14), torch.tensor([0] * 5 + [1] * 9), layout.positions)
        real_q, quantized = kfp8.quantize_rows, []
        kfp8.quantize_rows = lambda *a: quantized.append(1) or real_q(*a)
        try:
            got = fused.prefill(tokens, layout, cache, *write)
        finally:
            kfp8.quantize_rows = real_q
        assert not quantized
        torch.testing.assert_close(got, plain.prefill(tokens, layout, twin, *write), atol=1e-4, rtol=1e-4)
    finally:
        kfp8.quantize_rows = real_quantize


def _fp8_rows_kernels_check() -> None:
    """The kernels that quantize what they compute (`Fp8Rows`): `add_rms_norm(quantize=)` and `silu_mul(quantize=)`
    give the codes and scales that `quantize_rows` gives for their unquantized outputs, bit for bit (its Triton kernel,
    run by the interpreter: the interpreter's fp32 -> e4m3 cast is off at a binade's top, see `_kv_fp8_check`), in
    fp32 and bf16, K-split partials and an all-zero row included (scale 1, codes 0), and the add+norm's residual
    update is unchanged; so does `linear(silu_mul=True, quantize=)` on FP8 x FP8 products (several column tiles,
    16- and 128-row tiles). Mutations: the norm's amax over the unrounded fp32 rows -> the bf16 codes differ and it
    fails; the silu*mul's second pass without the bf16 rounding of the product -> fails; the GEMM epilogue's row
    maxima of the unrounded fp32 outputs -> fails; `_quant_from_partials_kernel` reading one partial fewer -> fails."""
    from rlhf_mcore.kernels.fp8 import E4M3
    from rlhf_mcore.kernels.fp8_triton import quantize_rows_cuda
    from rlhf_mcore.rollout.native import triton_kernels as tk

    g = torch.Generator().manual_seed(4)
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(6, 96, generator=g).to(dt)
        x[2] = 0
        parts = torch.randn(3, 6, 96, generator=g)
        parts[:, 2] = 0
        w = (torch.rand(96, generator=g) + 0.5).to(dt)
        for delta in (None, parts, parts[0].to(dt)):
            x1, h = tk.add_rms_norm(x.clone(), delta, w, 1e-6)
            x2, rows = tk.add_rms_norm(x.clone(), delta, w, 1e-6, quantize=E4M3)
            q, scale = quantize_rows_cuda(h, E4M3)
            assert torch.equal(x1, x2) and rows.dtype == dt and rows.q.dtype == E4M3
            assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(rows.scale, scale)
            if delta is None:
                assert rows.scale[2].item() == 1.0 and not rows.q[2].float().any()
        gu = (torch.randn(5, 2 * 300, generator=g) * 3).to(dt)
        gu[1] = 0
        rows = tk.silu_mul(gu, quantize=E4M3)
        q, scale = quantize_rows_cuda(tk.silu_mul(gu), E4M3)
        assert rows.dtype == dt and torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(rows.scale, scale) and rows.scale[1].item() == 1.0
    # the FP8 x FP8 gate_up GEMM with silu*mul: its epilogue's row maxima over 5 column tiles, then the codes
    wq, ws = quantize_rows_cuda(torch.randn(600, 64, generator=g) * 0.1, E4M3)
    for m in (3, 70):
        x = torch.randn(m, 64, generator=g)
        x[1] = 0
        xq, xs = quantize_rows_cuda(x, E4M3)
        rows = tk.linear(xq, wq, silu_mul=True, w_scale=ws, x_scale=xs, quantize=E4M3)
        q, scale = quantize_rows_cuda(tk.linear(xq, wq, silu_mul=True, w_scale=ws, x_scale=xs), E4M3)
        assert rows.dtype == torch.bfloat16 and rows.q.shape == (m, 300)
        assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(rows.scale, scale)
        assert rows.scale[1].item() == 1.0


def _out_proj_routing_check(model_dir: str) -> None:
    """Above `TRITON_OUT_PROJ_MAX_ROWS` rows (lowered to 64 here) a fused decode step sends bf16 o_proj and down_proj to
    cuBLAS and still equals the torch decode step (fp32, 1e-4); at or below it they stay on the Triton GEMMs, and FP8
    weights ("w8a16") stay on them above it too (cuBLAS has no weight-only FP8 GEMM). Mutations: the row test dropped
    (every bf16 product on cuBLAS) -> the 40-row count fails; FP8 weights routed by rows too -> `_w8a16_decode_check`'s
    per-layer count at 70 rows fails (run under the lowered threshold below)."""
    from rlhf_mcore.rollout.native import model as nm
    from rlhf_mcore.rollout.native import triton_kernels as tk
    from rlhf_mcore.rollout.native.model import NativeModel

    eng = NativeRolloutEngine(model_dir, max_num_seqs=72, max_model_len=32, device=DEVICE, fused_kernels=True,
                              attention="torch", sampler="torch", cuda_graphs=False)
    plain = NativeModel(eng.spec, eng.weights, 33, None, fused=False)
    g = torch.Generator().manual_seed(7)
    saved = nm.TRITON_OUT_PROJ_MAX_ROWS
    nm.TRITON_OUT_PROJ_MAX_ROWS = 64
    real = tk.linear
    try:
        for rows, want_calls in ((40, 3 * eng.spec.num_layers), (70, 0)):  # gate_up: silu*mul fused up to 64 rows
            cache, twin, tokens, positions, slots = _decode_inputs(eng, rows, g)
            calls = [0]

            def counted(*a, calls=calls, **kw):
                calls[0] += 1
                return real(*a, **kw)
            tk.linear = counted
            got = eng.model.decode(tokens, positions, slots, cache, "torch", 32)
            tk.linear = real
            assert calls[0] == want_calls, (rows, calls)
            torch.testing.assert_close(got, plain.decode(tokens, positions, slots, twin, "torch", 32), atol=1e-4,
                                       rtol=1e-4)
        _w8a16_decode_check(model_dir)  # FP8 weights at 70 rows: still three Triton GEMMs a layer
    finally:
        tk.linear = real
        nm.TRITON_OUT_PROJ_MAX_ROWS = saved


def _large_weight_routing_check(model_dir: str) -> None:
    """Weights above `TRITON_GEMM_MAX_WEIGHT` elements (lowered to 0 here: all of them) leave the Triton decode GEMMs:
    QKV goes through cuBLAS and `rope_cache`, o_proj and down through cuBLAS; only gate_up keeps its fused silu*mul
    GEMM (<= 64 rows). The step still equals the torch decode step (fp32, 1e-4), and so does every cache row written.
    Mutations: rope_cache's loads without the HALF offset for the second half (`r_ptrs` twice) -> the logits and the
    cache check fail; the weight test dropped from `_out_proj` -> the linear count fails."""
    from rlhf_mcore.rollout.native import model as nm
    from rlhf_mcore.rollout.native import triton_kernels as tk
    from rlhf_mcore.rollout.native.model import NativeModel

    eng = NativeRolloutEngine(model_dir, max_num_seqs=72, max_model_len=32, device=DEVICE, fused_kernels=True,
                              attention="torch", sampler="torch", cuda_graphs=False)
    plain = NativeModel(eng.spec, eng.weights, 33, None, fused=False)
    g = torch.Generator().manual_seed(8)
    saved, real = nm.TRITON_GEMM_MAX_WEIGHT, (tk.linear, tk.rope_cache, tk.qkv_rope_cache)
    calls = {"linear": 0, "rope_cache": 0, "qkv_rope_cache": 0}

    def counting(name, fn):
        def f(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return f
    nm.TRITON_GEMM_MAX_WEIGHT = 0
    tk.linear, tk.rope_cache, tk.qkv_rope_cache = (counting(n, f) for n, f in zip(calls, real))
    try:
        cache, twin, tokens, positions, slots = _decode_inputs(eng, 40, g)
        got = eng.model.decode(tokens, positions, slots, cache, "torch", 32)
    finally:
        nm.TRITON_GEMM_MAX_WEIGHT = saved
        tk.linear, tk.rope_cache, tk.qkv_rope_cache = real
    n = eng.spec.num_layers
    assert calls == {"linear": n, "rope_cache": n, "qkv_rope_cache": 0}, calls
    torch.testing.assert_close(got, plain.decode(tokens, positions, slots, twin, "torch", 32), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache.k, twin.k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache.v, twin.v, atol=1e-4, rtol=1e-4)


def _qkv_case(d: int, hq: int, hkv: int, g: torch.Generator):
    """A QKV kernel check's inputs at head dim d: RoPE tables (64 positions), 3 rows of 48 inputs, the QKV weight and
    bias, their fp32 product, and 3 (position, slot) pairs."""
    from rlhf_mcore.models.rope import default_inv_freq
    from rlhf_mcore.rollout.native.rope import rope_tables

    cos, sin = rope_tables(default_inv_freq(d, 1e4), 64, "cpu", torch.float32)
    h_in = torch.randn(3, 48, generator=g)
    wqkv, bqkv = torch.randn((hq + 2 * hkv) * d, 48, generator=g), torch.randn((hq + 2 * hkv) * d, generator=g)
    qkv = torch.nn.functional.linear(h_in, wqkv, bqkv)
    return cos, sin, h_in, wqkv, bqkv, qkv, torch.tensor([0, 17, 63]), torch.tensor([1, 4, 2])


def _kv_fp8_check(model_dir: str) -> None:
    """The FP8 KV cache's Triton paths against torch (interpreter, fp32). (1) `decode_attention` over e4m3 codes with
    a scale per (slot, position, head) equals torch attention over the dequantized cache (splits 1, 2, 4, and with
    a row reading its first keys from another slot). (2) The QKV kernel's epilogue (`qkv_rope_cache`, and
    `rope_cache` after a cuBLAS projection) writes the codes and scales `quantize_kv` makes of the torch path's
    rotated keys and values (the cast: the interpreter's, see below). (3) The engine on the kernels (fused, Triton
    attention) equals the torch-path engine, both with an FP8 cache. Mutations (run): the value scales left out of
    the split kernel (pw = p) -> (1) fails; the epilogue's scale stored as amax (not amax / 448) -> (2) fails."""
    from rlhf_mcore.kernels.fp8_triton import quantize_rows_cuda
    from rlhf_mcore.rollout.native import fp8 as native_fp8
    from rlhf_mcore.rollout.native import triton_kernels as tk
    from rlhf_mcore.rollout.native.attention import decode_attention_torch
    from rlhf_mcore.rollout.native.kv_cache import quantize_kv
    from rlhf_mcore.rollout.native.model import rms_norm
    from rlhf_mcore.rollout.native.rope import apply_rope

    g = torch.Generator().manual_seed(21)
    S, L, hkv, d, hq = 5, 70, 2, 16, 8
    scales = torch.logspace(-2, 1, S * L * hkv).reshape(S, L, hkv, 1)  # vectors of very different magnitudes
    kc8, ks = quantize_kv(torch.randn(S, L, hkv, d, generator=g) * scales)
    vc8, vs = quantize_kv(torch.randn(S, L, hkv, d, generator=g) * scales.flip(0))
    kd, vd = kc8.float() * ks[..., None], vc8.float() * vs[..., None]  # the dequantized cache, by hand
    q = torch.randn(3, hq, d, generator=g)
    slots, lens = torch.tensor([4, 0, 2]), torch.tensor([1, 70, 33])
    ref = decode_attention_torch(q, kd, vd, slots, lens, d ** -0.5, L)
    for splits in (1, 2, 4):
        got = tk.decode_attention(q, kc8, vc8, slots, lens, d ** -0.5, splits, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # row 1 reads its first 20 keys from slot 3, which holds slot 0's first 20 (codes and scales)
    for c in (kc8.view(torch.uint8), vc8.view(torch.uint8), ks, vs):
        c[3, :20] = c[0, :20]
    shared = (torch.tensor([4, 3, 2]), torch.tensor([0, 20, 0]))
    got = tk.decode_attention(q, kc8, vc8, slots, lens, d ** -0.5, 2, k_scale=ks, v_scale=vs, shared=shared)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)

    # (2) the epilogue's writes, at head dims 16 / 32 / 64, with and without q/k norms
    for d in (16, 32, 64):
        cos, sin, h_in, wqkv, bqkv, qkv, pos, slot = _qkv_case(d, hq, hkv, g)
        for norm_w in (None, (torch.randn(d, generator=g), torch.randn(d, generator=g))):
            k_ref = qkv[:, hq * d:(hq + hkv) * d].view(3, hkv, d)
            k_ref = rms_norm(k_ref, norm_w[1], 1e-6) if norm_w else k_ref
            k_ref, v_ref = apply_rope(k_ref, cos[pos], sin[pos]), qkv[:, (hq + hkv) * d:].view(3, hkv, d)
            for fused_gemm in (True, False):
                kc, vc = torch.zeros(S, 64, hkv, d).to(kc8.dtype), torch.zeros(S, 64, hkv, d).to(kc8.dtype)
                ksc, vsc = torch.ones(S, 64, hkv), torch.ones(S, 64, hkv)
                norms = norm_w if norm_w else (None, None)
                if fused_gemm:
                    tk.qkv_rope_cache(h_in, wqkv, bqkv, pos, slot, cos, sin, kc, vc, hq, hkv, *norms, k_scale=ksc,
                                      v_scale=vsc)
                else:
                    tk.rope_cache(qkv, pos, slot, cos, sin, kc, vc, hq, hkv, *norms, k_scale=ksc, v_scale=vsc)
                for codes, sc, want in ((kc, ksc, k_ref), (vc, vsc, v_ref)):
                    # the reference: quantize_kv's rule through the interpreter's own fp32 -> e4m3 cast (the
                    # interpreter's cast drops the carry at a binade's top: 31.84 -> 16, where torch gives 32; on a
                    # GPU the hardware cast runs, checked by the GPU test)
                    wq, wsc = quantize_rows_cuda(want.reshape(-1, d), kc8.dtype)
                    torch.testing.assert_close(sc[slot, pos], wsc.view(3, hkv), atol=0, rtol=1e-5)
                    same = codes[slot, pos].view(torch.uint8) == wq.view(3, hkv, d).view(torch.uint8)
                    assert same.float().mean() >= 0.98, (d, fused_gemm, same.float().mean())  # fp32 rounding ties
                assert int((ksc != 1).sum()) == 3 * hkv, "only the (slot, position) rows get scales"

    # (2b) the prefill's cache write (`kv_write`): 7 tokens, 10 entries (two tokens to two slots each, one token
    # left out, positions not in token order) into a model-dtype cache (equal to KVCache.put of the gathered rows)
    # and an FP8 one (quantize_kv's codes and scales, through the interpreter's cast as above). Mutation (run): the
    # kernel's source row taken as the entry index instead of tokens[j] -> the caches differ (the engine checks
    # before this one fail too).
    from rlhf_mcore.rollout.native.kv_cache import KVCache

    k_new, v_new = torch.randn(7, hkv, 32, generator=g) * 3, torch.randn(7, hkv, 32, generator=g)
    k_new[2, 1] = 0.0  # a zero head vector: scale 1, codes 0
    tok, w_slot = torch.tensor([0, 1, 2, 3, 4, 5, 5, 6, 0, 2]), torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 4])
    w_pos = torch.tensor([0, 1, 2, 0, 1, 2, 2, 3, 5, 9])
    ref = KVCache.allocate(1, S, 12, hkv, 32, "cpu", torch.float32)
    ref.put(0, (w_slot, w_pos), k_new[tok], v_new[tok])
    got = KVCache.allocate(1, S, 12, hkv, 32, "cpu", torch.float32)
    tk.kv_write(k_new, v_new, tok, w_slot, w_pos, **got.layer(0))
    assert torch.equal(got.k, ref.k) and torch.equal(got.v, ref.v)
    got8 = KVCache.allocate(1, S, 12, hkv, 32, "cpu", torch.float32, fp8=True)
    tk.kv_write(k_new, v_new, tok, w_slot, w_pos, **got8.layer(0))
    for codes, sc, x in ((got8.k[0], got8.k_scale[0], k_new), (got8.v[0], got8.v_scale[0], v_new)):
        wq, wsc = quantize_rows_cuda(x[tok].reshape(-1, 32), kc8.dtype)
        torch.testing.assert_close(sc[w_slot, w_pos], wsc.view(-1, hkv), atol=0, rtol=0)
        assert torch.equal(codes[w_slot, w_pos].view(torch.uint8), wq.view(-1, hkv, 32).view(torch.uint8))
        assert int((sc != 1).sum()) == 10 * hkv - 2 * (x is k_new), "only the entries' rows get scales"

    # (3) the engine on the kernels against the torch paths, both with an FP8 cache; the torch path's writes cast
    # through the interpreter too (as above), so the two caches hold the same codes
    from rlhf_mcore.rollout.native import kv_cache

    def interpreter_quantize_kv(x):
        q, scale = quantize_rows_cuda(x.reshape(-1, x.shape[-1]), kc8.dtype)
        return q.view(x.shape), scale.view(x.shape[:-1])

    kv_cache.quantize_kv = interpreter_quantize_kv
    native_fp8.check_fp8_device = lambda *a: None  # this subprocess: the CPU interpreter stands in
    prompts = make_prompts(3, seed=17, lengths=(3, 12))
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=4, seed=1, stop_token_ids=())
    kw = dict(max_num_seqs=6, max_model_len=32, device=DEVICE, kv_cache_dtype="fp8_e4m3")
    ref_out = NativeRolloutEngine(model_dir, **kw).generate(prompts, params)
    kern = NativeRolloutEngine(model_dir, attention="triton", sampler="torch", fused_kernels=True, **kw)
    out = kern.generate(prompts, params)
    assert kern.cache.fp8 and tokens(out) == tokens(ref_out)
    for a, b in zip(out, ref_out):
        for sa, sb in zip(a.samples, b.samples):
            torch.testing.assert_close(torch.tensor(sa.logprobs), torch.tensor(sb.logprobs), atol=1e-4, rtol=0)


def _pdl_rule_check(tk) -> None:
    """Programmatic dependent launch as a Hopper GPU would decide it (the capability and the interpreter faked): on
    outside a decode batch's scope, off within `PDL_OFF_ROWS` (first and last included; session 48: 3.5% slower at 256
    rows on an H100) and on either side of it; RLHF_MCORE_DECODE_PDL=1 on and =0 off at every batch. Mutation:
    `pdl_enabled` not reading the batch's scope -> PDL at 256 rows, fails (run once)."""
    import os

    saved_env, saved_sm90 = dict(os.environ), list(tk._SM90)
    try:
        tk._SM90[:] = [True]
        os.environ["TRITON_INTERPRET"] = "0"
        os.environ.pop("RLHF_MCORE_DECODE_PDL", None)
        assert tk.pdl_enabled()  # the prefill: no batch scope
        low, high = tk.PDL_OFF_ROWS
        assert low <= 256 <= high
        for rows, on in ((low - 1, True), (low, False), (256, False), (high, False), (high + 1, True), (512, True)):
            with tk.pdl_for_batch(rows):
                assert tk.pdl_enabled() == on, (rows, on)
        with tk.pdl_for_batch(high):
            assert not tk.pdl_enabled()
            with tk.pdl_for_batch(64):
                assert tk.pdl_enabled()
            assert not tk.pdl_enabled()
        assert tk.pdl_enabled()
        os.environ["RLHF_MCORE_DECODE_PDL"] = "1"
        with tk.pdl_for_batch(256):
            assert tk.pdl_enabled()
        os.environ["RLHF_MCORE_DECODE_PDL"] = "0"
        with tk.pdl_for_batch(1):
            assert not tk.pdl_enabled()
        tk._SM90[:] = [False]
        os.environ.pop("RLHF_MCORE_DECODE_PDL")
        assert not tk.pdl_enabled()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        tk._SM90[:] = saved_sm90


def _shared_prompt_reads_check(model_dir: str) -> None:
    """The rows of one prefilled prompt read its keys/values from one slot (`engine.SHARE_PROMPT_READS`).

    Kernel: each row's own slot holds garbage below its shared length and the source slot garbage above it; the
    attention equals the reference over the true values (1 and 2 splits). Engine: 4 prompts x 4 samples through 4
    slots, up to 6 tokens, the model's 3 most frequent tokens as stop tokens, so rows leave early, sources are
    retargeted and freed slots are prefilled again while their groups still decode; tokens and log-probs are bit for
    bit those with every row reading its own slot. (Session 46 searched the prompts' and samples' seeds for this
    smaller case, where the retarget mutation below still changes the outputs (session 51 again, for the
    inverse-distribution sampler: the prompts' seed 2 of 1-4, the samples' seeds 1-3): 6 prompts x 4 samples through 5
    slots and 10 tokens took ~25 s an interpreted engine, this one ~10. Only the attention kernel is interpreted in the
    engines: the shared reads are its; the torch sampler and unfused layers took the two engines from 30 s to 9,
    session 48, and the retarget mutation still fails.)
    Mutations (each run once, each fails here): the kernel ignoring `shared` (the own slot's garbage is read); `<=`
    for `<` on the shared length (one garbage key); the engine skipping the retarget (rows read a freed slot after
    another prompt was prefilled into it)."""
    from rlhf_mcore.rollout.native import engine as eng_mod
    from rlhf_mcore.rollout.native import triton_kernels as tk
    from rlhf_mcore.rollout.native.attention import decode_attention_torch

    g = torch.Generator().manual_seed(11)
    S, L, hkv, d, hq = 6, 40, 2, 16, 8
    true_k, true_v = torch.randn(S, L, hkv, d, generator=g), torch.randn(S, L, hkv, d, generator=g)
    slots, src = torch.tensor([1, 2, 4]), torch.tensor([5, 5, 4])
    shared, lens = torch.tensor([20, 20, 0]), torch.tensor([33, 20, 17])
    for s_, n in zip(slots.tolist(), shared.tolist()):  # the source's copy of the prompt is the row's own
        true_k[s_, :n], true_v[s_, :n] = true_k[5, :n], true_v[5, :n]
    kc, vc = true_k.clone(), true_v.clone()
    kc[1:3, :20], vc[1:3, :20] = 1e3, -1e3  # the rows' own copies: garbage where they read the source
    kc[5, 20:], vc[5, 20:] = -1e3, 1e3  # the source beyond the shared length: garbage
    q = torch.randn(3, hq, d, generator=g)
    ref = decode_attention_torch(q, true_k, true_v, slots, lens, d ** -0.5, L)
    for splits in (1, 2):
        torch.testing.assert_close(tk.decode_attention(q, kc, vc, slots, lens, d ** -0.5, splits, shared=(src, shared)),
                                   ref, atol=1e-5, rtol=1e-5)
    # the engine, with and without shared reads
    prompts = make_prompts(4, seed=2, lengths=(6, 14))
    probe = NativeRolloutEngine(model_dir, max_num_seqs=12, max_model_len=32, device=DEVICE).generate(
        prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=1, stop_token_ids=()))
    common = torch.tensor([t for o in probe for s_ in o.samples for t in s_.token_ids]).bincount().argsort(
        descending=True)[:3]  # the model's most frequent tokens as stop tokens: rows finish at many lengths
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=1, stop_token_ids=tuple(common.tolist()))
    real, retargets = eng_mod.retarget_sources, [0]

    def counted(src_, own):
        out = real(src_, own)
        retargets[0] += int((out != src_).any())
        return out
    outs = {}
    try:
        eng_mod.retarget_sources = counted
        for on in (True, False):
            eng_mod.SHARE_PROMPT_READS = on
            engine = NativeRolloutEngine(model_dir, max_num_seqs=4, max_model_len=32, attention="triton",
                                         sampler="torch", fused_kernels=False, device=DEVICE)
            outs[on] = engine.generate(prompts, params)
    finally:
        eng_mod.SHARE_PROMPT_READS, eng_mod.retarget_sources = True, real
    lengths = {len(s.token_ids) for o in outs[True] for s in o.samples}
    assert len(lengths) > 2 and retargets[0] > 0, (lengths, retargets)  # rows left early; sources moved
    assert tokens(outs[True]) == tokens(outs[False])
    for a, b in zip(outs[True], outs[False]):
        for sa, sb in zip(a.samples, b.samples):
            assert sa.logprobs == sb.logprobs


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--triton-interpret":
    _triton_interpret_checks(sys.argv[2])
