"""The asynchronous trainers against the synchronous one on a long-tailed response-length workload, same calls.

    python launch/bench/bench_async.py [--steps 6] [--out FILE.json]       # 2 GPUs
    python launch/bench/bench_async.py --tiny                              # CPU smoke run (2 processes)

Three runs of `launch/train.py` under torchrun, 2 processes each, same model, prompts, samples per step and
seeds: `sync` (the colocated trainer at DP=2: both devices generate, then both train), `one_step_off` and
`fully_async` (1 rollout + 1 training device). GRPO at the Qwen2.5-0.5B shape (random weights, vocabulary
8,192 as the TRL workload), 32 prompts x 8 samples a step.

Long tail: a random-weight model never stops on its own, so each prompt gets its own response budget
(`extra_info.max_response_length`): 85% uniform in [32, 256), 10% uniform in [256, 1024), 5% at 2,048 tokens
(`--tiny`: the same shape of tail, scaled to 64).

Reported per mode, over the steps after the first (warm-up): tokens trained per second (prompt + response tokens
of the trained samples / step seconds), the step seconds, `trainer/idle_ratio` (the training pool's share of a
step spent waiting for samples) and `rollouter/idle_ratio`, and the ratio of each mode's throughput to `sync`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_shapes import git_commit, tokenizer_model_dir, write_report  # noqa: E402
from bench_shapes import shape as get_shape  # noqa: E402

MODES = {
    "sync": ["trainer.n_gpus_per_node=2"],
    "one_step_off": ["async_training.mode=one_step_off", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1"],
    "fully_async": ["async_training.mode=fully_async", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1",
                    "async_training.require_batches=4", "async_training.partial_rollout=true"],
}


def long_tail_caps(n: int, top: int, seed: int = 0) -> list[int]:
    """85% uniform in [top/64, top/8), 10% in [top/8, top/2), 5% at `top` (2,048: 32..256, 256..1024, 2048)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    u = rng.random(n)
    short = rng.integers(top // 64, top // 8, n)
    mid = rng.integers(top // 8, top // 2, n)
    return np.where(u < 0.85, short, np.where(u < 0.95, mid, top)).astype(int).tolist()


def write_data(src: Path, dst: Path, top: int, rows: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(src).slice(0, rows)
    caps = long_tail_caps(table.num_rows, top)
    extra = [{**(e or {}), "max_response_length": c} for e, c in zip(table.column("extra_info").to_pylist(), caps)]
    table = table.set_column(table.schema.get_field_index("extra_info"), "extra_info", pa.array(extra))
    pq.write_table(table, dst)
    return dst


def run_mode(mode: str, common: list[str], out: Path, timeout: int, logs: Path | None = None) -> dict:
    run_dir = out / mode
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "launch" / "train.py"), *common, f"trainer.default_local_dir={run_dir}", *MODES[mode]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS="ignore"), capture_output=True,
                          text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{mode}.log").write_text(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0:
        lines = proc.stderr.splitlines()
        first = next((x for x in lines if "error" in x.lower() and "elastic" not in x), "")
        return {"mode": mode, "error": first + "\n" + "\n".join(lines[-30:]), "wall_s": wall}
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r.get("kind", "train") == "train"]
    timed = recs[1:] or recs
    tokens = [r["perf/throughput"] * r["timing_s/step"] for r in timed]
    secs = [r["timing_s/step"] for r in timed]
    row = {"mode": mode, "wall_s": wall, "steps_timed": len(timed), "tokens_per_s": sum(tokens) / sum(secs),
           "step_s_median": statistics.median(secs), "tokens_per_step": statistics.mean(tokens),
           "response_length_mean": statistics.mean(r["response_length/mean"] for r in timed)}
    for k in ("trainer/idle_ratio", "rollouter/idle_ratio", "fully_async/partial/partial_ratio",
              "fully_async/count/dropped_stale_samples"):
        vals = [r[k] for r in timed if k in r]
        if vals:
            row[k] = statistics.mean(vals)
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="steps per mode (the first is a warm-up)")
    p.add_argument("--tiny", action="store_true", help="tiny shape and lengths on CPU")
    p.add_argument("--modes", default="sync,one_step_off,fully_async")
    p.add_argument("--staleness", type=int, default=1, help="fully_async: async_training.staleness_threshold")
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per mode")
    p.add_argument("--logs", default=None, help="write each mode's output (stdout + stderr) to DIR/<mode>.log")
    args = p.parse_args(argv)

    import torch

    from rlhf_mcore.data import preprocess_gsm8k

    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    s = get_shape("tiny" if args.tiny else "qwen2.5-0.5b", **({} if args.tiny else {"vocab_size": 8192}))
    top = 64 if args.tiny else 2048
    prompts, n = (8, 4) if args.tiny else (32, 8)
    tmp = tempfile.TemporaryDirectory(prefix="bench_async_")
    work = Path(tmp.name)
    model = tokenizer_model_dir(s, work / "model", dtype="bfloat16" if on_gpu else "float32")
    gsm = preprocess_gsm8k(output_dir=work / "gsm8k")
    data = write_data(Path(gsm["train"]["path"]), work / "long_tail.parquet", top, rows=4096)
    config = ROOT / "configs" / "gsm8k_grpo_qwen2.5_0.5b.yaml"
    common = ["--config", str(config), f"actor_rollout_ref.model.path={model}",
              f"data.train_files=[{data}]", "data.val_files=[]", f"data.max_response_length={top}",
              f"data.train_batch_size={prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts // 4}",
              f"actor_rollout_ref.rollout.n={n}", "actor_rollout_ref.actor.use_kl_loss=false",
              f"trainer.total_training_steps={args.steps}", "trainer.save_freq=-1", "trainer.test_freq=-1",
              "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.export_hf_final=false",
              "trainer.max_rollout_logprob_gap=null", f"trainer.device={'cuda' if on_gpu else 'cpu'}",
              "actor_rollout_ref.rollout.max_num_seqs=256"]
    if args.tiny:
        common += ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                   "actor_rollout_ref.actor.use_dynamic_bsz=false", "data.max_prompt_length=256"]
    logs = Path(args.logs) if args.logs else None
    MODES["fully_async"] = MODES["fully_async"] + [f"async_training.staleness_threshold={args.staleness}"]
    rows = [run_mode(m, common, work / "runs", args.timeout, logs) for m in args.modes.split(",")]
    base = next((r for r in rows if r["mode"] == "sync" and "tokens_per_s" in r), None)
    for r in rows:
        if base and "tokens_per_s" in r:
            r["vs_sync"] = r["tokens_per_s"] / base["tokens_per_s"]
    report = {"benchmark": "async_trainers", "commit": git_commit(), "tiny": args.tiny, "shape": s,
              "device": f"2 x {torch.cuda.get_device_name(0)}" if on_gpu else "cpu (2 processes)",
              "staleness_threshold": args.staleness,
              "workload": {"prompts_per_step": prompts, "samples_per_prompt": n, "length_cap_max": top,
                           "length_tail": "85% U[top/64, top/8), 10% U[top/8, top/2), 5% top"},
              "rows": rows}
    print(f"async trainers ({report['device']}, {report['commit']}):")
    for r in rows:
        if "error" in r:
            print(f"  {r['mode']:<13} FAILED: {r['error'][-500:]}")
            continue
        print(f"  {r['mode']:<13} {r['tokens_per_s']:10.0f} tokens/s  step {r['step_s_median']:.2f} s  "
              f"x{r.get('vs_sync', float('nan')):.2f} vs sync  trainer idle {r.get('trainer/idle_ratio', 0):.2f}  "
              f"rollouter idle {r.get('rollouter/idle_ratio', 0):.2f}")
    write_report(report, args.out)
    tmp.cleanup()
    return report


if __name__ == "__main__":
    main()
