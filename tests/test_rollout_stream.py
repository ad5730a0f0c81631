"""The native engine's streaming API (open_stream / submit / step / abort / close_stream) and `generate()` on top
of it: unchanged results, continuations that reproduce interrupted samples, requests arriving mid-run, bad
requests.

`tests/data/rollout_stream_golden.json` holds `generate()` outputs of the engine before it was rebuilt on the
stream (written with `python tests/test_rollout_stream.py --write-golden`); the tiny models are fixed by their
seed, and the file records their weights' digest so a changed model is told apart from a changed engine.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from rlhf_mcore.rollout import SamplingParams
from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

GOLDEN = Path(__file__).resolve().parent / "data" / "rollout_stream_golden.json"


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


def golden_cases() -> list[dict]:
    """generate() calls covering continuous batching, seeded sampling, stop ids, top-k/top-p, repeated prompts."""
    repeated = make_prompts(3, seed=23)
    return [
        dict(name="greedy-batching", arch="llama", engine=dict(max_num_seqs=2, max_model_len=64),
             prompts=make_prompts(4, seed=20), params=dict(temperature=0, max_new_tokens=10), request_ids=None),
        dict(name="seeded-stops", arch="qwen2", engine=dict(max_num_seqs=4, max_model_len=80),
             prompts=make_prompts(5, seed=21),
             params=dict(n=3, temperature=1.3, max_new_tokens=14, seed=7, stop_token_ids=[19, 165, 696, 8, 885, 258, 478, 311, 592, 687, 253, 410]),
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
    engine = NativeRolloutEngine(model_dir, **case["engine"])
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


if __name__ == "__main__" and sys.argv[1:] == ["--write-golden"]:
    write_golden(GOLDEN)
