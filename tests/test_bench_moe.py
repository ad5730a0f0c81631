"""launch/bench/bench_moe.py's CPU path (`--shape tiny --device cpu`, fp32): its four sections run through the real
engines and write the JSON keys BENCHMARKS.md reads, with values that hold in fp32 on one set of weights. No timing
is asserted. The GPU run (`--shape qwen3_30b_a3b_4l`) is the lead's."""
import json
import sys
from pathlib import Path

import pytest
from launcher import CPU, QUIET, run

pytestmark = pytest.mark.cost(18)  # the train section twice (grouped and sequential experts)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch" / "bench"))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_moe") / "moe.json"
    run("launch/bench/bench_moe.py", "--shape", "tiny", "--device", "cpu", "--out", str(out),
        "--train-experts", "grouped", "sequential", timeout=300, env_extra={**QUIET, **CPU})
    return json.loads(out.read_text())


def test_every_section_ran(report):
    for name in ("rollout", "kl", "train", "hf"):
        assert "error" not in report[name], (name, report[name])
        assert report["section_s"][name] > 0
    assert report["shape_name"] == "tiny" and report["device"] == "cpu" and report["dtype"] == "float32"


def test_rollout_and_the_hf_peer(report):
    """The native engine without and with route recording, transformers' generate with each cache (warmed), the
    ratio against the faster."""
    ro, hf = report["rollout"], report["hf"]
    assert ro["native_tok_s"] > 0 and ro["native_routes_tok_s"] > 0 and ro["native_decode_ms_per_step"] > 0
    assert ro["experts"] == "looped" and ro["cuda_graphs"] is False  # CPU: the looped expert path, eager
    assert hf["hf_dynamic_s"] > 0 and hf["hf_static_s"] > 0
    assert hf["hf_s"] == min(hf["hf_dynamic_s"], hf["hf_static_s"]) == hf[f"hf_{hf['hf_best']}_s"]
    assert hf["ratio_native_vs_hf"] == pytest.approx(hf["hf_s"] / ro["native_s"])


def test_kl_with_and_without_replay(report):
    """fp32, one set of weights: the trainer's log-probs equal the rollout's with R3 and without replay, and its own
    routing picks the rollout's experts for every fed token (prompt and response but the last). Mutations: the
    replayed routes shifted one token (batch["routed_experts"].roll(1, 1) in bench_kl) -> R3's k3 KL 7e-5 (max
    6e-4), fails; fed_tokens keeping each row's last token -> the token count fails."""
    kl, (batch, prompt, new) = report["kl"], report_rollout_plan()
    assert kl["sequences"] == batch and kl["response_tokens"] == batch * new
    for mode in ("r3", "no_replay"):
        assert 0 <= kl[mode]["k3_kl"] <= kl[mode]["k3_kl_max"] < 1e-6, (mode, kl[mode])
        assert kl[mode]["logprob_diff_abs"] < 1e-4
    mis = kl["routing_mismatch"]
    assert mis["tokens"] == batch * (prompt + new - 1)
    assert len(mis["per_layer"]) == report["shape"]["num_hidden_layers"] and mis["max"] == 0.0


def test_train_counts_active_parameters(report):
    """The update ran; FLOPs count the active parameters (top-k of the experts), and the shape's parameter counts
    match the model Megatron built. Mutation: moe_param_counts without the router -> total != Megatron's, fails."""
    import bench_shapes

    t, s = report["train"], report["shape"]
    assert t["tokens_per_step"] == t["sequences"] * t["seq"] and t["step_s"] > 0 and t["tflops"] > 0
    assert t["mfu"] is None and t["peak_tflops"] is None  # no peak FLOP/s for a CPU: MFU is not made up
    assert t["megatron_experts"] == "GroupedExperts" and t["grad_norm"] > 0
    assert t["total_params"] == t["params"] == bench_shapes.moe_param_counts(s)["total"]
    h, f, k, E = s["hidden_size"], s["moe_intermediate_size"], s["num_experts_per_tok"], s["num_experts"]
    all_experts = t["flop_matmul_params"] + s["num_hidden_layers"] * (E - k) * 3 * h * f  # as if every expert ran
    assert t["active_params"] < t["total_params"] and all_experts > 2 * t["flop_matmul_params"]


def test_train_side_by_side_with_sequential_experts(report):
    """`--train-experts grouped sequential`: the same update on Megatron's SequentialMLP in "train_sequential", the
    step-time ratio in train; one set of weights, one batch, fp32: the same gradient norm (the experts compute the
    same numbers). Mutation: build_actor ignoring its experts argument -> megatron_experts GroupedExperts twice,
    fails."""
    t, seq = report["train"], report["train_sequential"]
    assert "error" not in seq and seq["megatron_experts"] == "SequentialMLP"
    assert report["section_s"]["train_sequential"] > 0
    assert t["speedup_vs_sequential"] == pytest.approx(seq["step_s"] / t["step_s"])
    assert seq["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-5)


def test_the_30b_shape_has_the_model_cards_sizes():
    """At its 48 layers the 4-layer shape is Qwen3-30B-A3B: 30.5 B parameters, 3.3 B active (the model card's
    figures, truncated to one decimal)."""
    import bench_shapes

    counts = bench_shapes.moe_param_counts(bench_shapes.moe_shape("qwen3_30b_a3b_4l", num_hidden_layers=48))
    assert 30.5e9 <= counts["total"] < 30.6e9 and 3.3e9 <= counts["active"] < 3.4e9


def report_rollout_plan():
    import bench_moe

    return bench_moe.PLANS["tiny"]["rollout"]
