"""The native engine's streaming API (open_stream / submit / step / abort / close_stream) and `generate()` on top
of it: unchanged results, continuations that reproduce interrupted samples, requests arriving mid-run, bad
requests.

`tests/data/rollout_stream_golden.json` holds `generate()` outputs of the engine before it was rebuilt on the
stream (written with `python tests/test_rollout_stream.py --write-golden`). Session 51 wrote it again for the
inverse-distribution sampler, after checking that the engine with the previous (Gumbel-max) torch sampler put in its
place still reproduced the previous file (every token; log-probs within 5e-7): only the sampler changed. The tiny
models are fixed by their seed, and the file records their weights' digest so a changed model is told apart from a
changed engine. The engines here run on the CPU in fp32 (what the golden file and the exact-reproduction checks are
calibrated for); the GPU paths are exercised by tests/test_rollout_native_gpu.py and the asynchronous trainers' GPU
runs.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_rollout_native import _single_thread, make_prompts  # noqa: F401 (_single_thread: an autouse fixture)

from rlhf_mcore.rollout import FINISH_ABORT, Request, RolloutEngine, Sample, SamplingParams
from rlhf_mcore.rollout.hf_backend import HFRolloutEngine
from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

GOLDEN = Path(__file__).resolve().parent / "data" / "rollout_stream_golden.json"



def golden_cases() -> list[dict]:
    """generate() calls covering continuous batching, seeded sampling, stop ids, top-k/top-p, repeated prompts."""
    repeated = make_prompts(3, seed=23)
    return [
        dict(name="greedy-batching", arch="llama", engine=dict(max_num_seqs=2, max_model_len=64),
             prompts=make_prompts(4, seed=20), params=dict(temperature=0, max_new_tokens=10), request_ids=None),
        dict(name="seeded-stops", arch="qwen2", engine=dict(max_num_seqs=4, max_model_len=80),
             prompts=make_prompts(5, seed=21),
             params=dict(n=3, temperature=1.3, max_new_tokens=14, seed=7,
                         stop_token_ids=[19, 165, 696, 8, 885, 258, 478, 311, 592, 687, 253, 410]),
             request_ids=[10, 11, 12, 13, 14]),
        dict(name="top-k-top-p", arch="qwen3", engine=dict(max_num_seqs=3, max_model_len=64),
             prompts=make_prompts(3, seed=22),
             params=dict(n=2, temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=8, seed=3, stop_token_ids=[]),
             request_ids=[5, 6, 7]),
        dict(name="repeated-prompts", arch="qwen2", engine=dict(max_num_seqs=8, max_model_len=64),
             prompts=[repeated[0], repeated[1], repeated[0], repeated[2], repeated[0]],
             params=dict(n=2, temperature=1.0, max_new_tokens=9, seed=1, stop_token_ids=[]),
             request_ids=[0, 1, 2, 3, 0]),  # the last repeats the first's request id: same samples
    ]


def run_case(model_dir, case: dict) -> list[list[dict]]:
    engine = NativeRolloutEngine(model_dir, device="cpu", **case["engine"])
    outs = engine.generate(case["prompts"], SamplingParams(**case["params"]), request_ids=case["request_ids"])
    return [[dict(token_ids=s.token_ids, logprobs=s.logprobs, finish_reason=s.finish_reason) for s in o.samples]
            for o in outs]


def weights_digest(model_dir) -> str:
    return hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest()


def write_golden(out: Path) -> None:
    from rlhf_mcore.models.tiny import make_tiny_model

    torch.set_num_threads(1)
    result = {"digests": {}, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for case in golden_cases():
            arch = case["arch"]
            if arch not in dirs:
                dirs[arch] = make_tiny_model(Path(tmp) / arch, arch=arch)
                result["digests"][arch] = weights_digest(dirs[arch])
            result["cases"][case["name"]] = run_case(dirs[arch], case)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result) + "\n")


# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", golden_cases(), ids=lambda c: c["name"])
def test_generate_unchanged_from_the_engine_before_streaming(tiny_model_dir, case):
    golden = json.loads(GOLDEN.read_text())
    model_dir = tiny_model_dir(case["arch"])
    assert weights_digest(model_dir) == golden["digests"][case["arch"]], (
        f"the tiny {case['arch']} model's weights changed since {GOLDEN.name} was written; regenerate it with "
        "the engine at a known-good commit: python tests/test_rollout_stream.py --write-golden")
    got, want = run_case(model_dir, case), golden["cases"][case["name"]]
    assert [[s["token_ids"] for s in o] for o in got] == [[s["token_ids"] for s in o] for o in want]
    assert [[s["finish_reason"] for s in o] for o in got] == [[s["finish_reason"] for s in o] for o in want]
    for o_got, o_want in zip(got, want):
        for s_got, s_want in zip(o_got, o_want):
            torch.testing.assert_close(torch.tensor(s_got["logprobs"]), torch.tensor(s_want["logprobs"]),
                                       atol=1e-5, rtol=0)


def drain(engine) -> dict[tuple[int, int], object]:
    """Step until nothing is pending; the Finished results keyed by (request id, sample)."""
    out = {}
    while engine.num_pending:
        for f in engine.step():
            out[(f.request.request_id, f.request.sample)] = f
    return out


def assert_same_samples(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        g, w = got[k], want[k]
        assert g.token_ids == w.token_ids, k
        assert g.finish_reason == w.finish_reason, k
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=atol, rtol=0)


@pytest.mark.parametrize("case", golden_cases(), ids=lambda c: c["name"])
def test_per_sample_submit_equals_generate(tiny_model_dir, case):
    """Each (request id, sample) submitted on its own, in reverse order, gives generate()'s sample."""
    golden = json.loads(GOLDEN.read_text())["cases"][case["name"]]
    params = SamplingParams(**case["params"])
    ids = case["request_ids"] or list(range(len(case["prompts"])))
    engine = NativeRolloutEngine(tiny_model_dir(case["arch"]), device="cpu", **case["engine"])
    engine.open_stream(params)
    pairs = [(i, j) for i in range(len(ids)) for j in range(params.n)]
    for i, j in reversed(pairs):
        engine.submit([Request(ids[i], case["prompts"][i], sample=j, tag=(i, j))])
    results = {}
    while engine.num_pending:
        for f in engine.step():
            assert f.request.prompt_ids == case["prompts"][f.request.tag[0]]
            results[f.request.tag] = f.sample
    engine.close_stream()
    want = {(i, j): golden[i][j] for i, j in pairs}
    assert {k: v.token_ids for k, v in results.items()} == {k: v["token_ids"] for k, v in want.items()}
    assert {k: v.finish_reason for k, v in results.items()} == {k: v["finish_reason"] for k, v in want.items()}
    for k, v in want.items():
        torch.testing.assert_close(torch.tensor(results[k].logprobs), torch.tensor(v["logprobs"]), atol=1e-5, rtol=0)


STOPS = (19, 165, 696, 8, 885, 258, 478, 311, 592, 687, 253, 410)


@pytest.mark.parametrize("abort_after, sleep", [([0, 3], False), ([1, 2, 5], True), ([4, 4, 4, 4], False)],
                         ids=["at-submit", "with-sleep", "four-aborts"])
def test_abort_then_continue_reproduces_uninterrupted(tiny_model_dir, abort_after, sleep):
    """Aborted samples resubmitted as continuations (several times, some still waiting when aborted, per-request
    caps) end exactly as the uninterrupted samples."""
    engine = NativeRolloutEngine(tiny_model_dir("qwen2"), device="cpu", max_num_seqs=4, max_model_len=80)
    prompts = make_prompts(4, seed=30)
    caps = [5, 16, 11, None]
    params = SamplingParams(temperature=1.0, max_new_tokens=14, seed=9, stop_token_ids=STOPS)
    requests = [Request(100 + i, p, sample=j, max_new_tokens=caps[i], tag=f"r{i}s{j}")
                for i, p in enumerate(prompts) for j in range(2)]
    engine.open_stream(params)
    engine.submit(requests)
    reference = {k: f.sample for k, f in drain(engine).items()}
    engine.close_stream()
    for (rid, _), s in reference.items():
        assert len(s.token_ids) <= (caps[rid - 100] or 14)
    assert {len(s.token_ids) for s in reference.values()} & {5, 16}, "the per-request caps were never reached"

    engine.open_stream(params)
    engine.submit(requests)
    done, prefix_lengths = {}, []
    for k in abort_after:
        for _ in range(k):
            for f in engine.step():
                done[(f.request.request_id, f.request.sample)] = f.sample
        if sleep:
            with pytest.raises(RuntimeError, match="abort"):
                engine.sleep(1)  # running requests would lose their KV cache
        back = engine.abort()
        assert engine.num_pending == 0 and len(back) + len(done) == len(requests)
        if sleep:
            engine.sleep(1)
            engine.wake()
        continuations = []
        for f in back:
            key, s = (f.request.request_id, f.request.sample), f.sample
            assert f.request.tag == f"r{key[0] - 100}s{key[1]}"
            if s.finish_reason != FINISH_ABORT:  # finished by the decode step in flight: its own reason, kept
                done[key] = s
                continue
            n = len(s.token_ids)
            assert s.token_ids == reference[key].token_ids[:n] and len(s.logprobs) == n
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(reference[key].logprobs[:n]),
                                       atol=1e-5, rtol=0)
            prefix_lengths.append(n)
            continuations.append(replace(f.request, prefix=s))
        engine.submit(continuations)
        assert engine.num_pending == len(continuations)
    done.update((k, f.sample) for k, f in drain(engine).items())
    engine.close_stream()
    assert_same_samples(done, reference)
    assert 0 in prefix_lengths and max(prefix_lengths) > 1  # both waiting and running requests were aborted


def test_continuation_at_its_cap_or_stop_finishes_without_compute(tiny_model_dir):
    engine = NativeRolloutEngine(tiny_model_dir("qwen2"), device="cpu", max_num_seqs=4, max_model_len=64)
    prompt = make_prompts(1, seed=33)[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=2, stop_token_ids=())
    engine.open_stream(params)
    engine.submit([Request(0, prompt)])
    full = drain(engine)[(0, 0)].sample
    engine.close_stream()
    assert len(full.token_ids) == 6 and full.finish_reason == "length"
    stop = full.token_ids[2]
    engine.open_stream(replace(params, stop_token_ids=(stop,)))
    at_cap = Request(0, prompt, prefix=full, tag="cap")
    at_stop = Request(0, prompt, prefix=replace(full, token_ids=full.token_ids[:3], logprobs=full.logprobs[:3]),
                      max_new_tokens=10, tag="stop")
    engine.submit([at_cap, at_stop])
    assert engine.num_pending == 2
    got = {f.request.tag: f.sample for f in engine.step()}
    assert engine.num_pending == 0
    assert got["cap"].token_ids == full.token_ids and got["cap"].logprobs == full.logprobs
    assert got["cap"].finish_reason == "length"
    assert got["stop"].token_ids == full.token_ids[:3] and got["stop"].finish_reason == "stop"
    engine.close_stream()
    assert engine.last_stats["prefills"] == 0 and engine.last_stats["decode_steps"] == 0


def test_continuation_logprobs_equal_teacher_forcing(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    d = tiny_model_dir("qwen3")
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    engine = NativeRolloutEngine(d, device="cpu", max_num_seqs=4, max_model_len=64)
    prompts = make_prompts(3, seed=31)
    engine.open_stream(SamplingParams(temperature=0.7, max_new_tokens=12, seed=4, stop_token_ids=()))
    engine.submit([Request(i, p) for i, p in enumerate(prompts)])
    for _ in range(5):
        assert engine.step() == []
    back = engine.abort()
    assert sorted(len(f.sample.token_ids) for f in back) == [6, 6, 6]  # prefill token + 5 decode steps
    engine.submit([replace(f.request, prefix=f.sample) for f in back])
    done = drain(engine)
    engine.close_stream()
    for f in back:
        s = done[(f.request.request_id, 0)].sample
        assert len(s.token_ids) == 12 and s.token_ids[:6] == f.sample.token_ids
        prompt = f.request.prompt_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1:-1].float()
        ref = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=0)


def test_submit_while_running_finishes_everything(tiny_model_dir):
    engine = NativeRolloutEngine(tiny_model_dir("llama"), device="cpu", max_num_seqs=3, max_model_len=64,
                                 show_progress=True)
    prompts = make_prompts(7, seed=32)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=5)
    ids = list(range(50, 57))
    reference = {(ids[i], j): s for i, o in enumerate(engine.generate(prompts, params, request_ids=ids))
                 for j, s in enumerate(o.samples)}
    assert engine.num_pending == 0
    engine.open_stream(params)  # params.n is ignored: each request is one sample
    arrivals = {0: [0], 2: [1, 2], 3: [3], 7: [4, 5], 12: [6]}  # step -> prompts arriving (two samples each)
    got, pending, step, joined_running = {}, 0, 0, 0
    while step <= max(arrivals) or engine.num_pending:
        new = [Request(ids[i], prompts[i], sample=j) for i in arrivals.get(step, []) for j in range(2)]
        joined_running += bool(new) and pending > 0
        engine.submit(new)
        pending += len(new)
        assert engine.num_pending == pending
        finished = engine.step()
        pending -= len(finished)
        assert engine.num_pending == pending
        got.update(((f.request.request_id, f.request.sample), f.sample) for f in finished)
        step += 1
    engine.close_stream()
    assert joined_running >= 3  # requests arrived while others were decoding
    assert_same_samples(got, reference)


def test_bad_requests_and_misuse(tiny_model_dir):
    engine = NativeRolloutEngine(tiny_model_dir("qwen2"), device="cpu", max_num_seqs=2, max_model_len=32)
    assert engine.supports_streaming and engine.num_pending == 0
    with pytest.raises(RuntimeError, match="open_stream"):
        engine.submit([Request(0, [1, 2])])
    with pytest.raises(RuntimeError, match="open_stream"):
        engine.step()
    engine.open_stream(SamplingParams(max_new_tokens=8, seed=0))
    ok = Request(1, [3, 4, 5], tag="ok")
    cases = [
        (Request(7, []), r"request 7 \(sample 0\).*empty"),
        (Request(8, [1, 2], sample=1, max_new_tokens=3, prefix=Sample([5, 6, 7, 8], [-1.0] * 4, "abort")),
         r"request 8 \(sample 1\).*prefix has 4 tokens, beyond.*max_new_tokens=3"),
        (Request(9, [1, 5000]), r"request 9 .*token id 5000 outside \[0, 1024\)"),
        (Request(10, [1, 2], prefix=Sample([3, -4], [-1.0, -1.0], "abort")), r"request 10 .*prefix.*-4 outside"),
        (Request(11, [1] * 30), r"request 11 .*30 tokens \+ max_new_tokens=8 > .*max_model_len=32"),
        (Request(12, [1], max_new_tokens=0), r"request 12 .*max_new_tokens=0"),
        (Request(13, [1], prefix=Sample([3, 4], [-1.0], "abort")), r"request 13 .*2 token_ids but 1 logprobs"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            engine.submit([ok, bad])
        assert engine.num_pending == 0  # nothing of a rejected submit is queued
    with pytest.raises(RuntimeError, match="already open"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    engine.submit([ok])
    assert engine.num_pending == 1
    engine.close_stream()  # drops what is pending
    assert engine.num_pending == 0
    with pytest.raises(RuntimeError, match="open_stream"):
        engine.abort()


def test_backends_without_streaming_say_so():
    class Plain(RolloutEngine):
        def generate(self, prompts, params, request_ids=None):
            return []

        def update_weights(self, named_tensors):
            pass

        def sleep(self, level=1):
            return 0

        def wake(self):
            pass

    assert not HFRolloutEngine.supports_streaming and not Plain.supports_streaming
    engine = Plain()
    calls = [lambda: engine.open_stream(SamplingParams()), lambda: engine.submit([]), engine.step, engine.abort,
             lambda: engine.num_pending, engine.close_stream]
    for call in calls:
        with pytest.raises(NotImplementedError, match=r"Plain does not stream; use the native engine "
                                                      r"\(actor_rollout_ref.rollout.name=native\)"):
            call()


if __name__ == "__main__" and sys.argv[1:] == ["--write-golden"]:
    write_golden(GOLDEN)
