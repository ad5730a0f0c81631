"""Log-prob + entropy scoring time and memory: the torch reference vs the fused Triton kernel, one GPU.

    python launch/bench/bench_logprob.py [--rows 4096 16384] [--vocab 151936] [--iters 10] [--out FILE.json]

For each row count, bf16 logits `[rows, vocab]` (Qwen2.5's vocabulary by default, TP=1) are scored at
temperature 0.7 by each backend of `rlhf_mcore.engine.logprobs` ("torch", "triton"): a forward pass alone
(under no_grad, as for old/ref log-probs) and a forward + backward pass (d(Σ w·logp + Σ w'·entropy)/d logits,
as in the actor update). Each time is the median of `--iters` runs timed with CUDA events after two warm-up
runs. `peak_extra_gib` is the peak memory of one forward + backward beyond the logits already allocated
(the gradient itself is `rows × vocab` bf16). `bandwidth_floor_ms` is the time to move the bytes that any
implementation must (forward: read the logits; backward: read them again and write the gradient) at the
device copy bandwidth measured here. Prints one JSON object; `--out` also writes it to a file.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from bench_shapes import git_commit  # noqa: E402  (launch/bench/ is on the path when run as a script)

TEMPERATURE = 0.7
GIB = 2**30


def cuda_time_ms(fn, iters: int, warmup: int = 2) -> float:
    """Median wall time of `fn()` on the current stream, in milliseconds, from CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_extra_bytes(fn) -> int:
    """Peak memory allocated while `fn()` runs, beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def copy_bandwidth(nbytes: int = 4 * GIB) -> float:
    """Bytes per second moved by a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), iters=5)
    return 2 * nbytes / (ms / 1e3)


def runners(fn, logits, labels, w_lp, w_ent):
    """(forward, forward + backward) of backend `fn` on these inputs, as closures to time."""
    def forward():
        with torch.no_grad():
            return fn(logits, labels, temperature=TEMPERATURE)

    def forward_backward():
        x = logits.detach().requires_grad_(True)
        lp, ent = fn(x, labels, temperature=TEMPERATURE)
        grad, = torch.autograd.grad((w_lp * lp).sum() + (w_ent * ent).sum(), x)
        return lp.detach(), ent.detach(), grad

    return forward, forward_backward


def bench_shape(rows: int, vocab: int, iters: int, backends: dict, bandwidth: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g, device="cuda") * 3).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), generator=g, device="cuda")
    w_lp, w_ent = torch.randn(2, rows, generator=g, device="cuda")
    outputs, result = {}, {"rows": rows, "vocab": vocab}

    for name, fn in backends.items():
        forward, forward_backward = runners(fn, logits, labels, w_lp, w_ent)
        result[name] = {"forward_ms": cuda_time_ms(forward, iters),
                        "forward_backward_ms": cuda_time_ms(forward_backward, iters),
                        "peak_extra_gib": peak_extra_bytes(forward_backward) / GIB}
        outputs[name] = forward_backward()  # kept for the comparison below

    (lp_r, ent_r, g_r), (lp_k, ent_k, g_k) = outputs["torch"], outputs["triton"]
    result["max_abs_diff"] = {"log_prob": (lp_k - lp_r).abs().max().item(),
                              "entropy": (ent_k - ent_r).abs().max().item(),
                              "grad": (g_k - g_r).abs().max().float().item()}
    nbytes = rows * vocab * logits.element_size()
    result["bandwidth_floor_ms"] = {"forward": nbytes / bandwidth * 1e3,
                                    "forward_backward": 3 * nbytes / bandwidth * 1e3}
    for key in ("forward_ms", "forward_backward_ms"):
        result[f"speedup_{key.removesuffix('_ms')}"] = result["torch"][key] / result["triton"][key]
    result["memory_ratio"] = result["triton"]["peak_extra_gib"] / result["torch"]["peak_extra_gib"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_logprob needs a CUDA GPU")
    import triton

    from rlhf_mcore.engine.logprobs import get_logprob_backend

    backends = {name: get_logprob_backend(name) for name in ("torch", "triton")}
    bandwidth = copy_bandwidth()
    report = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "commit": git_commit(), "dtype": "bfloat16", "temperature": TEMPERATURE, "iters": args.iters,
        "copy_bandwidth_gbps": bandwidth / 1e9,
        "shapes": [bench_shape(rows, args.vocab, args.iters, backends, bandwidth) for rows in args.rows],
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
