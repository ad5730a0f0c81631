"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE): built from HF directories through the loader a user's directory
goes through, logits equal to transformers' in fp32, bitwise HF round trips, expert parallelism (EP), PP.

The distributed checks run in ONE 4-process torchrun launch (tests/scripts/moe_check.py) over the layouts
TP×PP×EP = 1×1×1 (four data-parallel replicas), 1×1×2 (each rank holds half the experts; tokens cross ranks through
Megatron's alltoall dispatcher), 1×2×1 (the dense layer on one stage, the sparse one on the other) and 2×1×2 (each
TP pair holds half the experts, each expert's fc1 / fc2 split over the pair; DP=2). pytest compares what the worker
saved with transformers run here on the same tiny fp32 models. (One launch of 4 costs fewer CPU-seconds than a
2-process launch for the TP=1 layouts plus a 4-process one for 2×1×2: each launch's processes pay their first
layout's warm-up, ~7 s, while a layout of these tiny models takes ~1 s.)
"""
import json
import re
from pathlib import Path

import pytest
import torch
from launcher import CPU, run

from rlhf_mcore.models import ModelShape, UnsupportedModelError

pytestmark = pytest.mark.cost(85)  # one 4-process worker (R3 engines at EP=2, PP=2, TP=2 included), one conversion

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "moe_check.py"
ATOL = 1e-5
DOC_LENS = [12, 7, 12]
# qwen3_moe: layer 0 dense (mlp_only_layers), layer 1 sparse, top-2 renormalised, untied head; qwen2_moe: layer 0
# dense (decoder_sparse_step=2), layer 1 sparse with the gated shared expert, top-2 not renormalised
TINY = dict(layers=2, hidden=32, heads=4, kv_heads=2, vocab=1000, experts=4, top_k=2)
MODELS = {"qwen3_moe": dict(arch="qwen3_moe", tie_word_embeddings=False, **TINY),
          "qwen2_moe": dict(arch="qwen2_moe", **TINY)}
LAYOUTS = [
    dict(name="1x1x1", tp=1, pp=1, ep=1, models=list(MODELS)),
    dict(name="1x1x2", tp=1, pp=1, ep=2, models=list(MODELS), readlog=list(MODELS), save_hf=["qwen2_moe"],
         aux=["qwen3_moe"], replay=["qwen3_moe"]),
    dict(name="1x2x1", tp=1, pp=2, ep=1, models=list(MODELS), replay=["qwen3_moe"]),
    dict(name="2x1x2", tp=2, pp=1, ep=2, models=list(MODELS), replay=["qwen3_moe"]),
]
FORWARD_CASES = [(lay["name"], m, case) for lay in LAYOUTS for m in lay["models"]
                 for case in ("plain", "left_padded", "thd")]
ROUNDTRIPS = [(lay["name"], m) for lay in LAYOUTS for m in lay["models"]]
ENV = {**CPU, "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir):
    return {name: tiny_model_dir(**kw) for name, kw in MODELS.items()}


@pytest.fixture(scope="module")
def mcore_ep2(model_dirs, tmp_path_factory):
    """qwen2_moe converted to a Megatron distributed checkpoint by the CLI with its experts split over 2 ranks."""
    out = tmp_path_factory.mktemp("mcore") / "qwen2_moe_ep2"
    run("launch/convert_checkpoint.py", "--direction", "hf2mcore", "--hf-dir", str(model_dirs["qwen2_moe"]),
        "--mcore-dir", str(out), "--ep", "2", nproc=2, env_extra=ENV)
    return out


@pytest.fixture(scope="module")
def worker(model_dirs, mcore_ep2, tmp_path_factory):
    """Run the 4-process worker once; returns (results dict, output dir)."""
    out = tmp_path_factory.mktemp("moe_worker")
    layouts = [{**lay, "load_mcore": {"qwen2_moe": str(mcore_ep2)}} if lay["name"] == "1x2x1" else lay
               for lay in LAYOUTS]
    spec = {"models": {k: str(v) for k, v in model_dirs.items()}, "layouts": layouts, "seed": 11,
            "doc_lens": DOC_LENS, "max_token": 900}
    (out / "spec.json").write_text(json.dumps(spec))
    run(WORKER, "--spec", str(out / "spec.json"), "--out", str(out), nproc=4, timeout=600, env_extra=ENV)
    return json.loads((out / "results.json").read_text()), out


@pytest.fixture(scope="module")
def documents():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 900, (n,), generator=g) for n in DOC_LENS]


_HF: dict = {}


def hf_doc_logits(path, docs):
    """transformers' logits of every document run alone: [(n_i, V)]."""
    import transformers

    if str(path) not in _HF:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            _HF[str(path)] = [model(d[None]).logits[0] for d in docs]
    return _HF[str(path)]


@pytest.mark.parametrize("layout,model,case", FORWARD_CASES)
def test_moe_logits_match_transformers(worker, model_dirs, documents, layout, model, case):
    """Mutations: moe.moe_config_kwargs' moe_router_pre_softmax=not norm_topk_prob -> norm_topk_prob (qwen2_moe
    renormalises its top-k) -> every case fails; moe.expert_offset returning 0 (every EP rank loads experts 0-1)
    -> the worker fails (its export plan finds two ranks holding one expert); weight_map.read_shard reading an
    expert's fc1 at TP rank 0's offset on every TP rank (rank = 0 if rule.expert) -> every 2x1x2 case fails (only
    that layout splits experts over TP)."""
    _, out = worker
    saved = torch.load(out / f"{layout}_{model}_{case}.pt")
    logits = saved["logits"]
    ref = hf_doc_logits(model_dirs[model], documents)
    vocab = ref[0].shape[-1]
    if case == "plain":
        pairs = [(logits[0], ref[0]), (logits[1], ref[2])]
    elif case == "left_padded":
        s = logits.shape[1]
        pairs = [(logits[i, s - len(doc):], ref[i]) for i, doc in enumerate(documents)]
    else:
        cu = saved["cu"].tolist()
        pairs = [(logits[0, a:b], ref[i]) for i, (a, b) in enumerate(zip(cu[:-1], cu[1:]))]
    for got, want in pairs:
        assert got.shape[0] == want.shape[0]
        err = (got[:, :vocab] - want).abs().max().item()
        assert err < ATOL, f"{layout} {model} {case}: max |Megatron - transformers| = {err:.3g}"


@pytest.mark.parametrize("layout,model", ROUNDTRIPS)
def test_moe_hf_roundtrip_is_bitwise(worker, layout, model):
    """Every rank exports every HF tensor (the experts of the other EP rank too) bitwise equal to the checkpoint, in
    `expected_hf_names` order. Mutations: hf_export's EP broadcast skipped (each rank yields its empty buffer for the
    other rank's experts) -> fails; weight_map.join_tp_shards joining an expert's fc1 shards as plain rows (not
    [gate_0; gate_1; up_0; up_1]) -> 2x1x2 fails."""
    results, _ = worker
    assert results[layout][f"{model}/roundtrip"] == []


@pytest.mark.parametrize("model", list(MODELS))
def test_ep_ranks_read_only_their_experts(worker, model):
    results, _ = worker
    got = results["1x1x2"][f"{model}/experts_read"]
    assert got == [{"ep_rank": 0, "experts": [0, 1]}, {"ep_rank": 1, "experts": [2, 3]}] * 2  # DP=4: 2 EP groups


def test_logged_moe_losses_equal_the_naive_ones(worker):
    """At EP=2 the logged load-balancing loss and z-loss (means over MoE layers) equal Megatron's formulas computed
    by hand from each router's input; a second read finds the tracker cleared. Mutation: moe_loss_metrics'
    clear_aux_losses_tracker() skipped -> `again` is not empty -> fails."""
    results, _ = worker
    aux = results["1x1x2"]["qwen3_moe/aux"]
    assert set(aux["logged"]) == {"actor/moe_load_balancing_loss", "actor/moe_z_loss"}
    for key, want in aux["naive"].items():
        assert aux["logged"][key] == pytest.approx(want, rel=1e-5), key
    assert aux["again"] == {}


@pytest.mark.parametrize("layout", ["1x1x2", "1x2x1", "2x1x2"])
def test_r3_replay_is_exact_at_ep2_pp2_and_tp2(worker, layout):
    """R3 through the train engine and the learner at EP=2 (each rank's tokens routed to the other's experts), PP=2
    (the MoE layer on the second stage) and TP=2 x EP=2 (without sequence parallelism, as a user's config has it:
    replay refuses it): with every token's routes flipped, the replaying old-log-prob pass equals transformers'
    log-probs, the pass without replay does not, and the metric reduced over the ranks (and stages) sees every token
    flipped. Mutation: Learner.routing_metrics without the reduction over the pipeline group -> the PP=2 mismatch
    reads 0 on the first stage's rank -> fails."""
    results, _ = worker
    r = results[layout]["qwen3_moe/replay"]
    assert r["r3_vs_hf"] < ATOL and r["plain_vs_hf"] > 1e-2
    assert r["mismatch"] == 1.0 and r["load"] >= 1.0


def test_routing_counts_equal_naive_ones():
    """mismatch_counts (top-k SETS compared: another order is no mismatch), expert_counts and the summary against
    loops. Mutation: mismatch_counts without the sort -> the reordered routes count as flips -> fails."""
    from rlhf_mcore.models.routing_replay import expert_counts, mismatch_counts, routing_summary

    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 4, (3, 5, 2, 2), generator=g)  # (B, S, n layers, k)
    b = a.flip(-1).clone()  # the same sets in another order: no mismatch
    b[0, 0, 1] = torch.tensor([7, 8])
    b[2, 4, 1] = torch.tensor([7, 8])
    valid = torch.ones(3, 5, dtype=torch.bool)
    valid[2, 4] = False  # not counted
    got = mismatch_counts(a, b, valid)
    want_diff = [[0, 0], [0, 0]]
    for layer in range(2):
        for i in range(3):
            for j in range(5):
                if valid[i, j]:
                    want_diff[layer][1] += 1
                    want_diff[layer][0] += set(a[i, j, layer].tolist()) != set(b[i, j, layer].tolist())
    assert got.tolist() == want_diff == [[0, 14], [1, 14]]
    counts = expert_counts(a, valid, 4)
    naive = torch.zeros(2, 4, dtype=torch.long)
    for i, j in valid.nonzero().tolist():
        for layer in range(2):
            for e in a[i, j, layer].tolist():
                naive[layer, e] += 1
    assert torch.equal(counts, naive)
    m = routing_summary(got, counts, "actor/")
    assert m["actor/moe_routing_mismatch/mean"] == pytest.approx(1 / 28)
    assert m["actor/moe_routing_mismatch/max"] == 1 / 14
    load = [float(c.max()) / float(c.float().mean()) for c in naive]
    assert m["actor/moe_expert_load/mean"] == pytest.approx(sum(load) / 2)
    assert m["actor/moe_expert_load/max"] == pytest.approx(max(load))


def test_megatron_checkpoint_saved_at_ep2_loads_at_pp2(worker, model_dirs):
    """`convert_checkpoint.py --ep 2` (2 processes) -> Megatron checkpoint -> loaded at PP=2 without EP: every tensor
    exported bitwise, and the HF directory mcore2hf writes equals the source."""
    results, out = worker
    assert results["1x2x1"]["qwen2_moe/from_mcore_roundtrip"] == []
    assert_same_hf_weights(out / "1x2x1_qwen2_moe_from_mcore_hf", model_dirs["qwen2_moe"])


def assert_same_hf_weights(saved_dir, src):
    from safetensors.torch import load_file

    saved = {}
    for f in sorted(saved_dir.glob("model-*.safetensors")):
        saved.update(load_file(f))
    ref = load_file(src / "model.safetensors")
    assert set(saved) == set(ref)
    assert all(torch.equal(saved[k], ref[k]) for k in ref)


def test_hf_checkpoint_saved_at_ep2_equals_the_source(worker, model_dirs):
    _, out = worker
    saved_dir, src = out / "1x1x2_qwen2_moe_hf", model_dirs["qwen2_moe"]
    assert_same_hf_weights(saved_dir, src)
    cfg = json.loads((saved_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2MoeForCausalLM"] and cfg["num_experts"] == 4


# ------------------------------------------------------------------------------------------------------------
# in-process: the shape read from config.json against transformers' own model

@pytest.mark.parametrize("arch,extra", [
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[0, 2], decoder_sparse_step=1, norm_topk_prob=True)),
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[], decoder_sparse_step=2)),
    ("Qwen2MoeForCausalLM", dict(mlp_only_layers=[1], decoder_sparse_step=1, shared_expert_intermediate_size=24)),
])
def test_moe_shape_matches_transformers(arch, extra):
    """Sparse layers, widths and the parameter count equal those of transformers' model built from the same
    config. Mutation: moe.sparse_layers using `i % step == 0` -> fails."""
    import transformers

    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    hf_cfg = cfg_cls(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=4,
                     num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, **extra)
    model = getattr(transformers, arch)(hf_cfg)
    cfg = {**hf_cfg.to_dict(), "architectures": [arch]}
    shape = ModelShape.from_config_dict(cfg)
    sparse = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert shape.moe_layers == sparse and shape.num_experts == 4 and shape.moe_top_k == 2
    assert shape.moe_ffn_hidden_size == 8 and shape.norm_topk_prob == hf_cfg.norm_topk_prob
    assert shape.num_params() == sum(p.numel() for p in model.parameters())


def _config(**cfg):
    base = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                num_hidden_layers=2, intermediate_size=24, vocab_size=64, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=8)
    return {**base, **cfg}


@pytest.mark.parametrize("cfg,words", [
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5"),
    (dict(shared_expert_intermediate_size=8), "no shared expert"),
    (dict(mlp_only_layers=[0, 1]), "no sparse layer"),
    (dict(architectures=["Qwen2MoeForCausalLM"], qkv_bias=False), "qkv_bias=false"),
])
def test_unsupported_moe_configs_fail_with_the_key(cfg, words):
    with pytest.raises(UnsupportedModelError, match=words):
        ModelShape.from_config_dict(_config(**cfg))


def test_expert_layout_errors_name_the_setting():
    from rlhf_mcore.models.hf_config import validate_parallel_layout
    from rlhf_mcore.models.pipeline_layout import PipelineLayoutError

    shape = ModelShape.from_config_dict(_config())
    with pytest.raises(PipelineLayoutError, match="expert_model_parallel_size=3 must divide num_experts=4"):
        validate_parallel_layout(shape, 1, 1, None, ep=3)
    dense = ModelShape.from_config_dict({**_config(), "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(PipelineLayoutError, match="needs a mixture-of-experts model"):
        validate_parallel_layout(dense, 1, 1, None, ep=2)


# ------------------------------------------------------------------------------------------------------------
# config keys: veRL's expert_model_parallel_size, the MoE loss coefficients

MODEL = ["actor_rollout_ref.model.path=/models/m", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=1",
         "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
A = "actor_rollout_ref.actor.megatron."


def test_expert_parallel_size_is_the_actors_and_ref_critic_must_share_it():
    from rlhf_mcore.config import ConfigError, expert_parallel_size, load_config, moe_overrides

    assert expert_parallel_size(load_config(None, MODEL)) == 1
    cfg = load_config(None, MODEL + [f"{A}expert_model_parallel_size=2",
                                     f"{A}override_transformer_config.moe_aux_loss_coeff=0.01"])
    assert expert_parallel_size(cfg) == 2
    assert moe_overrides(cfg.actor_rollout_ref.actor.megatron) == {"moe_aux_loss_coeff": 0.01}
    assert moe_overrides(cfg.actor_rollout_ref.ref.megatron) == {}
    bad = load_config(None, MODEL + [f"{A}expert_model_parallel_size=2",
                                     "actor_rollout_ref.ref.megatron.expert_model_parallel_size=4"])
    with pytest.raises(ConfigError, match="ref.megatron.expert_model_parallel_size' is 4 but the actor's is 2"):
        expert_parallel_size(bad)


@pytest.mark.parametrize("override,words", [
    (f"{A}expert_model_parallel_size=0", "expert_model_parallel_size' has value 0; it must be unset or >= 1"),
    (f"{A}override_transformer_config.moe_aux_loss_coeff=-1", "moe_aux_loss_coeff' has value -1"),
    (f"{A}override_transformer_config.moe_z_loss_coeff=0", "moe_z_loss_coeff' has value 0"),
])
def test_bad_moe_keys_fail_with_the_key(override, words):
    from rlhf_mcore.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(None, MODEL + [override])


def test_expert_parallel_size_must_divide_dp():
    from rlhf_mcore.config import ConfigError, load_config, validate_config

    cfg = load_config(None, MODEL + [f"{A}expert_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="expert_model_parallel_size=2 must divide the data-parallel size 3"):
        validate_config(cfg, 3, read_model=False)
    validate_config(cfg, 2, read_model=False)


def test_dense_models_refuse_moe_loss_coefficients():
    from rlhf_mcore.models.hf_config import transformer_config

    dense = ModelShape.from_config_dict({**_config(), "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(ValueError, match=r"\['moe_aux_loss_coeff'\] .* has no experts: remove them"):
        transformer_config(dense, tp=1, pp=1, vpp=None, dtype=torch.float32, on_cpu=True, moe_aux_loss_coeff=0.1)


def test_flops_count_the_active_parameters():
    """The FLOP model of a MoE config counts each token's active matmul parameters: attention, the dense layers'
    MLP, top_k routed experts and the shared expert of each MoE layer, the router. Mutation: _moe_active counting
    all experts (num_moe_experts instead of moe_router_topk) -> fails."""
    from rlhf_mcore.engine.flops import FlopShape
    from rlhf_mcore.models.hf_config import transformer_config

    shape = ModelShape.from_config_dict({**_config(num_hidden_layers=3, mlp_only_layers=[0]), "architectures":
                                         ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": 12})
    config = transformer_config(shape, tp=1, pp=1, vpp=None, dtype=torch.float32, on_cpu=True)
    flop = FlopShape.from_transformer_config(config, vocab_size=64)
    h = 16
    attn = h * 8 * (2 + 2 * 1) + 2 * 8 * h  # q (2 heads) + k, v (1 group) of head_dim 8, and o
    want = 3 * attn + 3 * h * 24 + 2 * (3 * h * (2 * 8 + 12) + h * 4)  # 1 dense + 2 MoE layers (top-2 of 4, shared)
    assert flop.matmul_params == want


# ------------------------------------------------------------------------------------------------------------
# config keys: veRL's actor.router_replay.mode and rollout.enable_rollout_routing_replay

RR = "actor_rollout_ref.actor.router_replay.mode"
REC = "actor_rollout_ref.rollout.enable_rollout_routing_replay"


def test_the_rollout_records_routes_for_r3_or_when_asked():
    from rlhf_mcore.config import load_config, rollout_records_routes

    assert not rollout_records_routes(load_config(None, MODEL))
    assert rollout_records_routes(load_config(None, MODEL + [f"{RR}=R3"]))
    assert not rollout_records_routes(load_config(None, MODEL + [f"{RR}=R2"]))
    assert rollout_records_routes(load_config(None, MODEL + [f"{RR}=R2", f"{REC}=true"]))  # measured, not replayed


@pytest.mark.parametrize("overrides,words", [
    ([f"{RR}=R3", "actor_rollout_ref.rollout.name=hf"], f"'{RR}' has value 'R3'; it must be R2 or disabled with "
                                                        "rollout.name=hf: only the native engine records"),
    ([f"{REC}=true", "actor_rollout_ref.rollout.name=sglang"], f"'{REC}' has value True; it must be unset or false "
                                                               "with rollout.name=sglang"),
    ([f"{RR}=R3", f"{REC}=false"], f"'{REC}' has value False; it must be unset or true with router_replay.mode=R3"),
    ([f"{RR}=R3", "actor_rollout_ref.rollout.multi_turn.enable=true"], "with rollout.multi_turn.enable=true"),
    ([f"{RR}=R2", "actor_rollout_ref.actor.use_rollout_log_probs=true"], "R3 or disabled with "
                                                                         "actor.use_rollout_log_probs=true"),
    ([f"{RR}=R3", "actor_rollout_ref.model.enable_gradient_checkpointing=true"], "would route again"),
    ([f"{RR}=R2", f"{A}sequence_parallel=true"], "not split over the tensor-parallel ranks"),
    ([f"{RR}=R3", f"{A}cuda_graphs=true"], "keep the first micro-batch's routes"),
    ([f"{RR}=R5"], "choose one of disabled, R2, R3"),
])
def test_router_replay_where_it_cannot_apply_is_refused(overrides, words):
    from rlhf_mcore.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(None, MODEL + overrides)


def test_router_replay_on_a_dense_model_is_refused(tmp_path):
    """validate_config reads the policy's config.json: a dense model has no experts to route."""
    from rlhf_mcore.config import ConfigError, load_config, validate_config

    for name, arch in (("dense", "Qwen3ForCausalLM"), ("moe", "Qwen3MoeForCausalLM")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**_config(), "architectures": [arch]}))
    for key in (f"{RR}=R3", f"{REC}=true"):
        with pytest.raises(ConfigError, match=f"{tmp_path / 'dense'} is a dense model"):
            validate_config(load_config(None, MODEL + [key, f"actor_rollout_ref.model.path={tmp_path / 'dense'}"]),
                            1)
        validate_config(load_config(None, MODEL + [key, f"actor_rollout_ref.model.path={tmp_path / 'moe'}"]), 1)


def test_a_trained_moe_model_at_tp2_needs_sequence_parallelism(tmp_path):
    """megatron-core 0.16.1's MoE layer raises at the first training forward at TP > 1 without sequence parallelism
    (tests/scripts/moe_check.py scores in eval mode for that): validate_config refuses it before the launch, for the
    actor and a MoE critic, and says when replay or LoRA leaves TP=1 as the fix. Mutation: validate_config without
    check_moe_tensor_parallel -> nothing refused -> fails."""
    from rlhf_mcore.config import ConfigError, load_config, validate_config

    for name, arch in (("dense", "Qwen3ForCausalLM"), ("moe", "Qwen3MoeForCausalLM")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**_config(), "architectures": [arch]}))
    sp, csp = f"{A}sequence_parallel", "critic.megatron.sequence_parallel"

    def validate(model, *extra):
        cfg = load_config(None, MODEL + [f"actor_rollout_ref.model.path={tmp_path / model}",
                                         f"{A}tensor_model_parallel_size=2", "algorithm.adv_estimator=remax", *extra])
        validate_config(cfg, 2)

    for extra, words in (
            ([], f"'{sp}' has value False; it must be true with tensor_model_parallel_size=2: {tmp_path / 'moe'} is "
                 "a mixture-of-experts model"),
            ([f"{RR}=R3"], "actor.router_replay.mode=R3 refuses sequence parallelism: set tensor_model_parallel_size"),
            ([f"{sp}=true", "critic.enable=true"], f"'{csp}' has value False")):
        with pytest.raises(ConfigError, match=re.escape(words)):
            validate("moe", *extra)
    validate("moe", f"{sp}=true")
    validate("moe", f"{sp}=true", "critic.enable=true", f"{csp}=true")
    validate("dense")


def test_sft_of_a_moe_model_at_tp2_is_refused_before_any_process_group(tiny_model_dir, tmp_path):
    """launch/sft.py's body refuses --tp 2 for a MoE model with the same message, before it reads the data or makes a
    process group (megatron-core's own error came at the first step). Mutation: run_sft without
    check_moe_tensor_parallel -> init_distributed's world-size error instead -> fails."""
    from rlhf_mcore.config import ConfigError
    from rlhf_mcore.trainer.sft import run_sft

    model = tiny_model_dir(**MODELS["qwen3_moe"])
    with pytest.raises(ConfigError, match=re.escape("is a mixture-of-experts model")):
        run_sft(str(model), str(tmp_path / "no_rows.parquet"), str(tmp_path / "out"), steps=1, batch_size=2,
                lr=1e-5, max_length=64, tp=2)


def test_reward_model_training_of_a_moe_model_at_tp2_is_refused_first(tiny_model_dir, tmp_path):
    """launch/train_rm.py's body refuses --tp 2 for a MoE model before it reads the preference data. Mutation: the
    check removed -> it goes on to read the (missing) data file -> a different error -> fails."""
    from rlhf_mcore.config import ConfigError
    from rlhf_mcore.trainer.rm_training import run_train_rm

    model = tiny_model_dir(**MODELS["qwen3_moe"])
    with pytest.raises(ConfigError, match=re.escape("is a mixture-of-experts model")):
        run_train_rm(str(model), str(tmp_path / "no_pairs.parquet"), str(tmp_path / "out"), tp=2)
