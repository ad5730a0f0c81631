"""The train engine's fused layer kernels against the eager ops they replace, forward + backward, one GPU.

    python launch/bench/bench_layer_kernels.py --tokens 16384 --hidden 896 --ffn 4864 --out layer_kernels.json
    python launch/bench/bench_layer_kernels.py --tokens 4096 --hidden 3584 --ffn 18944      # the 7B widths
    TRITON_INTERPRET=1 python launch/bench/bench_layer_kernels.py --tiny                    # CPU smoke (no timing)

Cases (bf16 on CUDA, fp32 on CPU), each one forward and one backward with a random output gradient:

- `swiglu`: `kernels.fused_layer.swiglu` against `swiglu_reference` (Megatron's eager chain), input (tokens, 2 x ffn);
- `rope`: `fused_layer.rope_rotate` against `rope_reference`, queries (tokens, hidden / 64 heads, 64) with per-token
  cos/sin tables (gradients to the queries).

Times are CUDA events around the Python call (median of `--reps` after `--warmup`), so launch overhead counts; each
case also reports the largest difference of its output and gradients from the eager op's, relative to the largest
magnitude of the eager values. (A fused RMSNorm measured here in session 31 ran at 0.34x torch's `rms_norm` at
16k x 896 and was not kept: BENCHMARKS.md.) Writes `--out`
(JSON): milliseconds per case and implementation, and the eager / fused ratio.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lora_linear import median_ms  # noqa: E402
from bench_shapes import git_commit, write_report  # noqa: E402


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def run_case(fused, eager, inputs: list, device, warmup: int, reps: int) -> dict:
    """Time fused and eager (forward + backward of `fn(*inputs)` with a fixed random output gradient, the gradient
    taken to the first input) and compare their outputs and those gradients."""
    import torch

    def step(fn):
        xs = [x.detach().requires_grad_(i == 0) for i, x in enumerate(inputs)]  # the gradient to the first input
        y = fn(*xs)
        return y, xs

    y, _ = step(eager)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device, y.dtype)
    results = {}
    for name, fn in (("fused", fused), ("eager", eager)):
        def once(fn=fn):
            out, xs = step(fn)
            out.backward(dy)
            return out, xs
        out, xs = once()
        results[name] = (out.detach(), [x.grad for x in xs if x.grad is not None],
                         median_ms(once, device, warmup, reps))
    (fo, fg, fms), (eo, eg, ems) = results["fused"], results["eager"]
    return {"fused_ms": fms, "eager_ms": ems, "speedup": ems / fms if fms else float("nan"),
            "max_rel_diff": max([_rel(fo, eo)] + [_rel(a, b) for a, b in zip(fg, eg)])}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--ffn", type=int, default=4864)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from rlhf_mcore.kernels import fused_layer as fl

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens, hidden, ffn = (24, 40, 24) if args.tiny else (args.tokens, args.hidden, args.ffn)
    warmup, reps = (0, 1) if args.tiny else (args.warmup, args.reps)
    g = torch.Generator().manual_seed(0)
    y = torch.randn(tokens, 2 * ffn, generator=g).to(device, dtype)
    hd = 16 if args.tiny else 64
    q = torch.randn(tokens, max(1, hidden // hd), hd, generator=g).to(device, dtype)
    angles = torch.rand(tokens, hd // 2, generator=g) * 50
    angles = torch.cat([angles, angles], -1)  # Megatron's table: the frequencies twice
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    cases = {
        "swiglu": run_case(fl.swiglu, fl.swiglu_reference, [y], device, warmup, reps),
        "rope": run_case(fl.rope_rotate, fl.rope_reference, [q, cos, sin], device, warmup, reps),
    }
    for name, c in cases.items():
        print(f"{name:9s} fused {c['fused_ms']:8.3f} ms  eager {c['eager_ms']:8.3f} ms  {c['speedup']:5.2f}x  "
              f"max rel diff {c['max_rel_diff']:.2e}", flush=True)
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "commit": git_commit(), "dtype": str(dtype), "tokens": tokens, "hidden": hidden, "ffn": ffn,
              "cases": cases}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
