"""KV-cache reuse across a conversation's turns in the native engine (`Request.session`).

Conversations are driven by hand through the stream: each turn's prompt is the previous prompt + the sampled
response + a "tool message". With sessions the engine keeps each conversation's KV cache between turns and
prefills only the new tokens; every result must equal the same turns submitted without sessions (full
prefill), greedy and sampled, when prefixes do not match, under eviction, and after a weight update. The
agent scheduler's use of it is checked end to end on the native engine. CPU, fp32.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from subprocess_env import child_env
from test_rollout_native import _single_thread, make_prompts  # noqa: F401 (_single_thread: an autouse fixture)

from rlhf_mcore.rollout import Request, SamplingParams
from rlhf_mcore.rollout.native.engine import NativeRolloutEngine
from rlhf_mcore.rollout.native.weights import iter_safetensors

pytestmark = pytest.mark.cost(6)

REPO = Path(__file__).resolve().parents[1]

TURNS = 3
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[])
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=8, seed=11, stop_token_ids=[5, 17, 300, 401, 512, 640])


def engine_for(model_dir, **kw) -> NativeRolloutEngine:
    kw = {"max_num_seqs": 4, "max_model_len": 128, **kw}
    return NativeRolloutEngine(model_dir, device="cpu", **kw)


def drain(engine) -> dict:
    out = {}
    while engine.num_pending:
        for f in engine.step():
            out[f.request.request_id] = f.sample
    return out


def converse(engine, params, prompts, tool_msgs, sessions: bool, edit=None, between=None, plain=True,
             turns=TURNS):
    """Run `turns` turns of every conversation (all submitted together each turn, in reverse order on odd turns,
    plus one session-less request when `plain`, so prefills mix fresh and cached inputs).
    edit(turn, conv, history) -> history changes a prompt before it is submitted; between(turn) runs after each
    turn. Returns the samples per conversation
    and the prompt tokens prefilled / reused per turn."""
    histories = [list(p) for p in prompts]
    samples: list[list] = [[] for _ in prompts]
    counts = []
    engine.open_stream(params)
    try:
        for t in range(turns):
            if edit is not None:
                histories = [edit(t, c, h) for c, h in enumerate(histories)]
            before = dict(engine._stats)
            reqs = [Request(request_id=100 * c + t, prompt_ids=h, session=c if sessions else None)
                    for c, h in enumerate(histories)]
            if t % 2:
                reqs.reverse()
            if plain:
                reqs.append(Request(request_id=9000 + t, prompt_ids=histories[0][:5]))
            engine.submit(reqs)
            done = drain(engine)
            counts.append((engine._stats["prompt_tokens"] - before["prompt_tokens"],
                           engine._stats["reused_tokens"] - before["reused_tokens"]))
            for c in range(len(prompts)):
                s = done[100 * c + t]
                samples[c].append(s)
                histories[c] = histories[c] + s.token_ids + tool_msgs[c][t]
            if between is not None:
                between(t)
    finally:
        engine.close_stream()
    return samples, counts


def assert_same(got, want, atol=1e-5):
    for g_conv, w_conv in zip(got, want, strict=True):
        for g, w in zip(g_conv, w_conv, strict=True):
            assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=atol, rtol=0)


def conversations(n: int, seed: int):
    prompts = make_prompts(n, seed=seed, lengths=(6, 30))
    tool_msgs = [make_prompts(TURNS, seed=seed * 10 + c, lengths=(2, 12)) for c in range(n)]
    return prompts, tool_msgs


def test_reuse_prefills_only_new_tokens_with_equal_results(tiny_model_dir):
    prompts, tool_msgs = conversations(3, seed=1)
    for arch, params in (("qwen2", GREEDY), ("qwen3", SAMPLED)):
        engine = engine_for(tiny_model_dir(arch))
        want, full = converse(engine, params, prompts, tool_msgs, sessions=False)
        got, counts = converse(engine, params, prompts, tool_msgs, sessions=True)
        assert_same(got, want)
        plain = 5
        # turn 0 prefills everything; a later turn only the last sampled token (its KV was never computed)
        # and the tool message; the rest of the history comes from the kept cache
        assert counts[0] == full[0] == (sum(map(len, prompts)) + plain, 0)
        for t in (1, 2):
            new = sum(1 + len(tool_msgs[c][t - 1]) for c in range(3)) + plain
            assert counts[t][0] == new, (arch, t)
            assert counts[t][0] + counts[t][1] == full[t][0]
        assert engine.num_retained == 0  # close_stream drops the kept caches


def test_mismatched_prefix_reuses_only_the_common_part(tiny_model_dir):
    """Conversation 0's history is changed at its first token (nothing shared: full prefill), conversation 1's
    inside the last response (template drift: the common prefix is reused), conversation 2's not at all."""
    prompts, tool_msgs = conversations(3, seed=2)
    cut = {}

    def edit(t, c, h):
        if t != 2 or c == 2:
            return h
        h = list(h)
        i = 0 if c == 0 else len(h) - len(tool_msgs[c][1]) - 3  # inside turn 1's response
        h[i] = (h[i] + 1) % 900
        cut[c] = i
        return h

    engine = engine_for(tiny_model_dir("llama"))
    want, full = converse(engine, SAMPLED, prompts, tool_msgs, sessions=False, edit=edit)
    got, counts = converse(engine, SAMPLED, prompts, tool_msgs, sessions=True, edit=edit)
    assert_same(got, want)
    assert counts[2][0] + counts[2][1] == full[2][0]

    def kept(c):  # tokens with keys/values in conversation c's slot after turn 1: all but turn 1's last token
        r0, r1 = want[c][0].token_ids, want[c][1].token_ids
        return len(prompts[c]) + len(r0) + len(tool_msgs[c][0]) + len(r1) - 1

    assert 0 < cut[1] < kept(1)
    assert counts[2][1] == 0 + cut[1] + kept(2)


def test_eviction_under_capacity_pressure(tiny_model_dir):
    """Three conversations on two slots: kept caches are evicted for admissions (least recently kept first),
    results stay the same."""
    prompts, tool_msgs = conversations(3, seed=3)
    engine = engine_for(tiny_model_dir("qwen2"), max_num_seqs=2)
    want, full = converse(engine, SAMPLED, prompts, tool_msgs, sessions=False, plain=False)
    got, counts = converse(engine, SAMPLED, prompts, tool_msgs, sessions=True, plain=False)
    assert_same(got, want)
    assert engine.last_stats["evicted_sessions"] > 0
    assert sum(r for _, r in counts) > 0  # some turns still found their cache
    assert [p + r for p, r in counts] == [p for p, _ in full]


def test_update_weights_drops_kept_caches(tiny_model_dir):
    """After turn 1 the weights change: turn 2 must prefill its whole history under the new weights (a kept
    cache would hold the old weights' keys and values) and equal an engine built from the new weights."""
    old, new = tiny_model_dir("qwen3"), tiny_model_dir("qwen3", seed=1)
    prompts, tool_msgs = conversations(2, seed=4)
    engine = engine_for(old)

    def between(t):
        if t == 1:
            assert engine.num_retained == 2
            engine.update_weights(iter_safetensors(new))
            assert engine.num_retained == 0

    got, counts = converse(engine, GREEDY, prompts, tool_msgs, sessions=True, between=between, plain=False)
    histories = [prompts[c] + got[c][0].token_ids + tool_msgs[c][0] + got[c][1].token_ids + tool_msgs[c][1]
                 for c in range(2)]
    assert counts[2] == (sum(map(len, histories)), 0)
    reference = engine_for(new).generate(histories, GREEDY, request_ids=[2, 102])
    for c in range(2):
        assert got[c][2].token_ids == reference[c].samples[0].token_ids
        torch.testing.assert_close(torch.tensor(got[c][2].logprobs), torch.tensor(reference[c].samples[0].logprobs),
                                   atol=1e-5, rtol=0)


def test_release_and_abort_hand_slots_back(tiny_model_dir):
    engine = engine_for(tiny_model_dir("qwen2"), max_num_seqs=2)
    prompt = make_prompts(1, seed=5)[0]
    engine.open_stream(GREEDY)
    engine.submit([Request(1, prompt, session="a"), Request(2, prompt, session="b")])
    drain(engine)
    assert engine.num_retained == 2
    engine.release("a")
    engine.release("never-seen")  # no-op
    assert engine.num_retained == 1
    engine.submit([Request(3, prompt, session="b")])  # running while aborted: not kept
    engine.step()
    engine.abort()
    assert engine.num_retained == 0 and engine.num_pending == 0
    engine.submit([Request(4, prompt), Request(5, prompt)])  # both slots are free again
    assert len(drain(engine)) == 2
    engine.close_stream()


def test_agent_runner_reuses_each_trajectory_cache(tiny_model_dir):
    """The scheduler submits a trajectory's turns under one session and releases it when the trajectory ends:
    the trajectories equal those of the same run with sessions stripped, with fewer tokens prefilled."""
    from agent_helpers import fixture_tokenizer

    from rlhf_mcore.agents import AgentRunner, Environment, MultiTurnSettings, register_environment
    from rlhf_mcore.agents.rollout import agent_metrics, trajectory_info

    @register_environment("test_kv_three_turns", override=True)
    class ThreeTurns(Environment):
        def reset(self, row):
            self.n = 0
            return "Count with me."

        def step(self, text):
            self.n += 1
            return f"That was turn {self.n}. Next.", 0.0, self.n >= 3

    model_dir = tiny_model_dir("qwen2")
    tok, end = fixture_tokenizer(model_dir, "qwen2")
    msgs = [{"role": "user", "content": "Go."}]
    ids = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    rows = [{"raw_prompt": msgs, "agent_name": "env_agent", "extra_info": {"env_name": "test_kv_three_turns"},
             "index": i} for i in range(2)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=120, seed=2, stop_token_ids=(end,))
    settings = MultiTurnSettings(max_tokens_per_turn=8, max_user_turns=5)

    def run(strip_sessions: bool):
        engine = engine_for(model_dir, max_num_seqs=8, max_model_len=256)
        released = []
        submit, release = engine.submit, engine.release
        if strip_sessions:
            engine.submit = lambda reqs: submit([replace(r, session=None) for r in reqs])
        engine.release = lambda s: (released.append(s), release(s))
        runner = AgentRunner(engine, tok, settings)
        trajs = [t for per in runner.run([ids, ids], rows, params) for t in per]
        return trajs, runner.last_stats, sorted(released)

    got, stats, released = run(False)
    want, base, _ = run(True)
    assert released == [0, 1, 2, 3]  # one session per trajectory, each released at its end
    assert all(t.stats["turns"] == 3 for t in got)  # the environment's three model turns
    for g, w in zip(got, want, strict=True):
        assert g.response_ids == w.response_ids and g.response_mask == w.response_mask
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
    assert base["kv_reused_tokens"] == 0 and stats["kv_reused_tokens"] > 0
    assert stats["prefill_tokens"] + stats["kv_reused_tokens"] == base["prefill_tokens"]
    metrics = agent_metrics([trajectory_info(t) for t in got], stats)
    assert metrics["agent/kv_reused_tokens"] == stats["kv_reused_tokens"]
    assert metrics["agent/prefill_tokens"] == stats["prefill_tokens"]


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_attention_with_cached_prefixes_matches_fp64(device):
    """A prefill mixing fresh sequences and sequences after a cached prefix (GQA) against full causal attention
    over each sequence's whole history in fp64: fp32 on CPU (torch path); bf16 on GPU (torch and Triton)."""
    from rlhf_mcore.rollout.native.attention import PackedLayout, prefill_attention

    g = torch.Generator().manual_seed(0)
    hq, hkv, d, S, L = 8, 2, 64, 6, 96
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    fresh, cont = [7, 1, 30], [(3, 40, 5), (1, 9, 1), (4, 60, 33)]  # lengths; (slot, offset, new tokens)
    lengths = fresh + [n for _, _, n in cont]
    offsets = [0] * len(fresh) + [o for _, o, _ in cont]
    histories = [torch.randn(o + n, (hq + 2 * hkv), d, generator=g, dtype=torch.float64) for o, n in
                 zip(offsets, lengths)]  # per sequence: q, k, v heads of every position
    k_cache = torch.zeros(S, L, hkv, d, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    for (slot, o, n), h in zip(cont, histories[len(fresh):]):
        k_cache[slot, :o + n], v_cache[slot, :o + n] = h[:, hq:hq + hkv], h[:, hq + hkv:]
    new = torch.cat([h[o:] for h, o in zip(histories, offsets)])  # packed new tokens
    q, k, v = new[:, :hq], new[:, hq:hq + hkv], new[:, hq + hkv:]
    ref = []
    for h, o in zip(histories, offsets):
        qs, ks, vs = h[o:, :hq], h[:, hq:hq + hkv].repeat_interleave(hq // hkv, 1), h[:, hq + hkv:].repeat_interleave(
            hq // hkv, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * d ** -0.5
        pos_q, pos_k = torch.arange(o, h.shape[0])[:, None], torch.arange(h.shape[0])[None, :]
        scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
        ref.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
    ref = torch.cat(ref)
    layout = PackedLayout(lengths, device, offsets, [-1] * len(fresh) + [s for s, _, _ in cont])
    for attention in ("torch",) if device == "cpu" else ("torch", "triton"):
        def on(x):
            return x.to(device=device, dtype=dtype)

        out = prefill_attention(on(q), on(k), on(v), layout, d ** -0.5, on(k_cache), on(v_cache), attention)
        err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
        assert out.dtype == dtype and err <= (1e-6 if dtype == torch.float32 else 1e-2), (attention, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_on_gpu_reuse_equals_full_prefill(tiny_model_dir):
    """The GPU defaults (CUDA graphs, Triton attention and sampler, fused kernels) in fp32: sessions give the
    results of full prefills, with only the new tokens prefilled."""
    prompts, tool_msgs = conversations(3, seed=7)
    engine = NativeRolloutEngine(tiny_model_dir("qwen2"), max_num_seqs=4, max_model_len=128, device="cuda",
                                 dtype="float32")
    want, full = converse(engine, SAMPLED, prompts, tool_msgs, sessions=False)
    got, counts = converse(engine, SAMPLED, prompts, tool_msgs, sessions=True)
    assert_same(got, want, atol=1e-4)
    assert counts[2][1] > 0 and [p + r for p, r in counts] == [p for p, _ in full]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason=
    "on a GPU machine the compiled kernels run for real (the GPU tests of this file and "
    "test_rollout_native_gpu.py); the interpreter of older triton releases (the one torch 2.11 ships) cannot "
    "run the sampler kernel")
def test_triton_path_in_interpreter(tiny_model_dir):
    """The GPU path (cached-prefix prefill through the decode kernel, fused kernels, Triton sampler) run by
    Triton's CPU interpreter in fp32: with sessions it equals the torch path without them."""
    # CPU tensors (the interpreter's), also on a GPU machine
    env = child_env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, __file__, "--triton-interpret", str(tiny_model_dir("qwen3"))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ALL OK" in proc.stdout


def _triton_interpret_check(model_dir: str) -> None:
    torch.set_num_threads(1)
    prompts, tool_msgs = conversations(1, seed=6)
    params = replace(SAMPLED, max_new_tokens=3)
    args = dict(prompts=prompts, tool_msgs=tool_msgs, params=params, turns=2)  # + a fresh request in each prefill
    want, full = converse(engine_for(model_dir, max_model_len=64), sessions=False, **args)
    kern = engine_for(model_dir, max_model_len=64, attention="triton", sampler="triton", fused_kernels=True)
    got, counts = converse(kern, sessions=True, **args)
    assert_same(got, want, atol=1e-4)
    assert counts[1][1] > 0 and [p + r for p, r in counts] == [p for p, _ in full], (counts, full)
    print("ALL OK")


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--triton-interpret":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _triton_interpret_check(sys.argv[2])
