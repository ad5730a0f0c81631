"""Megatron's gradient-accumulation fusion without APEX (`megatron.override_transformer_config.
gradient_accumulation_fusion`, rlhf_mcore.models.grad_accum_fusion): the accumulation against a naive loop, the
update through `build_engine` against the unfused one, and the config's refusals."""
import pytest
import torch
from test_recompute import config  # the CPU actor's run config (micro-batches of 4 unless overridden)

pytestmark = pytest.mark.cost(20)

KEY = "actor_rollout_ref.actor.megatron.override_transformer_config.gradient_accumulation_fusion"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wgrad_accumulates_onto_main_grad_like_a_loop_over_tokens(dtype):
    """main_grad += dy^T x, in main_grad's fp32, on top of what it holds (a second micro-batch's call adds to the
    first's): against the sum of each token's outer product. Mutations: `main_grad.copy_` of the product instead of
    the in-place add (the first call's sum lost), or the operands swapped (dy^T x transposed) each fail it."""
    from rlhf_mcore.models.grad_accum_fusion import wgrad_gemm_accum_fp32

    g = torch.Generator().manual_seed(0)
    tokens, n_in, n_out = 7, 5, 3
    main = torch.randn(n_out, n_in, generator=g)
    want = main.clone().double()
    for _ in range(2):  # two micro-batches
        x = torch.randn(tokens, n_in, generator=g).to(dtype)
        dy = torch.randn(tokens, n_out, generator=g).to(dtype)
        for t in range(tokens):
            want += torch.outer(dy[t].double(), x[t].double())
        wgrad_gemm_accum_fp32(x, dy, main)
    assert main.dtype == torch.float32
    torch.testing.assert_close(main.double(), want, rtol=1e-6, atol=1e-6)



@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_fused_update_equals_the_unfused_one(tiny_model_dir, cpu_state, monkeypatch, tied):
    """Two updates of 4 micro-batches each through `build_engine`, with and without the fusion: the same losses and
    gradient norms and the same parameters after (fp32 on CPU, within rounding: the fused sum accumulates in another
    order), every decoder and output linear's weight gradient went through the fused accumulation (the DDP hook then
    skips its add: `grad_added_to_main_grad`), and the engine runs the decoder eager. With tied embeddings (Qwen2.5's
    small models) the output layer's fused sum and the embedding's gradient both reach the shared main_grad
    (Megatron's `zero_out_wgrad`). Between the two updates both engines offload and onload their parameters,
    gradients and optimizer state (the fused sums land in the restored buffers). Mutations: the builder not
    passing `gradient_accumulation_fusion` to the TransformerConfig (no fused call), the accumulation replaced by
    an assignment (each micro-batch's gradient overwrites the others': the updates differ) each fail it; an onload
    that leaves the parked buffers empty crashes it."""
    from test_train_cuda_graphs import rl_batch

    from rlhf_mcore.engine import build_engine
    from rlhf_mcore.models import grad_accum_fusion

    calls = []
    real = grad_accum_fusion.wgrad_gemm_accum_fp32
    monkeypatch.setattr(grad_accum_fusion.SHIM, "wgrad_gemm_accum_fp32",
                        lambda x, dy, main: calls.append(main.shape) or real(x, dy, main))
    model_dir = tiny_model_dir(arch="qwen2", vocab=512, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128,
                               init_std=0.02, tie_word_embeddings=tied)
    batch = rl_batch(8, 512, "cpu")
    results = {}
    for fused in (False, True):
        torch.manual_seed(0)
        engine = build_engine(config(model_dir, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                     f"{KEY}={str(fused).lower()}"), cpu_state, role="actor")
        calls.clear()
        metrics = [engine.update_policy(batch)]
        moved = engine.offload(params=True)  # the 7B config's colocation: parameters, gradients, optimizer off
        assert moved["grads"] > 0 and moved["params"] > 0 and moved["optimizer"] > 0, moved
        engine.onload()
        metrics.append(engine.update_policy(batch))
        results[fused] = metrics, [p.detach().clone() for p in engine.chunks[0].parameters()], len(calls)
        if fused:
            assert engine.cfg.cuda_graphs is False
    plain, fused = results[False], results[True]
    assert plain[2] == 0
    linears = 2 * 4 + 1  # per layer qkv, o, fc1, fc2; the output layer
    assert fused[2] == 2 * 4 * linears, fused[2]  # 2 updates x 4 micro-batches
    for m0, m1 in zip(plain[0], fused[0]):
        assert m1["actor/pg_loss"] == pytest.approx(m0["actor/pg_loss"], rel=1e-5, abs=1e-7)
        assert m1["actor/grad_norm"] == pytest.approx(m0["actor/grad_norm"], rel=1e-5)
    for a, b in zip(plain[1], fused[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # Adam (lr 1e-2) scales near-zero gradients up


def test_refusals_name_the_key_and_the_reason():
    """On the reference, with CUDA graphs forced on or with LoRA the key is refused in one line naming it and why;
    on the actor and the critic it loads, with FP8 training too (its linears accumulate their own weight gradients:
    tests/test_fp8.py)."""
    from rlhf_mcore.config import ConfigError, load_config

    base = ["actor_rollout_ref.model.path=/m"]
    ok = load_config(None, [*base, f"{KEY}=true",
                            "critic.megatron.override_transformer_config.gradient_accumulation_fusion=true"])
    assert ok.actor_rollout_ref.actor.megatron.override_transformer_config.gradient_accumulation_fusion
    fp8 = load_config(None, [*base, f"{KEY}=true", "actor_rollout_ref.actor.megatron.fp8=hybrid"])
    assert fp8.actor_rollout_ref.actor.megatron.fp8 == "hybrid"
    assert not load_config(None, base).actor_rollout_ref.actor.megatron.override_transformer_config\
        .gradient_accumulation_fusion
    ref = "actor_rollout_ref.ref.megatron.override_transformer_config.gradient_accumulation_fusion"
    bad = {(f"{ref}=true",): rf"'{ref}' has value True; it must be false: this model runs no backward pass",
           (f"{KEY}=true", "actor_rollout_ref.actor.megatron.cuda_graphs=true"):
           r"false with actor_rollout_ref.actor.megatron.cuda_graphs=true",
           (f"{KEY}=true", "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
            "actor_rollout_ref.model.target_modules=all-linear"): r"false with actor_rollout_ref.model.lora_rank > 0"}
    for overrides, msg in bad.items():
        with pytest.raises(ConfigError, match=msg) as e:
            load_config(None, [*base, *overrides])
        assert "\n" not in str(e.value)


CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the cuBLAS path (addmm with an fp32 output accumulated in place)")
def test_wgrad_accumulates_in_place_on_the_gpu():
    """On CUDA, bf16 operands: `torch.addmm(main_grad, dy^T, x, out_dtype=float32, out=main_grad)` adds into
    main_grad itself (the same storage, nothing allocated for the product) and matches the fp64 sum within fp32
    accumulation of bf16 products, over two calls."""
    from rlhf_mcore.models.grad_accum_fusion import cuda_form, wgrad_gemm_accum_fp32

    form = cuda_form(torch.device("cuda"))
    assert form == "addmm_out_dtype", (f"torch {torch.__version__}: addmm with out_dtype cannot accumulate in place "
                                       f"({form}): the fusion then gains nothing")
    g = torch.Generator(device="cuda").manual_seed(0)
    main = torch.randn(896, 4864, device="cuda", generator=g)
    want, ptr = main.double(), main.data_ptr()
    for _ in range(2):
        x = torch.randn(2048, 4864, device="cuda", generator=g).bfloat16()
        dy = torch.randn(2048, 896, device="cuda", generator=g).bfloat16()
        want += dy.double().t() @ x.double()
        wgrad_gemm_accum_fp32(x, dy, main)
    assert main.data_ptr() == ptr and main.dtype == torch.float32
    err = (main.double() - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-4, err


@pytest.mark.skipif(not CUDA, reason="needs CUDA: bf16 training with the fused accumulation")
def test_the_fused_update_tracks_the_unfused_one_on_the_gpu(tiny_model_dir):
    """bf16 on the GPU, 4 micro-batches: the fused update (fp32 sums straight from the GEMMs) against the unfused
    one (a bf16 gradient per micro-batch, then the add): the same loss, the gradient norm within 1%, the parameters
    within bf16 rounding of the step."""
    from test_train_cuda_graphs import rl_batch

    from rlhf_mcore.config import load_config
    from rlhf_mcore.engine import build_engine
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    model_dir = tiny_model_dir(arch="qwen2", vocab=1000, layers=2, heads=4, kv_heads=2)
    state = init_distributed(device="cuda")
    try:
        batch = rl_batch(16, 1000, "cuda")
        res = {}
        for fused in (False, True):
            torch.manual_seed(0)
            cfg = load_config(None, [f"actor_rollout_ref.model.path={model_dir}",
                                     "actor_rollout_ref.model.dtype=bfloat16",
                                     "actor_rollout_ref.actor.optim.lr=1e-3",
                                     "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                     "data.train_batch_size=16", "actor_rollout_ref.actor.megatron.cuda_graphs=false",
                                     f"{KEY}={str(fused).lower()}"])
            engine = build_engine(cfg, state, role="actor")
            metrics = engine.update_policy(batch)
            res[fused] = metrics, [p.detach().float().clone() for p in engine.chunks[0].parameters()]
        (m0, p0), (m1, p1) = res[False], res[True]
        assert m1["actor/pg_loss"] == pytest.approx(m0["actor/pg_loss"], rel=1e-3, abs=1e-5)
        assert m1["actor/grad_norm"] == pytest.approx(m0["actor/grad_norm"], rel=1e-2)
        for a, b in zip(p0, p1):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-2)
    finally:
        destroy_distributed()


def test_a_torch_without_the_in_place_fp32_gemm_falls_back_with_a_warning(monkeypatch):
    """`cuda_form` probes once whether `addmm(out_dtype=float32, out=acc)` accumulates a bf16 GEMM into acc in place;
    where it cannot (here: the CPU has no `addmm.dtype_out` kernel, as some torch releases refuse an fp32 `self`),
    the fusion adds the bf16 product instead and says so once. Mutation: the probe's exception not caught (the first
    fused backward would crash) fails it."""
    from rlhf_mcore.models import grad_accum_fusion

    monkeypatch.setattr(grad_accum_fusion, "_CUDA_FORM", None)
    with pytest.warns(UserWarning, match="cannot accumulate a bf16 GEMM into an fp32 tensor in place"):
        assert grad_accum_fusion.cuda_form(torch.device("cpu")) == "product_add"
    assert grad_accum_fusion.cuda_form(torch.device("cpu")) == "product_add"  # probed once
