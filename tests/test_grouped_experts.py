"""The train engine's grouped experts (`rlhf_mcore.models.grouped_experts.GroupedExperts`) against megatron-core's
`SequentialMLP` on the same weights, in one process (CPU, fp32): forward and every gradient, an expert with no
tokens included; the checkpoint layout (keys, global shapes and offsets, values) both write; the shared grouped GEMM
(`rlhf_mcore.kernels.grouped_mm`) through torch's `_grouped_mm` (its CPU implementation in fp32) against the loop.
The models' logits against transformers, the HF round trips and the EP / PP checkpoints with these experts are
tests/test_moe.py's; the bf16 CUDA kernel's check is tests/test_moe_gpu.py's."""
import pytest
import torch

pytestmark = pytest.mark.cost(10)

CHUNKS: list = []  # the built model of `experts`
TINY = dict(arch="qwen3_moe", layers=2, hidden=32, heads=4, kv_heads=2, vocab=1000, experts=4, top_k=2,
            tie_word_embeddings=False)


@pytest.fixture(scope="module")
def experts(tiny_model_dir):
    """(GroupedExperts of a built tiny Qwen3-MoE with its HF weights, a SequentialMLP holding the same weights)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from rlhf_mcore.models import build_model
    from rlhf_mcore.models.grouped_experts import GroupedExperts
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    if torch.cuda.is_available():  # as tests/test_lora.py's CPU engine
        pytest.skip("a CPU engine would hide the GPUs from this whole process (cpu_compat)")
    state = init_distributed(device="cpu")
    chunk = build_model(tiny_model_dir(**TINY), state)[0]
    grouped = [m for m in chunk.modules() if isinstance(m, GroupedExperts)]
    assert len(grouped) == 1 and grouped[0].num_local_experts == 4  # layer 1 (layer 0 is dense: mlp_only_layers)
    grouped = grouped[0]
    seq = SequentialMLP(4, grouped.config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                         linear_fc2=RowParallelLinear),
                        pg_collection=state.pg_collection)
    with torch.no_grad():
        for i, mlp in enumerate(seq.local_experts):
            mlp.linear_fc1.weight.copy_(grouped.fc1_weight[i])
            mlp.linear_fc2.weight.copy_(grouped.fc2_weight[i])
    CHUNKS[:] = [chunk]
    yield grouped, seq
    CHUNKS.clear()
    destroy_distributed()


def run(module, x, counts, probs):
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, bias = module(x, counts, probs)
    assert bias is None
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, probs.grad


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 0, 0]], ids=["one_empty_expert", "no_tokens"])
def test_grouped_experts_equal_sequential_mlp(experts, counts):
    """Output, input, probs and weight gradients equal SequentialMLP's within 1e-6 (fp32), with expert 1 routed no
    tokens (its weight gradients: zero, present) and with no token at all. Mutations: the probs not multiplied
    in -> the outputs differ, fails; [up; gate] instead of [gate; up] (torch.chunk's halves swapped) -> fails."""
    grouped, seq = experts
    g = torch.Generator().manual_seed(0)
    t, h = sum(counts), grouped.config.hidden_size
    x, probs = torch.randn(t, h, generator=g), torch.rand(t, generator=g)
    counts = torch.tensor(counts)
    for m in (grouped, seq):
        m.zero_grad(set_to_none=True)
    got, want = run(grouped, x, counts, probs), run(seq, x, counts, probs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    fc1 = torch.stack([m.linear_fc1.weight.grad for m in seq.local_experts])
    fc2 = torch.stack([m.linear_fc2.weight.grad for m in seq.local_experts])
    torch.testing.assert_close(grouped.fc1_weight.grad, fc1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grouped.fc2_weight.grad, fc2, atol=1e-6, rtol=1e-6)
    assert grouped.fc1_weight.grad[counts == 0].abs().max() == 0
    if t:
        assert grouped.fc1_weight.grad[counts > 0].abs().min(dim=-1).values.max() > 0


def test_probs_on_input_as_sequential_mlp(experts):
    """moe_apply_probs_on_input (top-1 routing): the probs scale the input, as SequentialMLP does it."""
    grouped, seq = experts
    saved = (grouped.config.moe_apply_probs_on_input, grouped.config.moe_router_topk,
             seq.config.moe_apply_probs_on_input, seq.config.moe_router_topk)
    g = torch.Generator().manual_seed(1)
    x, probs, counts = torch.randn(6, grouped.config.hidden_size, generator=g), torch.rand(6, generator=g), [1, 2, 0, 3]
    try:
        for c in (grouped.config, seq.config):
            c.moe_apply_probs_on_input, c.moe_router_topk = True, 1
        got, want = run(grouped, x, torch.tensor(counts), probs), run(seq, x, torch.tensor(counts), probs)
    finally:
        (grouped.config.moe_apply_probs_on_input, grouped.config.moe_router_topk,
         seq.config.moe_apply_probs_on_input, seq.config.moe_router_topk) = saved
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _layout(module) -> dict:
    """{(key, global offset): (global shape, values)} of a module's checkpoint tensors (factories applied)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    prefix = "decoder.layers.1.mlp.experts."
    sd = module.sharded_state_dict(prefix=prefix)
    assert set(sd) <= set(module.state_dict(prefix=prefix))  # what load_state_dict gets back: the module's names
    apply_factories(sd)
    return {(t.key, t.global_offset): (t.global_shape, t.data.clone()) for t in nested_values(sd)
            if isinstance(t, ShardedTensor)}


def test_checkpoint_layout_is_sequential_mlps(experts):
    """GroupedExperts writes SequentialMLP's checkpoint tensors: the same keys, global shapes, offsets (fc1's gate
    and up halves apart) and values, so either loads the other's checkpoints, under the module's own state-dict
    names. Mutations: the up half at the gate's offset (tp_rank for both) -> the offsets differ, fails; the dict
    keyed by checkpoint keys -> not the state-dict names, fails."""
    grouped, seq = experts
    got, want = _layout(grouped), _layout(seq)
    assert {k for k, _ in got} == {"decoder.layers.1.mlp.experts.experts.linear_fc1.weight",
                                   "decoder.layers.1.mlp.experts.experts.linear_fc2.weight"}
    # SequentialMLP writes one piece per expert (its offsets along the expert axis); collect it into ours
    for (key, offset), (shape, data) in got.items():
        pieces = [(o, d) for (k, o), (s, d) in want.items() if k == key and s == shape and o[1:] == offset[1:]]
        assert sorted(o[0] for o, _ in pieces) == list(range(offset[0], offset[0] + data.shape[0])), (key, offset)
        for o, d in pieces:
            assert torch.equal(data[o[0] - offset[0]], d.reshape(data.shape[1:]))
    assert sum(d.numel() for _, d in got.values()) == sum(d.numel() for _, d in want.values())


def test_hf_names_view_the_stacked_weights(experts):
    """The loader / exporter see one view per local expert under SequentialMLP's names (the weight map's)."""
    from rlhf_mcore.models.grouped_experts import per_expert_views

    grouped, _ = experts
    views = per_expert_views("decoder.layers.1.mlp.experts.fc2_weight", grouped.fc2_weight)
    assert [n for n, _ in views] == [f"decoder.layers.1.mlp.experts.local_experts.{i}.linear_fc2.weight"
                                     for i in range(4)]
    assert all(v.data_ptr() == grouped.fc2_weight[i].data_ptr() for i, (_, v) in enumerate(views))
    assert per_expert_views("decoder.layers.1.mlp.router.weight", grouped.fc1_weight) == [
        ("decoder.layers.1.mlp.router.weight", grouped.fc1_weight)]


def test_torch_grouped_mm_call_equals_the_loop():
    """kernels.grouped_mm through torch._grouped_mm (the CUDA path's call: weights transposed, int32 end offsets;
    torch runs it on a CPU in fp32) equals the per-expert loop, forward and gradients, an empty group included.
    Mutation: offsets as counts instead of their cumulative sum -> fails."""
    from rlhf_mcore.kernels.grouped_mm import grouped_mm

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch < 2.8 has no _grouped_mm")
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(11, 16, generator=g), torch.randn(3, 24, 16, generator=g)
    counts, grad = torch.tensor([4, 0, 7]), torch.randn(11, 24, generator=g)
    results = []
    for grouped in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_mm(xi, wi, counts, grouped=grouped)
        y.backward(grad)
        results.append((y, xi.grad, wi.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fp8_training_refuses_moe_models(experts):
    """The FP8 recipe has no grouped-GEMM path: a MoE model is refused naming the key (before any device check), not
    trained with bf16 experts silently. Mutation: the refusal skipped -> the CPU device check's message instead,
    fails."""
    from rlhf_mcore.kernels.fp8 import Fp8Unsupported
    from rlhf_mcore.models.fp8_training import enable_fp8_training

    with pytest.raises(Fp8Unsupported, match="actor.megatron.fp8=e4m3: FP8 training of mixture-of-experts"):
        enable_fp8_training(CHUNKS, "e4m3", "actor.megatron.fp8")
