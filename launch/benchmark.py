"""`make benchmark`: the project's benchmarks in one run: one line per benchmark and the targets' table on the console,
JSON and each benchmark's own output (`<name>.log`) on disk.

    python launch/benchmark.py [--only mfu ppo_step grpo_step trl trl_no_gc memory rollout sync attention
                                      packed_attention]
                               [--out-dir DIR]
    python launch/benchmark.py --tiny          # force the tiny CPU shapes (what CI runs; the default without CUDA)

Runs each benchmark script as its own process (they initialise process groups and CUDA state of their own) and
records hardware, commit and configuration next to the results:

- `mfu`: actor-update MFU, Qwen2.5 0.5B / 1.5B / 7B shapes, 1k and 4k tokens (launch/bench/bench_mfu.py);
- `ppo_step`: one PPO step of the GSM8K run with its per-phase breakdown, profiled (launch/bench/bench_ppo_step.py);
- `grpo_step`: one GRPO step of TRL's workload (launch/bench/bench_ppo_step.py --workload trl_grpo);
- `trl`, `trl_no_gc`: TRL's GRPOTrainer on the same workload and model directory, when trl is importable, with its
  default gradient checkpointing and without it (launch/bench/bench_trl.py); the target is against the faster;
- `memory`: colocated GRPO step memory at the 7B shape, computed plan + measured phases (launch/bench/bench_memory.py);
- `rollout`: native engine vs Hugging Face `generate` with its dynamic and static caches, warmed (bench_rollout.py);
- `sync`: weight-sync seconds, Megatron actor -> native rollout engine (launch/bench/bench_sync.py);
- `attention`: local spec vs SDPA spec training throughput (launch/bench/bench_attention.py);
- `packed_attention`: packed document-causal attention kernels (varlen Flash Attention, flex_attention, per-document
  SDPA) on RL-shaped micro-batches (launch/bench/bench_packed_attention.py).

Without CUDA every script runs its tiny shape so CI exercises the code paths; those numbers mean nothing. The
project's performance targets (BENCHMARKS.md, "Targets and reference figures") are checked in the table at the end
(`targets`), each against the strongest peer configuration that ran; figures go in BENCHMARKS.md. Nothing here
asserts a time.
"""
import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("mfu", "ppo_step", "grpo_step", "trl", "trl_no_gc", "memory", "rollout", "sync", "attention",
         "packed_attention")
# TRL 1.16 GRPOTrainer on this workload without gradient checkpointing (its fastest here), H200, median step, measured
# before issue 23; stands in when neither TRL configuration ran
TRL_REFERENCE_STEP_S = 17.62


def _commit() -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=normal")
        return {"head": git("rev-parse", "--short", "HEAD"), "working_tree_changed": bool(dirty),
                "describe": git("rev-parse", "--short", "HEAD") + (" + working tree" if dirty else "")}
    except (OSError, subprocess.CalledProcessError):
        return {"head": "unknown", "working_tree_changed": None, "describe": "unknown"}


def hardware() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or
            platform.machine(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                    gpu_memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
    for dist in ("megatron-core", "transformers", "triton", "trl", "accelerate"):  # versions without importing
        try:
            info[dist.replace("-", "_")] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return info


def plan(tiny: bool, args, model_dir: Path) -> dict:
    """name -> (script, extra args). `model_dir`: the 0.5B / vocab-8192 directory shared by grpo_step and trl."""
    t = ["--tiny"] if tiny else []
    steps = [] if args.steps is None else ["--steps", str(args.steps)]
    rl_steps = 2 if args.rl_steps is None else args.rl_steps  # timed RL steps after the warm-up step
    mfu_shapes = [] if tiny or not args.mfu_shapes else ["--shapes", *args.mfu_shapes]
    return {
        "mfu": ("bench_mfu.py", [*t, *mfu_shapes, *steps]),
        "ppo_step": ("bench_ppo_step.py", ["--workload", "gsm8k_ppo", *t, *([] if args.no_profile else ["--profile"]),
                                           "--steps", str(rl_steps)]),
        "grpo_step": ("bench_ppo_step.py", ["--workload", "trl_grpo", *t, "--model-dir", str(model_dir),
                                            "--steps", str(max(1, rl_steps))]),
        "trl": ("bench_trl.py", [*t, "--model-dir", str(model_dir), "--steps", str(max(1, rl_steps) + 1)]),
        "trl_no_gc": ("bench_trl.py", [*t, "--model-dir", str(model_dir), "--steps", str(max(1, rl_steps) + 1),
                                       "--gradient-checkpointing", "off"]),
        "memory": ("bench_memory.py", [*t, *([] if args.no_measure else ["--measure"])]),
        "rollout": ("bench_rollout.py", t),
        "sync": ("bench_sync.py", t),
        "attention": ("bench_attention.py", t),
        "packed_attention": ("bench_packed_attention.py", t),
    }


def run_bench(name: str, script: str, args: list[str], out_dir: Path, timeout: int) -> dict:
    """One benchmark script in its own process, its output (raw JSON dumps, the peers' logs) in `<name>.log`;
    the console gets one line: the name as it starts, its outcome, time and headline when it ends (a failure
    adds the log's last lines)."""
    out, log = out_dir / f"{name}.json", out_dir / f"{name}.log"
    cmd = [sys.executable, str(ROOT / "launch" / "bench" / script), *args, "--out", str(out)]
    print(f"{name:<17}", end=" ", flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, timeout=timeout, stdout=f, stderr=subprocess.STDOUT).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = {"ok": rc == 0, "returncode": rc, "seconds": time.time() - t0, "command": cmd[1:], "log": str(log)}
    if out.is_file():
        result["result"] = json.loads(out.read_text())
    print(f"{'ok' if rc == 0 else 'FAILED (' + str(rc) + ')':<11} {result['seconds']:>7.1f} s  {headline(result)}",
          flush=True)
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        print("\n".join(f"    | {x}" for x in tail) + f"\n    (the whole output: {log})", flush=True)
    return result


def headline(r: dict) -> str:
    """A benchmark's one figure for the console: a step time, a skip's reason, else nothing (the table has more)."""
    res = r.get("result") or {}
    if res.get("skipped"):
        return f"skipped: {res['skipped']}"
    return f"step {res['step_s']:.2f} s" if isinstance(res.get("step_s"), (int, float)) else ""


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def targets(results: dict) -> list[dict]:
    """The performance targets against what this run measured (None where not measured), each against the
    strongest peer configuration that ran."""
    rows = []

    def row(name, measured, target, met, note=""):
        rows.append({"target": name, "measured": measured, "goal": target, "met": met, "note": note})

    mfu = _get(results, "mfu", "result", "results") or {}
    peers = _get(results, "mfu", "result", "peer") or {}
    for shape, res in mfu.items():
        for seq, ratio in sorted((_get(peers, shape, "ratio_megatron_over_peer") or {}).items()):
            if ratio is not None:
                case = _get(res, "cases", seq) or {}
                row(f"actor update vs compiled peer {shape} seq {seq}", f"{ratio:.2f}x", ">= 1.0x", ratio >= 1.0,
                    f"{case.get('micro_batch_seqs')} x {seq} tokens a micro-batch; peer: transformers, torch.compile, "
                    "AMP bf16, fused AdamW")
    for shape, seq, goal in (("qwen2.5-0.5b", "4096", 0.40), ("qwen2.5-7b", "4096", 0.50),
                             ("qwen2.5-7b", "1024", 0.50)):
        case = _get(mfu, shape, "cases", seq) or {}
        m = case.get("mfu")
        if m is not None:
            plan = (f"{case.get('micro_batches')} micro-batches of {case.get('micro_batch_seqs')} x {seq} tokens"
                    if case.get("micro_batch_seqs") else "")
            missed = "" if m >= goal else f"missed by {goal / m:.2f}x ({(goal - m) * 100:.1f} points)"
            row(f"actor MFU {shape} seq {seq}", f"{m:.1%}", f">= {goal:.0%}", m >= goal,
                "; ".join(x for x in (plan, missed) if x))
    ppo = _get(results, "ppo_step", "result", "step_s")
    if ppo is not None:
        row("GSM8K PPO step (256 x 512+512, actor+critic+ref)", f"{ppo:.2f} s", "<= 4 s", ppo <= 4,
            "" if ppo <= 4 else f"missed by {ppo / 4:.2f}x")
    grpo = _get(results, "grpo_step", "result", "step_s")
    if grpo is not None:
        trl = {name: _get(results, key, "result", "step_s") for name, key in
               (("gradient checkpointing", "trl"), ("no gradient checkpointing", "trl_no_gc"))}
        trl = {k: v for k, v in trl.items() if v}
        if trl:
            best = min(trl, key=trl.get)
            ref, src = trl[best], f"TRL measured in this run, its strongest configuration: {best}"
        else:
            ref, src = TRL_REFERENCE_STEP_S, f"TRL {TRL_REFERENCE_STEP_S} s (no checkpointing) from an earlier run"
        speedup = ref / grpo
        row("GRPO step vs TRL (64 x 8 x 256)", f"{grpo:.2f} s vs {ref:.2f} s = {speedup:.1f}x", ">= 10x",
            speedup >= 10, src + ("" if speedup >= 10 else f"; missed by {10 / speedup:.2f}x"))
    roll = _get(results, "rollout", "result", "rows")
    if roll:
        r = next((x for x in roll if x.get("batch") == 256), roll[-1])
        step_ms = r.get("native_triton_decode_ms_per_step")
        if step_ms is not None:
            row(f"rollout decode step (batch {r['batch']})", f"{step_ms:.2f} ms", "<= 1.2 ms", step_ms <= 1.2)
        ratio = r.get("ratio_triton_vs_hf")
        if ratio:
            row(f"rollout vs HF generate at its best (batch {r['batch']})", f"{ratio:.1f}x", ">= 8x", ratio >= 8,
                f"against HF with the {r.get('hf_best', '?')} cache, warmed")
    sync = _get(results, "sync", "result", "best_seconds")
    if sync is not None:
        row("weight sync 0.5B colocated", f"{sync:.4f} s", "<= 0.2 s", sync <= 0.2)
    mem = _get(results, "memory", "result")
    if mem:
        plan_ok = _get(mem, "computed", "plans", "fits_7b", "fits")
        measured = _get(mem, "measured", "phases") or []
        peak = max((p.get("peak_gib") or 0 for p in measured), default=None)
        err = _get(mem, "measured", "error")
        computed = _get(mem, "computed", "plans", "fits_7b", "peak_gb")
        row(f"{mem.get('shape')} colocated GRPO step fits one GPU", f"computed peak {computed:.1f} GB"
            + (f"; measured peak {peak:.1f} GiB" if peak else ""), "fits", bool(plan_ok) and not err, err or "")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="outputs/benchmark")
    ap.add_argument("--only", nargs="+", choices=ORDER, default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes even on a GPU (the default without CUDA)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps of the MFU benchmark")
    ap.add_argument("--rl-steps", type=int, default=None,
                    help="timed PPO/GRPO/TRL steps after one warm-up (default 2; PPO 0 = time the profiled step)")
    ap.add_argument("--mfu-shapes", nargs="+", default=None, help="e.g. 0.5b 1.5b 7b (default all)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled PPO step")
    ap.add_argument("--no-measure", action="store_true", help="memory: the computed plan only")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per benchmark")
    args = ap.parse_args(argv)
    out_dir = (ROOT / args.out_dir) if not Path(args.out_dir).is_absolute() else Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tiny = args.tiny or not torch.cuda.is_available()
    selected = [n for n in ORDER if args.only is None or n in args.only]
    if args.only is None:  # the default run: the benchmarks; the older ones by --only
        selected = [n for n in selected if n not in ("attention",)]
    report = {"hardware": hardware(), "commit": _commit(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
              "config": {**vars(args), "tiny": tiny}, "results": {}}
    with tempfile.TemporaryDirectory(prefix="bench_models_") as models:
        todo = plan(tiny, args, Path(models) / "qwen2.5-0.5b-v8192")
        for name in selected:
            script, extra = todo[name]
            report["results"][name] = run_bench(name, script, extra, out_dir, args.timeout)
            (out_dir / "benchmark.json").write_text(json.dumps(report, indent=1, default=str))
    report["targets"] = targets(report["results"])
    if tiny:  # tiny shapes on a CPU measure nothing: keep the rows (they exercise the code), drop the verdicts
        for t in report["targets"]:
            t["met"], t["note"] = None, "tiny shapes: not a measurement"
    path = out_dir / "benchmark.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    if report["targets"]:
        print(f"\n{'target':<52} {'measured':<34} {'goal':<28} met")
        for t in report["targets"]:
            print(f"{t['target']:<52} {t['measured']:<34} {t['goal']:<28} {t['met']}  {t['note']}")
    hw = report["hardware"]
    print(f"\nhardware: {hw.get('gpu', hw['cpu'])}, torch {hw['torch']}; commit: {report['commit']['describe']}"
          f"{' (tiny CPU shapes: numbers mean nothing)' if tiny else ''}\nJSON: {path}; each benchmark's output: "
          f"{out_dir}/<name>.log")
    return 0 if all(r.get("ok") for r in report["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
