"""The GPU learning run: does the whole bf16 path learn, and do rollout and trainer agree while it does?

    python launch/learn_gpu.py [--out outputs/learn_gpu] [--sft-steps 400] [--rl-steps 40] [--quick]
    python launch/learn_gpu.py --algos grpo --variants bf16 fp8-rollout fp8-rollout-tis fp8-train --parallel
    make learn-gpu

1. a ~25M-parameter Qwen2-shaped model (8 layers, hidden 512, bf16; tokenizer trained locally) and the synthetic
   task at difficulty 2 (two additions/subtractions of numbers up to 20, GSM8K's worked-steps answer format);
2. a supervised warm start (launch/sft.py) on targets of which 70% end with a full stop ("#### 15."), which the
   strict GSM8K reward scores 0: the warm start half follows the format, and RL has that choice to sharpen (40
   RL steps do not teach a model of this size more arithmetic);
3. GRPO (configs/learn_gpu.yaml) and then PPO with a critic (the same config with algorithm.adv_estimator=gae),
   each from the warm start, validating greedily on held-out problems every few steps;
4. a summary: held-out accuracy before and after, the training-reward curve, step seconds, and the largest
   rollout/trainer log-prob gap (`rollout/k3_kl`) seen, in `<out>/summary.json` and on the console.
`--quick` is the GPU test's short version (tests/test_gpu_learning.py). Needs CUDA.

`--variants` runs each algorithm from the same warm start, data and seeds once per variant (VARIANTS: bf16, FP8
rollout without and with token-level TIS, FP8 rollout with the FP8 KV cache and TIS, FP8 training), so their
held-out accuracy compares like for like; `--algos grpo` leaves PPO out, `--rl-steps` shortens the runs, and
`--parallel` runs them all at once on the GPU (the tiny model leaves it mostly idle: their step seconds are then
not comparable, their learning is).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start(cmd: list[str], log: Path | None = None) -> subprocess.Popen:
    print("+ " + " ".join(cmd), flush=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    out = open(log, "w") if log is not None else None  # noqa: SIM115  (closed with the process)
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=path), stdout=out,
                            stderr=subprocess.STDOUT if out else None)


def wait(procs: dict[str, subprocess.Popen]) -> None:
    failed = [name for name, p in procs.items() if p.wait() != 0]
    if failed:
        raise SystemExit(f"learn_gpu: {', '.join(failed)} failed (see its log under the output directory)")


def run(cmd: list[str]) -> None:
    wait({cmd[1]: start(cmd)})


# name -> overrides. The FP8-rollout runs keep their mismatch logged (`rollout/k3_kl`) but only warn above
# trainer.max_rollout_logprob_gap, a limit set for a bf16 rollout (FP8 adds mismatch by design).
FP8_ROLLOUT = ["actor_rollout_ref.rollout.quantization=fp8", "trainer.rollout_logprob_gap_action=warn"]
VARIANTS = {
    "bf16": [],
    "fp8-rollout": FP8_ROLLOUT,
    "fp8-rollout-tis": [*FP8_ROLLOUT, "algorithm.rollout_correction.rollout_is=token",
                        "algorithm.rollout_correction.rollout_is_threshold=2.0"],
    "fp8-rollout-kv-tis": [*FP8_ROLLOUT, "actor_rollout_ref.rollout.kv_cache_dtype=fp8_e4m3",
                           "algorithm.rollout_correction.rollout_is=token",
                           "algorithm.rollout_correction.rollout_is_threshold=2.0"],
    "fp8-train": ["actor_rollout_ref.actor.megatron.fp8=e4m3"],
}
ALGOS = {"grpo": [], "ppo": ["algorithm.adv_estimator=gae"]}


def plan_runs(algos: list[str], variants: list[str]) -> dict[str, list[str]]:
    """Run name -> its overrides: `<algo>` for bf16 (the plain `make learn-gpu` names), `<algo>_<variant>` else.
    FP8 training of a PPO run switches the critic's linears too."""
    runs = {}
    for algo in algos:
        for v in variants:
            name = algo if v == "bf16" else f"{algo}_{v}"
            extra = [*ALGOS[algo], *VARIANTS[v]]
            if algo == "ppo" and v == "fp8-train":
                extra.append("critic.megatron.fp8=e4m3")
            runs[name] = [*extra, f"trainer.experiment_name={name}"]
    return runs


def summarize(run_dir: Path) -> dict:
    """Held-out accuracy per validation, the training reward and step seconds per step, the largest gap."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val/acc"]) for r in records if r["kind"] == "val"]
    train = [r for r in records if r["kind"] == "train"]
    return {"val_acc": val, "val_before": val[0][1], "val_after": val[-1][1],
            "reward": [(r["step"], r["critic/score/mean"]) for r in train],
            "step_s": [(r["step"], r["timing_s/step"]) for r in train],
            "k3_kl_max": max(r["rollout/k3_kl"] for r in train),
            "k3_kl_token_max": max(r["rollout/k3_kl/max"] for r in train),
            "logprob_diff_abs_max": max(r["rollout/logprob_diff_abs"] for r in train),
            "k3_kl_mean": sum(r["rollout/k3_kl"] for r in train) / len(train),
            **({"tis_clipped_frac_max": max(r["rollout_corr/rollout_is_ratio_fraction_high"] for r in train)}
               if "rollout_corr/rollout_is_ratio_fraction_high" in train[0] else {})}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="outputs/learn_gpu")
    ap.add_argument("--sft-steps", type=int, default=400)
    ap.add_argument("--rl-steps", type=int, default=40)
    ap.add_argument("--quick", action="store_true", help="short version for the GPU test (GRPO only)")
    ap.add_argument("--algos", nargs="+", choices=list(ALGOS), default=None, help="default: grpo ppo (--quick: grpo)")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["bf16"],
                    help="numerics to compare from the same warm start and seeds")
    ap.add_argument("--parallel", action="store_true", help="run the RL runs at once (step seconds then shared)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("input error: launch/learn_gpu.py needs a CUDA GPU (the CPU demo is `make demo`)", file=sys.stderr)
        sys.exit(2)
    from rlhf_mcore.data import write_synthetic_parquet
    from rlhf_mcore.models.tiny import make_tiny_model

    out = (ROOT / args.out).resolve()
    sft_steps, rl_steps = (300, 12) if args.quick else (args.sft_steps, args.rl_steps)
    shutil.rmtree(out, ignore_errors=True)
    make_tiny_model(out / "tiny", arch="qwen2", layers=8, hidden=512, heads=8, kv_heads=2, vocab=2048, seed=0,
                    init_std=0.02, dtype="bfloat16")
    # as in the CPU demo, 70% of the warm-start targets end "#### 15." (scored 0 by the strict GSM8K reward): the
    # warm start half follows the format, so RL has a choice to sharpen, not arithmetic to learn in 40 steps
    write_synthetic_parquet(out / "data", n=20_000, difficulty=2, seed=0, n_test=256, period_answers=0.7)
    run([sys.executable, "launch/sft.py", "--model", str(out / "tiny"), "--train-file", str(out / "data/train.parquet"),
         "--out", str(out / "sft_model"), "--steps", str(sft_steps), "--batch-size", "128", "--lr", "1e-3",
         "--warmup-steps", "20", "--max-length", "192", "trainer.device=cuda"])
    common = [f"actor_rollout_ref.model.path={out / 'sft_model'}", f"data.train_files=[{out / 'data/train.parquet'}]",
              f"data.val_files=[{out / 'data/test.parquet'}]", f"trainer.total_training_steps={rl_steps}"]
    if args.quick:
        common += ["trainer.test_freq=4"]
    summary = {"sft_steps": sft_steps, "rl_steps": rl_steps, "gpu": torch.cuda.get_device_name(0)}
    runs = plan_runs(args.algos or (["grpo"] if args.quick else list(ALGOS)), args.variants)
    procs = {}
    for name, extra in runs.items():
        cmd = [sys.executable, "launch/train.py", "--config", "configs/learn_gpu.yaml", *common,
               f"trainer.default_local_dir={out / name}", *extra]
        procs[name] = start(cmd, out / f"{name}.log" if args.parallel else None)
        if not args.parallel:
            wait({name: procs[name]})
    wait(procs)
    for name in runs:
        summary[name] = summarize(out / name)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for name in runs:
        s = summary[name]
        rewards = [r for _, r in s["reward"]]
        k = max(1, len(rewards) // 4)
        print(f"{name}: held-out accuracy {s['val_before']:.3f} -> {s['val_after']:.3f}; training reward "
              f"{sum(rewards[:k]) / k:.3f} (first {k} steps) -> {sum(rewards[-k:]) / k:.3f} (last {k}); "
              f"largest rollout k3 KL {s['k3_kl_max']:.2e} (worst token {s['k3_kl_token_max']:.2e}); "
              f"median step {sorted(t for _, t in s['step_s'])[len(s['step_s']) // 2]:.2f} s"
              + (f"; TIS-clipped tokens <= {s['tis_clipped_frac_max']:.2%}" if "tis_clipped_frac_max" in s else ""))
        print("  step  held-out acc: " + "  ".join(f"{st}:{a:.3f}" for st, a in s["val_acc"]))
    return summary


if __name__ == "__main__":
    main()
