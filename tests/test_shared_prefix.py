"""Shared-prompt packing (`actor_rollout_ref.model.share_prompt_prefix`, rlhf_mcore.engine.shared_prefix): a prompt
packed once for all the rows of a micro-batch that have it gives the same log-probs and the same update as packing
every row whole, with fewer tokens computed."""
import pytest
import torch

pytestmark = pytest.mark.cost(20)

CUDA = torch.cuda.is_available()
P, R = 12, 20


def grouped_batch(groups: int, n: int, vocab: int, seed: int = 0) -> dict:
    """`groups` prompts x `n` rows each (GRPO's layout: a group's rows adjacent), prompts of 3-12 tokens, responses of
    1-20 (one row of each group with an empty response when n > 2), left-padded prompts, right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    B = groups * n
    prompts = torch.randint(3, vocab, (groups, P), generator=g).repeat_interleave(n, 0)  # (B, P)
    plen = torch.randint(3, P + 1, (groups,), generator=g).repeat_interleave(n)  # (B,)
    rlen = torch.randint(1, R + 1, (B,), generator=g)
    if n > 2:
        rlen[1::n] = 0
    resp = torch.randint(3, vocab, (B, R), generator=g)
    cols = torch.arange(P + R)
    mask = ((cols[None] >= P - plen[:, None]) & (cols[None] < P + rlen[:, None])).long()
    ids = torch.cat([prompts, resp], 1) * mask
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, P:], "response_mask": mask[:, P:],
            "old_log_probs": -6.2 + 0.1 * torch.randn(B, R, generator=g) * mask[:, P:],
            "advantages": torch.randn(B, R, generator=g) * mask[:, P:]}


def test_the_layout_packs_each_prompt_once_and_scores_every_response_token():
    """The packed tokens hold each prompt once and every response; each scored row's label is the response token of its
    grid cell, predicted by the prompt's last token (first response token) or the response token before it; RoPE
    positions continue after the prompt; each response's keys are its prompt then itself."""
    from rlhf_mcore.engine.shared_prefix import build_shared_prefix_inputs, prompt_groups
    from rlhf_mcore.models.attention_ops import shared_prefix_layout

    b = grouped_batch(3, 4, 100)
    ids, mask = b["input_ids"], b["attention_mask"]
    inp = build_shared_prefix_inputs(ids, mask, R)
    layout = shared_prefix_layout(inp.packed_seq_params)
    plen = mask[:, :P].sum(-1)
    rlen = mask[:, P:].sum(-1)
    assert prompt_groups(ids, mask, R) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert inp.num_tokens == int(plen[::4].sum() + rlen.sum()) < int(mask.sum())
    tokens = inp.input_ids[0]
    assert torch.equal(b["responses"].flatten()[inp.grid_index], inp.labels)
    assert int(inp.labels.numel()) == int(rlen.sum())
    for r, cell in zip(inp.rows.tolist(), inp.grid_index.tolist()):
        row, j = divmod(cell, R)
        want_prev = int(ids[row, P - 1]) if j == 0 else int(ids[row, P + j - 1])
        assert int(tokens[r]) == want_prev  # the token whose output predicts `lab`
        assert int(layout.positions[r]) == int(plen[row]) + j - 1
    # the documents: prompt (keys itself), then each non-empty response (keys prompt ++ itself)
    q = layout.cu_q.diff().tolist()
    kv = layout.cu_kv.diff().tolist()
    assert q[:4] == [int(plen[0]), int(rlen[0]), int(rlen[2]), int(rlen[3])]
    assert kv[:4] == [int(plen[0])] + [int(plen[0]) + int(rlen[i]) for i in (0, 2, 3)]
    first = layout.kv_index[layout.cu_kv[1]:layout.cu_kv[2]]
    assert first.tolist() == list(range(int(plen[0]))) + list(range(int(plen[0]), int(plen[0] + rlen[0])))


def _loop_layout(ids: torch.Tensor, mask: torch.Tensor, R: int, pad_to: int) -> dict:
    """The shared-prompt layout by a plain loop over groups and rows (the module's first implementation): the
    reference for the vectorised builder."""
    L = ids.shape[1]
    groups: dict[tuple, list[int]] = {}
    for b in range(ids.shape[0]):
        groups.setdefault(tuple(ids[b, :L - R][mask[b, :L - R].bool()].tolist()), []).append(b)
    out = {k: [] for k in ("tokens", "positions", "q_docs", "kv_docs", "kv_index", "rows", "labels", "grid")}
    offset = 0
    for prompt, g in groups.items():
        P, at = len(prompt), offset
        out["tokens"] += prompt
        out["positions"] += range(P)
        out["q_docs"].append(P)
        out["kv_docs"].append(P)
        out["kv_index"] += range(at, at + P)
        offset += P
        for b in g:
            cols = [j for j in range(R) if mask[b, L - R + j]]
            if not cols:
                continue
            n = len(cols)
            resp = [int(ids[b, L - R + j]) for j in cols]
            out["tokens"] += resp
            out["positions"] += range(P, P + n)
            out["q_docs"].append(n)
            out["kv_docs"].append(P + n)
            out["kv_index"] += [*range(at, at + P), *range(offset, offset + n)]
            out["rows"] += [at + P - 1, *range(offset, offset + n - 1)]
            out["labels"] += resp
            out["grid"] += [b * R + j for j in cols]
            offset += n
    pad = -(-max(offset, 1) // pad_to) * pad_to - offset
    if pad:
        out["tokens"] += [0] * pad
        out["positions"] += range(pad)
        out["q_docs"].append(pad)
        out["kv_docs"].append(pad)
        out["kv_index"] += range(offset, offset + pad)
    out["num_tokens"] = offset
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_vectorised_layout_equals_a_loop_over_rows(seed):
    """The builder (whole-array numpy) against `_loop_layout` on batches with shuffled rows (a group's rows apart),
    empty responses, gaps inside responses and padding to a multiple of 8: every index map equal.

    Mutations (each run once, each fails here): the first response token predicted by the token before it in the
    packing instead of the prompt's last (the `rows[...] = prompt_at + P - 1` line dropped); a response's keys
    without its prompt (the prompt piece's length 0 for responses); positions restarting at 0 for responses."""
    from rlhf_mcore.engine.shared_prefix import build_shared_prefix_inputs
    from rlhf_mcore.models.attention_ops import shared_prefix_layout

    b = grouped_batch(5, 4, 60, seed=seed)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(20, generator=g)
    ids, mask = b["input_ids"][order].clone(), b["attention_mask"][order].clone()
    mask[3, P + 1] = 0  # a gap inside a response
    ids[3, P + 1] = 0
    ref = _loop_layout(ids, mask, R, 8)
    inp = build_shared_prefix_inputs(ids, mask, R, pad_to_multiple_of=8)
    layout = shared_prefix_layout(inp.packed_seq_params)
    got = {"tokens": inp.input_ids[0], "positions": inp.position_ids[0], "q_docs": layout.cu_q.diff(),
           "kv_docs": layout.cu_kv.diff(), "kv_index": layout.kv_index, "rows": inp.rows, "labels": inp.labels,
           "grid": inp.grid_index}
    for k, v in got.items():
        assert v.tolist() == list(ref[k]), k
    padded = len(ref["tokens"]) > ref["num_tokens"]
    assert inp.num_tokens == ref["num_tokens"] and inp.seqlens == ref["q_docs"][:len(ref["q_docs"]) - padded]
    assert torch.equal(layout.positions, inp.position_ids[0])
    assert layout.max_q == max(ref["q_docs"]) and layout.max_kv == max(ref["kv_docs"])


def test_an_empty_prompt_is_refused():
    from rlhf_mcore.engine.shared_prefix import build_shared_prefix_inputs

    b = grouped_batch(1, 2, 50)
    b["attention_mask"][:, :P] = 0
    with pytest.raises(ValueError, match="empty prompt"):
        build_shared_prefix_inputs(b["input_ids"], b["attention_mask"], R)


def test_the_token_budget_keeps_groups_whole_and_splits_a_group_too_large():
    """With a token budget, a micro-batch holds whole groups, each prompt counted once; a group over the budget is
    cut into sub-groups that each pay for the prompt."""
    from rlhf_mcore.engine.micro_batches import plan_micro_batches
    from rlhf_mcore.engine.shared_prefix import group_costs, plan_groups, prompt_groups

    b = grouped_batch(4, 4, 100, seed=3)
    seqlens = b["attention_mask"].sum(-1).tolist()
    costs = group_costs(b["attention_mask"], R, prompt_groups(b["input_ids"], b["attention_mask"], R))
    budget = max(costs)
    plan = plan_micro_batches(seqlens, micro_batch_size=1, use_dynamic_bsz=True, max_token_len=budget,
                              shared_prefix_of=b)
    assert sorted(r for part in plan for r in part) == list(range(16))
    for part in plan:
        for grp in {r // 4 for r in part}:
            assert set(range(grp * 4, grp * 4 + 4)) <= set(part)  # whole groups
    units, unit_costs = plan_groups(b["attention_mask"], R, [[0, 1, 2, 3]], max_tokens=costs[0] - 1)
    assert len(units) >= 2 and sorted(sum(units, [])) == [0, 1, 2, 3] and max(unit_costs) <= costs[0] - 1


@pytest.fixture(scope="module")
def state(cpu_state):
    return cpu_state


def _engine(model_dir, state, shared: bool, dynamic: bool):
    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine import EngineConfig, TrainEngine
    from rlhf_mcore.models import build_model

    torch.manual_seed(0)
    chunks = build_model(model_dir, state, role="actor", dtype=torch.float32)
    cfg = EngineConfig(role="actor", micro_batch_size=8, mini_batch_size=16, use_dynamic_bsz=dynamic,
                       max_token_len=160, share_prompt_prefix=shared)
    return TrainEngine(chunks, state, cfg, OptimConfig(lr=1e-2))


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "token_budget"])
def test_log_probs_and_the_update_equal_whole_rows(tiny_model_dir, state, dynamic):
    """fp32 on CPU, 4 prompts x 4 rows (one empty response each): the shared layout's log-probs and entropy equal the
    whole rows' within 2e-5, its update's loss and gradient norm within 1e-5 relative, the updated parameters within
    1e-6, on fewer computed tokens.

    Mutations (each run once, each fails here): the responses' RoPE positions restarting at 0 (positions
    `arange(n)`) -> log-probs off by 3e-3; a response's keys without its prompt (kv_index of the response only) ->
    off by 0.33; the first response token predicted by the response's own first token instead of the prompt's last
    (rows shifted by one) -> off by 1.6; the causal mask aligned top-left (`tril(0)`) -> off by 0.38."""
    model_dir = tiny_model_dir(arch="qwen2", vocab=512, layers=2, hidden=64, heads=4, kv_heads=2,
                               intermediate=128, init_std=0.02)
    b = grouped_batch(4, 4, 512, seed=1)
    out = {}
    for shared in (False, True):
        engine = _engine(model_dir, state, shared, dynamic)
        lp, ent = engine.compute_log_probs(dict(b), with_entropy=True)
        before = [p.detach().clone() for p in engine.chunks[0].parameters()]
        metrics = engine.update_policy(dict(b))
        params = [p.detach().clone() for p in engine.chunks[0].parameters()]
        out[shared] = (lp, ent, metrics, params, before)
    (lp0, ent0, m0, p0, init), (lp1, ent1, m1, p1, _) = out[False], out[True]
    mask = b["response_mask"].bool()
    assert (lp0[mask] < -1).all()  # real log-probs, not zeros
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=2e-5)
    assert m1["actor/pg_loss"] == pytest.approx(m0["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert m1["actor/grad_norm"] == pytest.approx(m0["actor/grad_norm"], rel=1e-5)
    # Adam divides by each gradient's own scale, so an element with a gradient at rounding level moves by rounding:
    # the parameters agree to 1% of the update's largest move
    step = max(float((a - c).abs().max()) for a, c in zip(p0, init))
    assert max(float((a - c).abs().max()) for a, c in zip(p1, p0)) < 0.01 * step
    # tokens/s counts the tokens computed: each prompt once
    shared_tokens = int(b["attention_mask"][::4, :P].sum() + b["attention_mask"][:, P:].sum())
    assert shared_tokens < int(b["attention_mask"].sum())
    ratio = (m1["perf/actor/tokens_per_s"] * m1["perf/actor/update_s"]) / (m0["perf/actor/tokens_per_s"] *
                                                                           m0["perf/actor/update_s"])
    assert ratio == pytest.approx(shared_tokens / int(b["attention_mask"].sum()))


def test_the_critics_values_and_update_equal_whole_rows(tiny_model_dir, state):
    """`critic.model.share_prompt_prefix`: the value head's outputs at the rows that predict each response token (the
    first one at the shared prompt's last token) equal the whole rows' within 2e-5, and so do the critic update's
    loss (1e-5 relative) and gradient norm. Mutation: each response's rows shifted to its own tokens (the first
    token's value read at the response's first token instead of the prompt's last) -> values off by 0.46."""
    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine import EngineConfig, TrainEngine
    from rlhf_mcore.models import build_model

    model_dir = tiny_model_dir(arch="qwen2", vocab=512, layers=2, hidden=64, heads=4, kv_heads=2,
                               intermediate=128, init_std=0.02)
    b = grouped_batch(4, 4, 512, seed=4)
    g = torch.Generator().manual_seed(5)
    out = {}
    for shared in (False, True):
        torch.manual_seed(0)
        chunks = build_model(model_dir, state, role="critic", dtype=torch.float32)
        engine = TrainEngine(chunks, state, EngineConfig(role="critic", micro_batch_size=8, mini_batch_size=16,
                                                         share_prompt_prefix=shared), OptimConfig(lr=1e-2))
        values = engine.compute_values(dict(b))
        if not out:
            returns = (values + torch.randn(values.shape, generator=g)) * b["response_mask"]
        metrics = engine.update_critic({**b, "values": values, "returns": returns})
        out[shared] = (values, metrics)
    (v0, m0), (v1, m1) = out[False], out[True]
    assert v0[b["response_mask"].bool()].abs().min() > 0  # real values
    torch.testing.assert_close(v1, v0, rtol=0, atol=2e-5)
    assert m1["critic/vf_loss"] == pytest.approx(m0["critic/vf_loss"], rel=1e-5)
    assert m1["critic/grad_norm"] == pytest.approx(m0["critic/grad_norm"], rel=1e-5)


def test_the_engine_refuses_what_the_layout_cannot_run(tiny_model_dir, state):
    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine import EngineConfig, TrainEngine
    from rlhf_mcore.models import build_model

    model_dir = tiny_model_dir(arch="qwen2", vocab=512, layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64)
    chunks = build_model(model_dir, state, role="actor", dtype=torch.float32)
    with pytest.raises(ValueError, match="share_prompt_prefix=true does not run with padded sequences"):
        TrainEngine(chunks, state, EngineConfig(role="actor", use_remove_padding=False, share_prompt_prefix=True),
                    OptimConfig(lr=1e-3))


@pytest.mark.parametrize("extra, why", [
    (["actor_rollout_ref.model.use_remove_padding=false"], "padded sequences"),
    (["actor_rollout_ref.ref.megatron.cuda_graphs=true"], "ref.megatron.cuda_graphs=true"),
    (["actor_rollout_ref.actor.router_replay.mode=R2"], "router_replay.mode=R2"),
    (["actor_rollout_ref.actor.megatron.cuda_graphs=true"], "cuda_graphs=true"),
    (["actor_rollout_ref.actor.megatron.context_parallel_size=2"], "context parallelism"),
])
def test_the_config_refuses_what_the_layout_cannot_run(extra, why):
    from rlhf_mcore.config import load_config

    with pytest.raises(ValueError, match=f"actor_rollout_ref.model.share_prompt_prefix.*{why}"):
        load_config(None, ["actor_rollout_ref.model.path=/nonexistent",
                           "actor_rollout_ref.model.share_prompt_prefix=true", *extra])


def test_the_config_refuses_the_critics_key_where_its_layout_cannot_run():
    from rlhf_mcore.config import load_config

    base = ["actor_rollout_ref.model.path=/nonexistent", "algorithm.adv_estimator=gae",
            "critic.model.share_prompt_prefix=true"]
    load_config(None, base)  # packed, no graphs: accepted
    with pytest.raises(ValueError, match="critic.model.share_prompt_prefix.*padded sequences"):
        load_config(None, [*base, "critic.model.use_remove_padding=false"])
    with pytest.raises(ValueError, match="critic.model.share_prompt_prefix.*critic.megatron.cuda_graphs=true"):
        load_config(None, [*base, "critic.megatron.cuda_graphs=true"])


@pytest.mark.skipif(not CUDA, reason="Flash Attention over differing query and key documents needs CUDA")
def test_flash_attention_over_the_shared_layout_matches_the_reference_on_the_gpu():
    """On CUDA in bf16, the layout's attention (keys gathered, Flash Attention with cu_q != cu_kv, causal aligned
    bottom-right) against the fp32 per-document reference with explicit masks: output and query gradient within
    bf16 rounding. A top-left causal alignment in the kernel would be off by O(1) for every response token."""
    from rlhf_mcore.engine.shared_prefix import build_shared_prefix_inputs
    from rlhf_mcore.models.attention_ops import shared_prefix_attention, shared_prefix_layout

    b = grouped_batch(8, 8, 1000, seed=2)
    inp = build_shared_prefix_inputs(b["input_ids"].cuda(), b["attention_mask"].cuda(), R)
    layout = shared_prefix_layout(inp.packed_seq_params)
    T = inp.input_ids.shape[1]
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(T, h, 64, generator=g).cuda() for h in (14, 2, 2))
    grad = torch.randn(T, 14, 64, generator=g).cuda()

    def run(dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = shared_prefix_attention(*leaves, layout, 0.125)
        out.backward(grad.to(dtype))
        return out.float(), leaves[0].grad.float()

    out16, dq16 = run(torch.bfloat16)
    out32, dq32 = run(torch.float32)  # the per-document SDPA path with the explicit bottom-right masks
    assert float((out16 - out32).abs().max()) < 3e-2
    assert float((dq16 - dq32).abs().max()) < 5e-2


@pytest.mark.skipif(not CUDA, reason="needs CUDA: checks for device-to-host syncs")
def test_shared_layout_forward_and_backward_never_sync_with_the_host(tiny_model_dir):
    """The model's forward and backward over a shared-prompt micro-batch (bf16 on the GPU: the keys' gather, Flash
    Attention over differing query and key documents, RoPE from the layout's positions) run without a device-to-host
    synchronisation, as whole-row packed batches do (test_models.py), so the host can run ahead of the GPU. Session
    30's profile saw the shared update's GPU wait on the host 0.112 s against 0.069 s for whole rows; the inputs are
    built before the pass (on the host), outside the checked region."""
    from rlhf_mcore.engine.shared_prefix import build_shared_prefix_inputs
    from rlhf_mcore.models import build_model
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    state = init_distributed(device="cuda")
    try:
        model = build_model(tiny_model_dir(arch="qwen2", vocab=1000, layers=2, heads=4, kv_heads=2), state)[0]
        b = grouped_batch(4, 8, 1000, seed=3)

        def step():
            inp = build_shared_prefix_inputs(b["input_ids"].cuda(), b["attention_mask"].cuda(), R)
            torch.cuda.synchronize()
            return lambda: model(inp.input_ids, inp.position_ids, None,
                                 packed_seq_params=inp.packed_seq_params).float().square().mean().backward()

        step()()  # compiles and warms up
        torch.cuda.synchronize()
        run = step()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        destroy_distributed()
