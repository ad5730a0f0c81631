"""The benchmarks' CPU path (tiny shapes): they run, and their JSON has the keys and sane values BENCHMARKS.md and
`launch/benchmark.py` read. No timing is asserted anywhere.

One subprocess runs the new benchmark scripts' `main()`s back to back (torch + megatron imported once: ~25 s on
the 2-core CI machines instead of ~2 min for one process each); the driver itself runs once on the cheapest
benchmark (the computed memory plan).
"""
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from launcher import QUIET, run
from launcher import env as child_env

pytestmark = pytest.mark.cost(30)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch" / "bench"))


def _env():
    return child_env(**QUIET)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    driver = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "launch" / "bench")!r})
        import bench_lora_linear, bench_memory, bench_mfu, bench_packed_attention, bench_ppo_step, bench_rollout
        import profile_decode
        import bench_trl
        out, model = {str(out)!r}, {str(out / 'model')!r}
        bench_mfu.main(["--one-shape", "tiny", "--child-out", out + "/mfu.json", "--seqs", "32", "64",
                        "--warmup", "1", "--steps", "1"])
        bench_mfu.main(["--one-shape", "tiny", "--peer", "--child-out", out + "/mfu_peer.json", "--seqs", "32", "64",
                        "--warmup", "1", "--steps", "1"])
        bench_mfu.main(["--one-shape", "tiny", "--grad-accum-fusion", "--layers", "1", "--child-out",
                        out + "/mfu_fusion.json", "--seqs", "32", "--warmup", "0", "--steps", "1"])
        bench_mfu.main(["--one-shape", "tiny", "--peer", "--peer-params", "bf16", "--child-out",
                        out + "/mfu_peer_bf16.json", "--seqs", "32", "--warmup", "0", "--steps", "1"])
        bench_ppo_step.main(["--workload", "gsm8k_ppo", "--tiny", "--steps", "1", "--profile", "--model-dir", model,
                             "--replay-passes", "2", "--out", out + "/ppo_step.json"])
        bench_ppo_step.main(["--workload", "trl_grpo", "--tiny", "--steps", "1", "--model-dir", model,
                             "--out", out + "/grpo_step.json"])
        bench_ppo_step.main(["--workload", "trl_grpo", "--tiny", "--steps", "1", "--model-dir", model, "--bare",
                             "--out", out + "/grpo_step_bare.json"])
        bench_memory.main(["--tiny", "--measure", "--out", out + "/memory.json"])
        bench_trl.main(["--tiny", "--steps", "2", "--model-dir", model, "--out", out + "/trl.json"])
        bench_trl.main(["--tiny", "--steps", "2", "--model-dir", model, "--gradient-checkpointing", "off",
                        "--out", out + "/trl_no_gc.json"])
        bench_packed_attention.main(["--tiny", "--reps", "2", "--out", out + "/packed_attention.json"])
        bench_rollout.main(["--tiny", "--batches", "4", "--out", out + "/rollout.json"])
        profile_decode.main(["--tiny", "--vocab", "512", "--samples", "2", "--out", out + "/profile_decode.json"])
        from rlhf_mcore.rollout.native import model as nm
        before = (nm.TRITON_OUT_PROJ_MAX_ROWS, nm.FUSED_SILU_MAX_ROWS, nm.FP8_TRITON_DECODE)
        profile_decode.main(["--tiny", "--cublas-gemms", "--model-dir", out + "/decode_model",
                             "--out", out + "/profile_decode_cublas.json"])
        assert (nm.TRITON_OUT_PROJ_MAX_ROWS, nm.FUSED_SILU_MAX_ROWS, nm.FP8_TRITON_DECODE) == before, (
            "profile_decode kept its routing")
        bench_lora_linear.main(["--shape", "tiny", "--tokens", "32", "--warmup", "0", "--reps", "1",
                                "--out", out + "/lora_linear.json"])
    """)
    proc = subprocess.run([sys.executable, "-c", driver], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")} | {
        "profile": (out / "ppo_step_profile.txt").read_text()}


def test_packed_attention_json(outputs):
    case = outputs["packed_attention"]["cases"]["tiny"]
    assert case["documents"] > 1 and case["flex_block_mask_ms"] > 0
    ref, flex = case["per_document_sdpa"], case["flex"]
    assert "error" not in ref and "error" not in flex, case
    assert ref["max_abs_err"] < 1e-5 and ref["forward_ms"] > 0 and ref["fwd_bwd_ms"] > 0  # fp32 against fp32
    assert flex["max_abs_err"] < 1e-4 and "fwd_bwd_ms" not in flex  # eager flex: no backward on CPU
    assert "varlen" not in case  # CUDA only


def test_rollout_json(outputs):
    """The rollout peer at its best: HF `generate` with its dynamic and static caches, each warmed at full length;
    the ratio is against the faster, which the row names."""
    row = outputs["rollout"]["rows"][0]
    assert row["hf_dynamic_s"] > 0 and row["hf_static_s"] > 0 and row["hf_best"] in ("dynamic", "static")
    assert row["hf_s"] == min(row["hf_dynamic_s"], row["hf_static_s"]) == row[f"hf_{row['hf_best']}_s"]
    assert row["ratio_triton_vs_hf"] == pytest.approx(row["hf_s"] / row["native_triton_s"])
    assert row["native_triton_decode_ms_per_step"] > 0


def test_profile_decode_json(outputs):
    """The decode profile runs the shape it is given: `--vocab 512` (TRL's GRPO workload profiles at 8,192) reaches
    the model built, and the bound counts it. Mutation run: the `--vocab` override not applied to the shape (the
    tiny shape's 1,024 is built and reported)."""
    res = outputs["profile_decode"]
    assert res["vocab_size"] == 512
    assert res["decode_steps"] > 0 and res["decode_step_ms"] > 0 and res["bound_ms"] > 0
    assert res["samples"] == 2 and res["batch"] == 4 and res["shared_prompt_reads"] is True  # 2 prompts x 2 samples
    # `--cublas-gemms` is recorded, its model kept in `--model-dir`, and the module routing restored afterwards (the
    # driver asserts that). Mutation: the finally block of profile_decode.main dropped -> the driver fails.
    cub = outputs["profile_decode_cublas"]
    assert cub["cublas_gemms"] is True and res["cublas_gemms"] is False and cub["shape"] == "tiny"
    assert cub["decode_step_ms"] > 0 and cub["quantization"] is None


def test_gpu_idle_against_a_timeline_of_microseconds():
    """profile_decode's `gpu_idle` (how long the GPU ran no kernel in a profiled decode) against a 1-us timeline
    marked by hand: overlapping kernels (programmatic dependent launch) merged, gaps counted once, only the ones over
    10 us reported as long. Mutations (run): overlapping intervals summed instead of merged -> busy exceeds the
    timeline's; the gap measured from the previous kernel's end instead of the merged run's end -> idle too large."""
    sys.path.insert(0, str(ROOT / "launch" / "bench"))
    from profile_decode import gpu_idle

    ivs = [(0, 30), (20, 50), (45, 48), (52, 60), (100, 130), (131, 140), (200, 210)]  # PDL overlap at 20-50
    busy_us = [any(s <= t < e for s, e in ivs) for t in range(210)]
    want_idle = busy_us.count(False)
    got = gpu_idle(ivs)
    assert got["span_us"] == 210 and got["busy_us"] == busy_us.count(True) and got["idle_us"] == want_idle
    assert got["long_gaps"] == 2 and got["long_gap_us"] == 40 + 60  # 60-100 and 140-200; 50-52 and 130-131 are short
    assert got["longest"][:3] == [60, 40, 2]
    assert gpu_idle([])["idle_us"] == 0.0


@pytest.mark.skipif(
    torch.cuda.is_available(), reason=
    "on a GPU machine the tuner runs compiled (launch/bench/tune_decode_gemms.py without --tiny, BENCHMARKS.md); the "
    "interpreter of the triton that torch 2.11 ships cannot run the K-split GEMM a GPU's SM count selects")
def test_tune_decode_gemms_json(tmp_path):
    """The decode-GEMM tuner (CPU: Triton's interpreter, no timing; its own process, since the interpreter is chosen
    when the kernels are imported) checks every candidate against the fp32 product and runs the end-to-end generate
    with its choice patched in and with the engine's own."""
    out = tmp_path / "tune.json"
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "bench" / "tune_decode_gemms.py"), "--tiny", "--out",
                           str(out)], cwd=ROOT, env=child_env(**QUIET, TRITON_INTERPRET="1"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    res = json.loads(out.read_text())
    per = res["rows"]["4"]
    assert set(per) == {"o_proj", "down", "gate_up", "qkv", "attention"}
    for name, r in per.items():
        assert r["wrong"] == [], (name, r["wrong"])
        assert all(err is None or err < 1e-5 for _, err in r["all"].values()), (name, r["all"])  # fp32 on CPU
    # both program orders of the attention are candidates, each within fp32 rounding of the reference (the order's
    # own test against torch: tests/test_rollout_native.py). Mutation: the heads-fastest candidates dropped from
    # `attention_grid` -> fails.
    heads = [k for k, (_, err) in per["attention"]["all"].items() if k.endswith(",heads")]
    assert heads and all(per["attention"]["all"][k][1] < 1e-5 for k in heads), per["attention"]["all"]
    e2e = res["e2e"]
    assert e2e["batch"] == 4 and len(e2e["default"]["decode_step_ms"]) == len(e2e["tuned"]["decode_step_ms"]) == 2
    # FP8 weights (`--fp8-weights`, two GEMMs, one of two TP ranks' shares): weight-only Triton within fp32 rounding
    # of the dequantized product (whole products, no K splits, as the engine runs them under TP);
    # FP8 x FP8 ("a8") and cuBLAS w8a8 (the CPU reference here) quantize the activation too, so both sit at its
    # error, which is far above rounding. Mutations: `_a8_linear` passing the unquantized x -> every a8 candidate
    # raises linear's FP8 assertion, none is timed, and the error check fails; K splits allowed under --tp 2 -> the
    # tile check fails.
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "bench" / "tune_decode_gemms.py"), "--tiny",
                           "--fp8-weights", "--gemms", "down", "gate_up", "--skip-attention", "--e2e-batch", "0",
                           "--tp", "2",
                           "--out", str(out)], cwd=ROOT, env=child_env(**QUIET, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    res = json.loads(out.read_text())
    per = res["rows"]["4"]
    assert set(per) == {"down", "gate_up"} and res["tp"] == 2
    tiles = [k.split()[1].split(",") for k in per["down"]["all"] if k.startswith(("triton", "a8"))]
    assert tiles and all(t[3] == "1" for t in tiles), tiles  # (BM, BN, BK, SPLIT_K, warps, stages): no K split
    for name, r in per.items():
        errs = {k.split()[0]: err for k, (_, err) in r["all"].items() if err is not None}
        assert r["wrong"] == [] and errs["triton"] < 1e-5 and 1e-3 < errs["a8"] < 0.1, (name, errs)
        assert abs(errs["a8"] - errs["cublas"]) < 0.02, (name, errs)
    # the attention over an FP8 cache (`--kv-fp8`): every candidate within fp32 rounding of torch attention over the
    # dequantized cache. Mutation: the tuner passing the codes without their scales -> the error check fails.
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "bench" / "tune_decode_gemms.py"), "--tiny",
                           "--kv-fp8", "--gemms", "qkv", "--e2e-batch", "0", "--out", str(out)], cwd=ROOT,
                          env=child_env(**QUIET, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    res = json.loads(out.read_text())
    att = res["rows"]["4"]["attention"]
    assert res["kv_fp8"] and att["wrong"] == []
    errs = [err for _, err in att["all"].values() if err is not None]
    assert errs and max(errs) < 1e-5, att["all"]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason=
    "on a GPU machine the kernels are timed compiled (launch/bench/bench_layer_kernels.py, BENCHMARKS.md); the "
    "interpreter of the triton that torch 2.11 ships cannot run loops bounded by a program id")
def test_layer_kernels_json(tmp_path):
    """bench_layer_kernels (CPU: Triton's interpreter, its own process): each fused kernel's output and gradients
    agree with the eager op's (fp32) and both were timed."""
    out = tmp_path / "layer_kernels.json"
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "bench" / "bench_layer_kernels.py"), "--tiny",
                           "--out", str(out)], cwd=ROOT, env=child_env(**QUIET, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    res = json.loads(out.read_text())
    assert set(res["cases"]) == {"swiglu", "rope"}
    for name, c in res["cases"].items():
        assert c["max_rel_diff"] < 1e-5, (name, c)
        assert c["fused_ms"] > 0 and c["eager_ms"] > 0


def test_tuner_never_chooses_a_wrong_or_failed_candidate():
    """`best_of` takes the fastest candidate within the tolerance. Mutation run: the error filter dropped (the
    0.5 us candidate with a 10% error is chosen)."""
    import tune_decode_gemms as t

    cands = {"default": {"ms": 0.0001, "err": None, "cfg": None},
             "fast but wrong": {"ms": 0.0005, "err": 0.1, "cfg": {}},
             "failed": {"ms": float("inf"), "err": None, "cfg": None},
             "right": {"ms": 0.002, "err": 1e-3, "cfg": {"BLOCK_M": 64}},
             "slower": {"ms": 0.003, "err": 0.0, "cfg": {"BLOCK_M": 128}}}
    assert t.best_of(cands)[0] == "right"


def test_mfu_json(outputs):
    res = outputs["mfu"]
    assert res["shape"] == "tiny" and res["params"] > 0 and res["layout"] == "packed"
    assert res["cuda_graphs"] is (res["device"] != "cpu")  # the decoder as CUDA graphs where they run
    for seq in ("32", "64"):
        case = res["cases"][seq]
        assert "error" not in case, case
        assert case["tokens_per_step"] == case["seq"] * case["micro_batch_seqs"] * case["micro_batches"]
        assert case["step_s"] > 0 and case["tokens_per_s"] > 0 and case["tflops"] > 0
        if res["device"] == "cpu":
            assert case["mfu"] is None  # no peak FLOP/s for a CPU: MFU is not made up
        else:
            assert 0 < case["mfu"] < 1
        assert case["grad_norm"] > 0
        assert (case["graph_captures"] > 0) is res["cuda_graphs"]


def test_mfu_grad_accum_fusion_json(outputs):
    """`bench_mfu.py --grad-accum-fusion` runs the update with the weight gradients accumulated into main_grad
    (its equality with the unfused update: tests/test_grad_accum_fusion.py) and says so in its JSON. That run also
    passes `--layers 1`: the shape's width in one decoder layer (mutation: run_shape ignoring `layers` -> 2 layers and
    the full parameter count, fails)."""
    res = outputs["mfu_fusion"]
    assert res["grad_accum_fusion"] is True and res["cuda_graphs"] is False
    assert res["layers"] == 1 and outputs["mfu"]["layers"] == 2 and res["params"] < outputs["mfu"]["params"]
    case = res["cases"]["32"]
    assert "error" not in case, case
    assert case["tokens_per_s"] > 0 and math.isfinite(case["grad_norm"])


def test_mfu_peer_json(outputs):
    """The plain transformers peer ran the same micro-batches (not compiled on a CPU unless asked), and the ratio
    lines its tokens/s up with Megatron's per sequence length. `--peer-params bf16` steps bf16 weights (mutation:
    the peer's `model.to(torch.bfloat16)` skipped fails it)."""
    import bench_mfu

    peer, res = outputs["mfu_peer"], outputs["mfu"]
    assert peer["peer"] == "transformers Qwen2ForCausalLM" and peer["compiled"] is (res["device"] != "cpu")
    assert peer["params"] == res["params"]  # the same shape
    for seq in ("32", "64"):
        case, mine = peer["cases"][seq], res["cases"][seq]
        assert "error" not in case, case
        for key in ("tokens_per_step", "micro_batch_seqs", "micro_batches"):
            assert case[key] == mine[key], key
        assert case["step_s"] > 0 and case["grad_norm"] > 0
    assert peer["params_dtype"] == "float32"
    light = outputs["mfu_peer_bf16"]  # --peer-params bf16: weights and AdamW state in bf16 (the 7B peer that fits)
    assert light["params_dtype"] == "bfloat16" and light["cases"]["32"]["tokens_per_s"] > 0
    assert math.isfinite(light["cases"]["32"]["grad_norm"])
    ratios = bench_mfu.peer_ratios(res, peer)
    assert ratios["32"] == pytest.approx(res["cases"]["32"]["tokens_per_s"] / peer["cases"]["32"]["tokens_per_s"])
    assert bench_mfu.peer_ratios(res, {"cases": {"32": {"error": "out of memory"}}})["32"] is None


@pytest.mark.parametrize("name", ["ppo_step", "grpo_step"])
def test_rl_step_json(outputs, name):
    res = outputs[name]
    assert res["step_s"] > 0 and res["tokens_per_step"] > 0 and res["response_tokens_per_step"] > 0
    phases = res["phases_median_s"]
    want = {"rollout/generate", "actor_update", "step", "trainer/sync", "trainer/adv"}
    if name == "ppo_step":
        want |= {"ref", "values", "critic_update", "old_log_prob"}
    else:  # one optimizer step on the whole batch: the old log-probs come from the update's forward, no pass
        assert "old_log_prob" not in phases, sorted(phases)
    assert want <= set(phases), sorted(phases)
    assert all(v >= 0 for v in phases.values())
    assert phases["step"] >= phases["actor_update"] > 0
    steps = res["steps"]
    assert len(steps) == (3 if name == "ppo_step" else 2)  # warm-up + timed (+ profiled)
    assert all(s["response_length_max"] <= 16 for s in steps)
    assert "timing_s/step" in steps[-1]["metrics"]
    assert all(s["allocs"] == {} for s in steps) if res["device"] == "cpu" else steps[-1]["allocs"]["actor_update"]
    # the allocator's mode as run: the config's default turns expandable segments on where CUDA runs
    assert res["allocator"]["cuda_expandable_segments"] == "auto"
    assert res["allocator"]["expandable_segments"] is (None if res["device"] == "cpu" else True), res["allocator"]
    if name == "ppo_step":  # `--replay-passes 2`: the last timed step's batch through its three passes, twice
        replayed = res["replayed_passes_s"]
        assert set(replayed) == {"old_log_prob", "ref", "values"} and all(
            len(v) == 2 and min(v) > 0 for v in replayed.values()), replayed
    else:
        assert "replayed_passes_s" not in res
    # the rollout engine's counters of each step's generation
    assert all(s["rollout_stats"]["decode_steps"] > 0 for s in steps), [s["rollout_stats"] for s in steps]
    captures = [s["rollout_stats"]["graph_captures"] for s in steps]
    if res["device"] == "cpu":  # no CUDA graphs on a CPU
        assert captures == [0] * len(steps), captures
    else:  # decode graphs are on by default on CUDA: the first generation captures its buckets
        assert captures[0] > 0, captures


def test_rl_step_bare_wraps_nothing(outputs):
    """`--bare`: the trainer's step and its own phase timings, no per-call phase (nothing wrapped, so nothing
    synchronised that the trainer does not). Mutation: `observe` ignored (the wrappers installed) -> the engine
    phases appear."""
    res, observed = outputs["grpo_step_bare"], outputs["grpo_step"]
    assert res["bare"] is True and observed["bare"] is False
    assert res["step_s"] > 0 and res["tokens_per_step"] > 0
    phases = res["phases_median_s"]
    assert {"step", "trainer/sync", "trainer/update"} <= set(phases), sorted(phases)
    assert all(k == "step" or k.startswith("trainer/") for k in phases), sorted(phases)
    assert all(s["phases_s"] == {} for s in res["steps"]), [s["phases_s"] for s in res["steps"]]
    assert "actor_update" in observed["phases_median_s"]


def test_ppo_profile(outputs):
    prof = outputs["ppo_step"]["profile"]
    assert prof["wall_s"] > 0 and prof["top"] and prof["top"][0]["self_device_s"] > 0
    assert "by category" in outputs["profile"]


def test_memory_json(outputs):
    res = outputs["memory"]
    comp = res["computed"]
    assert comp["params"] > 0 and comp["components_gb"]["actor_adam_fp32"] == pytest.approx(
        4 * comp["components_gb"]["actor_params_bf16"])
    for plan in ("trainer_today", "fits_7b"):
        assert comp["plans"][plan]["peak_gb"] > 0
    measured = res["measured"]
    assert measured["error"] is None, measured
    names = [p["phase"] for p in measured["phases"]]
    assert names[0].startswith("build actor") and names[-1] == "update 2" and len(names) == 8


def test_trl_json(outputs):
    """TRL's GRPOTrainer really runs its tiny form (trl is in the dev extra: `pip install -e .[dev]`)."""
    for name, checkpointing in (("trl", True), ("trl_no_gc", False)):  # TRL's default and its faster setting
        res = outputs[name]
        assert "skipped" not in res, f"{res['skipped']}: install the dev extra (pip install -e '.[dev]')"
        assert res["step_s"] > 0 and len(res["step_times"]) == 2
        assert res["config"]["gradient_checkpointing"] is checkpointing


def test_lora_linear_json(outputs):
    """bench_lora_linear's cases (each linear of a layer full / frozen / LoRA / the pre-issue-35 LoRA, the LM head
    three ways), the layer totals and ratios that BENCHMARKS.md reads."""
    res = outputs["lora_linear"]
    cases = {f"{k}/{v}" for k in ("qkv", "proj", "fc1", "fc2") for v in ("full", "frozen", "lora", "lora_naive")}
    assert cases | {"head_megatron", "head_frozen", "head_full"} == set(res["ms"])
    assert all(t > 0 for t in res["ms"].values())
    assert res["layer_ms"]["lora"] == pytest.approx(sum(res["ms"][f"{k}/lora"] for k in ("qkv", "proj", "fc1", "fc2")))
    assert set(res["ratios"]) == {"lora_over_frozen", "lora_over_full", "lora_naive_over_lora",
                                  "head_megatron_over_frozen"}
    assert (res["shape"], res["tokens"], res["vocab"], res["rank"]) == ("tiny", 32, 1024, 16)


def test_shapes_live_in_one_place():
    import bench_shapes

    assert bench_shapes.num_params(bench_shapes.shape("0.5b")) == 494_032_768  # Qwen2.5-0.5B, tied
    assert bench_shapes.num_params(bench_shapes.shape("1.5b")) == 1_543_714_304
    assert bench_shapes.num_params(bench_shapes.shape("7b")) == 7_615_616_512
    for script in (ROOT / "launch" / "bench").glob("bench*.py"):
        if script.name != "bench_shapes.py":
            assert "hidden_size=896" not in script.read_text() and '"hidden_size": 896' not in script.read_text(), \
                f"{script.name} defines a model shape: take it from launch/bench/bench_shapes.py"


def test_driver_writes_report(tmp_path):
    """launch/benchmark.py on the cheapest benchmark: the report's keys, and a console of one line per benchmark
    with the targets' table (`make benchmark` printed 355 lines with the children's JSON). Mutation: the child's
    output not redirected to its log (`stdout=f` dropped) -> fails."""
    proc = run("launch/benchmark.py", "--only", "memory", "--no-measure", "--tiny", "--out-dir", str(tmp_path),
               timeout=300, env_extra=QUIET)
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert {"hardware", "commit", "config", "results", "targets"} <= set(report)
    assert report["hardware"]["torch"] and report["commit"]["head"]
    assert report["config"]["tiny"] is True and report["results"]["memory"]["ok"]
    assert report["results"]["memory"]["result"]["computed"]["plans"]["fits_7b"]["peak_gb"] > 0
    assert "target" in proc.stdout and "commit" in proc.stdout
    # the console: one line per benchmark and the targets' table; the child's raw JSON only in its files
    lines = proc.stdout.splitlines()
    assert [x.split()[:2] for x in lines if x.startswith("memory ")] == [["memory", "ok"]], proc.stdout
    assert "{" not in proc.stdout and len(lines) < 12, proc.stdout
    assert report["results"]["memory"]["log"] == str(tmp_path / "memory.log")
    assert '"plans"' in (tmp_path / "memory.log").read_text()  # what the script printed went to its log


def test_the_trl_peers_transformers_warnings_are_silenced_at_their_source():
    """TRL 1.16 calls transformers 5's deprecated gradient-checkpointing names (a FutureWarning each, every run:
    `make benchmark` printed them); bench_trl.silence_peer_warnings filters exactly those, by message and module:
    the same calls warn without it, and another of transformers' FutureWarnings still shows (the children run with
    warnings ignored, so the launched benchmarks cannot show this). Mutation: the filter's module `transformers\\.`
    -> `trl\\.` -> fails."""
    import warnings

    import bench_trl
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))

    def shown(silenced: bool) -> list[str]:
        with warnings.catch_warnings(record=True) as got:  # the process's filters come back at its end
            warnings.simplefilter("always")
            if silenced:
                bench_trl.silence_peer_warnings()
            model.gradient_checkpointing_enable()  # what TRL's trainer calls
            assert model.is_gradient_checkpointing
            warnings.warn_explicit("another FutureWarning", FutureWarning, "modeling_utils.py", 1,
                                   module="transformers.modeling_utils")  # transformers' others still show
        return [str(w.message).split(" is deprecated")[0] for w in got]

    import transformers

    unsilenced = shown(False)
    if unsilenced == ["another FutureWarning"]:  # the GPU machine's transformers 5.17 does not deprecate them yet
        pytest.skip(f"transformers {transformers.__version__} does not warn on the gradient-checkpointing names")
    assert unsilenced == ["`gradient_checkpointing_enable`", "`is_gradient_checkpointing`",
                          "another FutureWarning"], "transformers warns otherwise: update bench_trl's comment"
    assert shown(True) == ["another FutureWarning"]


def test_targets_table():
    """The raised targets (issue 23), each against the strongest peer configuration that ran."""
    sys.path.insert(0, str(ROOT / "launch"))
    import benchmark

    results = {
        "mfu": {"result": {"results": {"qwen2.5-0.5b": {"cases": {"4096": {"mfu": 0.20, "micro_batch_seqs": 2,
                                                                           "micro_batches": 8},
                                                                  "1024": {"mfu": 0.30, "micro_batch_seqs": 4}}},
                                       "qwen2.5-7b": {"cases": {"4096": {"mfu": 0.55}}}},
                           "peer": {"qwen2.5-0.5b": {"ratio_megatron_over_peer": {"4096": 1.3, "1024": 0.9}}}}},
        "ppo_step": {"result": {"step_s": 8.0}},
        "grpo_step": {"result": {"step_s": 2.0}},
        "trl": {"result": {"step_s": 22.0}},  # with gradient checkpointing
        "trl_no_gc": {"result": {"step_s": 18.0}},  # the strongest TRL configuration
        "rollout": {"result": {"rows": [{"batch": 64, "native_triton_decode_ms_per_step": 0.8},
                                        {"batch": 256, "native_triton_decode_ms_per_step": 1.9,
                                         "ratio_triton_vs_hf": 9.0, "hf_best": "static"}]}},
        "sync": {"result": {"best_seconds": 0.01}},
    }
    rows = {r["target"]: r for r in benchmark.targets(results)}
    assert rows["actor update vs compiled peer qwen2.5-0.5b seq 4096"]["met"] is True
    assert rows["actor update vs compiled peer qwen2.5-0.5b seq 1024"]["met"] is False
    assert rows["actor MFU qwen2.5-0.5b seq 4096"]["met"] is False
    assert "missed by 2.00x" in rows["actor MFU qwen2.5-0.5b seq 4096"]["note"]
    assert "8 micro-batches of 2 x 4096 tokens" in rows["actor MFU qwen2.5-0.5b seq 4096"]["note"]  # the plan beside it
    assert rows["actor MFU qwen2.5-7b seq 4096"]["met"] is True
    ppo = next(r for k, r in rows.items() if k.startswith("GSM8K PPO step"))
    assert ppo["goal"] == "<= 4 s" and ppo["met"] is False and "missed by 2.00x" in ppo["note"]
    grpo = next(r for k, r in rows.items() if k.startswith("GRPO step"))
    assert "18.00 s = 9.0x" in grpo["measured"] and grpo["met"] is False  # against the faster TRL: 9x < 10x
    assert "no gradient checkpointing" in grpo["note"]
    results.pop("trl"), results.pop("trl_no_gc")
    grpo = next(r for r in benchmark.targets(results) if r["target"].startswith("GRPO step"))
    assert "earlier run" in grpo["note"] and "17.62 s" in grpo["measured"]  # the recorded TRL stands in
    assert rows["rollout decode step (batch 256)"]["met"] is False  # 1.9 ms > 1.2 ms
    best = rows["rollout vs HF generate at its best (batch 256)"]
    assert best["met"] is True and "static" in best["note"]
    assert rows["weight sync 0.5B colocated"]["met"] is True


def test_phase_busy_takes_the_union_of_the_kernels_inside_each_phase():
    """bench_ppo_step.phase_busy (a profiled GPU step's per-phase device time) on a fake profile: two phases, kernels
    overlapping each other, one kernel outside both, a GPU annotation; the phases annotated on the host, then given as
    spans. Mutations: summing the kernels' durations without the union (overlap counted twice: 0.7 for "a"),
    keeping a kernel that starts before its phase, or counting GPU annotations as kernels, each fail it."""
    from types import SimpleNamespace

    import bench_ppo_step
    from torch.autograd import DeviceType

    def ev(name, start, end, device, annotation=False):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start * 1e6, end=end * 1e6),
                               device_type=device, is_user_annotation=annotation)

    cpu, cuda, tag = DeviceType.CPU, DeviceType.CUDA, bench_ppo_step.PHASE_PREFIX
    events = [ev(tag + "a", 1.0, 2.0, cpu), ev(tag + "b", 3.0, 5.0, cpu), ev("aten::mm", 1.0, 1.1, cpu),
              ev("k", 0.9, 1.05, cuda),  # starts before "a": no phase's
              ev("k", 1.1, 1.5, cuda), ev("k", 1.2, 1.5, cuda),  # overlapping: 0.4 s of busy device
              ev("k", 3.5, 3.6, cuda), ev("k", 4.9, 5.3, cuda),  # "b": 0.1 + 0.4 (its last kernel runs past the end)
              ev("other span", 3.0, 5.0, cuda, annotation=True)]  # a GPU user annotation is no kernel
    got = bench_ppo_step.phase_busy(SimpleNamespace(events=lambda: events))
    assert got.keys() == {"a", "b"}
    assert abs(got["a"]["span_s"] - 1.0) < 1e-9 and abs(got["a"]["busy_s"] - 0.4) < 1e-9, got
    assert abs(got["b"]["span_s"] - 2.0) < 1e-9 and abs(got["b"]["busy_s"] - 0.5) < 1e-9, got
    # CUDA-only profiling records no host annotation: the phases come from the wrapper's spans (profile clock, us)
    gpu_only = [e for e in events if not e.name.startswith(tag)]
    got = bench_ppo_step.phase_busy(SimpleNamespace(events=lambda: gpu_only), [("a", 1e6, 2e6), ("b", 3e6, 5e6)])
    assert abs(got["a"]["busy_s"] - 0.4) < 1e-9 and abs(got["b"]["busy_s"] - 0.5) < 1e-9, got


def test_the_benchmark_times_the_rule_scorer_without_draining_the_device(monkeypatch):
    """bench_ppo_step.BenchHooks wraps every timed call; the rule scorer, which the streaming rollout calls between
    decode steps while one is in flight, must not synchronise the device (that idled the GPU at every finished
    batch of a GRPO step), while the model phases keep their two synchronisations. Mutation: the scorer wrapped
    with the default `sync=True` fails it (2 synchronisations per call)."""
    from types import SimpleNamespace

    import bench_ppo_step

    syncs = []
    monkeypatch.setattr(bench_ppo_step, "_sync", lambda: syncs.append(1))
    calls = []

    def method(name):
        return lambda *a, **kw: calls.append(name) or name

    def part(*names):
        return SimpleNamespace(**{n: method(n) for n in names})

    parts = SimpleNamespace(rollout=part("generate", "wake", "sleep"), scorer=part("score"),
                            actor=part("compute_log_probs", "update_policy", "offload", "onload"),
                            ref=None, critic=None)
    from rlhf_mcore.trainer import colocated

    originals = colocated.compose, colocated.rows_to_batch, colocated.generate_and_score
    hooks = bench_ppo_step.BenchHooks(parts, profile_step=None)
    try:
        assert parts.scorer.score([]) == "score" and syncs == [], syncs
        assert "rollout/reward" in hooks.sub
        parts.actor.update_policy()
        assert len(syncs) == 2 and calls == ["score", "update_policy"], (syncs, calls)
        assert colocated.compose is not originals[0]  # the generation phase's host parts are timed too
    finally:
        hooks.close()
    assert (colocated.compose, colocated.rows_to_batch, colocated.generate_and_score) == originals


def test_replayed_passes_call_the_engines_past_the_timing_wrappers():
    """bench_ppo_step.replay_passes runs each forward pass of the step (old log-probs, reference, values) on the
    step's batch, rounds alternating, through the engines' own methods: the instance's timing wrapper (which would
    add the replays to the step's phases) is never called. Mutation: the pass taken with `getattr(engine, method)`
    (the wrapper) fails it."""
    from types import SimpleNamespace

    import bench_ppo_step

    calls = []

    class Engine:
        def __init__(self, name):
            self.name = name
            self.compute_log_probs = self.compute_values = lambda *a, **kw: pytest.fail("the timing wrapper ran")

        def compute_log_probs(self, batch):
            calls.append((self.name, batch))

        def compute_values(self, batch):
            calls.append((self.name, batch))

    parts = SimpleNamespace(actor=Engine("actor"), ref=Engine("ref"), critic=Engine("critic"))
    got = bench_ppo_step.replay_passes(parts, "the batch", 2)
    assert calls == [("actor", "the batch"), ("ref", "the batch"), ("critic", "the batch")] * 2, calls
    assert {k: len(v) for k, v in got.items()} == {"old_log_prob": 2, "ref": 2, "values": 2}
    calls.clear()
    got = bench_ppo_step.replay_passes(SimpleNamespace(actor=Engine("actor"), ref=None, critic=None), "b", 1)
    assert list(got) == ["old_log_prob"] and calls == [("actor", "b")]


def test_allocator_counters_grow_per_synchronised_phase(monkeypatch):
    """The timing wrapper records how much the caching allocator's counters grew inside each synchronised phase
    (`allocs` of a step's record); a host-only phase (the rule scorer: no synchronisation) records none. Mutation:
    the growth taken as before - after (negative counts) fails it."""
    from types import SimpleNamespace

    import bench_ppo_step

    ticks = iter(range(0, 100, 5))
    monkeypatch.setattr(bench_ppo_step, "_sync", lambda: None)
    monkeypatch.setattr(bench_ppo_step, "_alloc_counts", lambda: {"num_device_alloc": next(ticks),
                                                                  "num_alloc_retries": 0})
    obj = SimpleNamespace(update=lambda: None, score=lambda: None)
    sink = {}
    bench_ppo_step.ALLOCS.clear()
    bench_ppo_step.timed(obj, "update", "actor_update", sink)
    bench_ppo_step.timed(obj, "score", "rollout/reward", sink, sync=False)
    obj.update()
    obj.score()
    obj.update()
    assert bench_ppo_step.ALLOCS == {"actor_update": {"num_device_alloc": 10, "num_alloc_retries": 0}}, (
        bench_ppo_step.ALLOCS)
    bench_ppo_step.ALLOCS.clear()


def test_phase_busy_splits_the_waits_for_the_host_by_length():
    """phase_busy's idle time split into waits under 1 ms (launch-bound) and longer ones (syncs, host work), counting
    the phase's lead-in and tail. Mutations: the tail left out (long_idle_s 0.4 short), the threshold compared the
    wrong way round (the 0.2 ms waits counted as long) each fail it."""
    from types import SimpleNamespace

    import bench_ppo_step
    from torch.autograd import DeviceType

    def k(start, end):
        return SimpleNamespace(name="k", time_range=SimpleNamespace(start=start * 1e6, end=end * 1e6),
                               device_type=DeviceType.CUDA, is_user_annotation=False)

    # phase [1.0, 2.0]: lead-in 0.1 s, kernels back to back but for two 0.2 ms waits, a 0.3 s wait, a 0.4 s tail
    events = [k(1.1, 1.2), k(1.2002, 1.25), k(1.2502, 1.3), k(1.6, 1.6 + 1e-6), k(1.59, 1.6)]
    got = bench_ppo_step.phase_busy(SimpleNamespace(events=lambda: events), [("a", 1e6, 2e6)])["a"]
    assert abs(got["short_idle_s"] - 4e-4) < 1e-9, got
    assert abs(got["long_idle_s"] - (0.1 + 0.29 + 0.4 - 1e-6)) < 1e-9 and got["long_idles"] == 3, got
    assert abs(got["span_s"] - got["busy_s"] - got["short_idle_s"] - got["long_idle_s"]) < 1e-9, got


def test_profile_clock_spans_align_on_the_mark_kernel():
    """bench_ppo_step.profile_clock_spans: the timed phases' perf_counter intervals land on the profile's clock at
    the marker kernel (launched at perf_counter `mark`), or at the profiler's start without one; phase_busy then
    takes them when the profile has no host annotations. Mutation: the offset's sign flipped fails it."""
    from types import SimpleNamespace

    import bench_ppo_step
    from torch.autograd import DeviceType

    def ev(name, start, end, device):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start * 1e6, end=end * 1e6),
                               device_type=device, is_user_annotation=False)

    # the marker ran at profile time 0.5 s, launched at perf_counter 100.5: the profile's zero is perf_counter 100.0
    events = [ev("void spin_kernel(long)", 0.5, 0.51, DeviceType.CUDA), ev("k", 1.2, 1.4, DeviceType.CUDA)]
    spans = bench_ppo_step.profile_clock_spans(events, [("a", 101.0, 102.0)], mark=100.5, start=99.0)
    assert [(k, round(a), round(b)) for k, a, b in spans] == [("a", 1_000_000, 2_000_000)]
    assert bench_ppo_step.phase_busy(SimpleNamespace(events=lambda: events), spans)["a"]["busy_s"] == \
        pytest.approx(0.2)
    no_mark = bench_ppo_step.profile_clock_spans(events[1:], [("a", 101.0, 102.0)], mark=100.5, start=99.0)
    assert [(round(a), round(b)) for _, a, b in no_mark] == [(2_000_000, 3_000_000)]


def test_fp8_mismatch_records_a_failing_variant_and_runs_the_rest(monkeypatch):
    """bench_fp8's mismatch section: a variant whose engine raises becomes a row with its error, and every later
    variant still runs (session 35's call C lost the section to one variant's compile error). Mutation: the
    try/except around `_mismatch_row` removed -> the error propagates and the test fails."""
    import bench_fp8

    seen = []

    def row(model_dir, name, cfg, prompts, new_tokens, actor_logprobs, greedy):
        seen.append(name)
        if name == "fp8_channel_kv8":
            raise RuntimeError("a compile error")
        return {"variant": name, "k3_kl": 0.0}

    monkeypatch.setattr(bench_fp8, "_hf_scorer", lambda model_dir, prompts, prompt_len: None)
    monkeypatch.setattr(bench_fp8, "_mismatch_row", row)
    rows = bench_fp8.bench_mismatch(None, {"vocab_size": 100}, ["channel"], n=2, prompt_len=4, new_tokens=2)
    names = ["bf16", "fp32", *bench_fp8.fp8_variants(["channel"])]
    assert seen == names and [r["variant"] for r in rows] == names
    assert rows[names.index("fp8_channel_kv8")] == {"variant": "fp8_channel_kv8",
                                                    "error": "RuntimeError: a compile error"}
    assert rows[-1] == {"variant": names[-1], "k3_kl": 0.0}


def test_the_fp8_cublas_variant_switches_the_model_for_its_own_engine_only(monkeypatch):
    """bench_fp8's `fp8_channel_cublas` variant turns `model.FP8_TRITON_DECODE` off while its engine runs and puts it
    back afterwards, also when the run fails; the other variants see it as it was, and no engine gets the key.
    Mutation: the switch not restored in `engine_switches`' finally -> the last check fails."""
    import bench_fp8

    from rlhf_mcore.rollout.native import model as nm

    seen = []

    def engine(model_dir, s, batches, prompt_len, new_tokens, name, cfg):
        seen.append((name, nm.FP8_TRITON_DECODE, "fp8_triton_decode" in cfg))
        if name == "fp8_channel_cublas":
            raise RuntimeError("a failed run")
        return []

    monkeypatch.setattr(bench_fp8, "_bench_engine", engine)
    before = nm.FP8_TRITON_DECODE
    variants = {"bf16": {}, **bench_fp8.fp8_variants(["channel"])}
    rows = bench_fp8.bench_rollout(None, {}, [1], 4, 4, variants)
    assert before is True  # the engine's default
    assert rows == [{"variant": "fp8_channel_cublas", "error": "RuntimeError: a failed run"}]
    assert [(n, on) for n, on, _ in seen] == [("bf16", before), ("fp8_channel", before),
                                              ("fp8_channel_w8a16", before), ("fp8_channel_cublas", False),
                                              ("fp8_channel_kv8", before), ("bf16_kv8", before)]
    assert not any(key for _, _, key in seen)
    assert nm.FP8_TRITON_DECODE == before
