"""`make benchmark`: the project's benchmarks in one run, a table on the console and JSON on disk.

Runs each benchmark script as its own process (they initialise process groups and CUDA state of their own) and
records hardware and commit next to the results:

- rollout throughput, native engine vs Hugging Face `generate` (launch/bench_rollout.py);
- weight-sync seconds, Megatron actor -> native rollout engine (launch/bench_sync.py);
- attention spec throughput/MFU, local spec vs the SDPA spec (launch/bench_attention.py, when present).

Without CUDA every script runs its tiny shape so CI exercises the code paths; those numbers mean nothing.
The performance targets live in DESIGN.md; figures go in BENCHMARKS.md. Nothing here asserts a time.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or
            platform.machine(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def run_bench(name: str, script: str, args: list[str], out_dir: Path, timeout: int) -> dict:
    out = out_dir / f"{name}.json"
    cmd = [sys.executable, str(ROOT / "launch" / script), *args, "--out", str(out)]
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout)
    result = {"ok": proc.returncode == 0, "seconds": time.time() - t0}
    if out.is_file():
        result["result"] = json.loads(out.read_text())
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="outputs/benchmark")
    ap.add_argument("--only", nargs="+", choices=("rollout", "sync", "attention"), default=None)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per benchmark")
    args = ap.parse_args()
    out_dir = ROOT / args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tiny = [] if torch.cuda.is_available() else ["--tiny"]
    plan = {
        "rollout": ("bench_rollout.py", tiny),
        "sync": ("bench_sync.py", tiny),
        "attention": ("bench_attention.py", tiny),
    }
    report = {"hardware": hardware(), "commit": _commit(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "results": {}}
    for name, (script, extra) in plan.items():
        if args.only and name not in args.only:
            continue
        if not (ROOT / "launch" / script).is_file():
            report["results"][name] = {"ok": False, "skipped": f"launch/{script} not present"}
            continue
        report["results"][name] = run_bench(name, script, extra, out_dir, args.timeout)
    path = out_dir / "benchmark.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"\n{'benchmark':<12} {'ok':<5} {'seconds':>8}")
    for name, r in report["results"].items():
        print(f"{name:<12} {str(r.get('ok')):<5} {r.get('seconds', 0):>8.1f}  {r.get('skipped', '')}")
    print(f"\nhardware: {report['hardware']}\ncommit: {report['commit']}\nJSON: {path}")
    return 0 if all(r.get("ok") or r.get("skipped") for r in report["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
