"""One decoder layer's linears and the LM head, forward + backward: LoRA against the base alone (issue 35).

    python launch/bench/bench_lora_linear.py --shape 7b --tokens 4096 --out lora_linear_7b.json      # one H200, bf16
    python launch/bench/bench_lora_linear.py --shape 0.5b --tokens 4096 --vocab 151936 --out lora_linear_05b.json
    python launch/bench/bench_lora_linear.py --shape tiny --tokens 64 --reps 2                        # CPU smoke

For each linear of a Qwen2 layer (the fused QKV with its bias, the attention output, the fused gate/up fc1, fc2;
`--shape`: a bench_shapes.py shape) on `--tokens` tokens, one micro-batch's forward and backward (a random output
gradient) timed as:

- `full`: the weight trains (`x W^T`, gradients to x and W: the full fine-tuning linear);
- `frozen`: the frozen base (`lora_linear.frozen_linear`: the gradient to x only);
- `lora`: the frozen base with LoRA on every part (`lora_linear.lora_linear`, rank `--rank`: stacked A, one
  block-structured B with the scale folded in, added in place);
- `lora_naive`: the same by the formula before issue 35's fix (a forward hook's `out + (fused parts, zero blocks
  concatenated, times the scale).to(dtype)`: one `x A^T`, `u B^T` per part).

And the LM head (`--vocab` x hidden; default the shape's vocabulary), frozen as under LoRA, with the gradient laid out
as GPTModel's `logits.transpose(0, 1).contiguous()` returns it: `head_megatron` (Megatron's frozen linear:
`grad.matmul(W)`, which torch runs as one GEMM per token there), `head_frozen` (`frozen_linear`: one GEMM) and
`head_full` (the head trains). On CUDA, times are CUDA events (median of `--reps` after `--warmup`); on CPU, wall
clock. Random weights; no Megatron model is built. Writes `--out` (JSON): milliseconds per case, each layer total and
the ratios.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_shapes import git_commit, shape, write_report  # noqa: E402

LINEARS = ("qkv", "proj", "fc1", "fc2")


def model_shape(s: dict):
    from rlhf_mcore.models.hf_config import ModelShape

    return ModelShape(family="qwen2", num_layers=s["num_hidden_layers"], hidden_size=s["hidden_size"],
                      num_attention_heads=s["num_attention_heads"], num_kv_heads=s["num_key_value_heads"],
                      head_dim=s["hidden_size"] // s["num_attention_heads"], ffn_hidden_size=s["intermediate_size"],
                      vocab_size=s["vocab_size"], max_position_embeddings=s["max_position_embeddings"],
                      rms_norm_eps=s["rms_norm_eps"], tie_word_embeddings=s["tie_word_embeddings"], qkv_bias=True,
                      qk_norm=False, rope_theta=s["rope_theta"])


def adapters(kind: str, shape, rank: int, alpha: float, dtype, device):
    """LoraAdapters of one linear, every part adapted, random A and B (as a trained adapter: B non-zero)."""
    import torch

    from rlhf_mcore.models.lora import _LINEARS, TARGETS, LoraAdapters, _part_shapes

    path = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj", "fc1": "mlp.linear_fc1",
            "fc2": "mlp.linear_fc2"}[kind]
    lkind, parts = _LINEARS[path]
    lora = LoraAdapters(lkind, _part_shapes(lkind, parts, shape, 1, TARGETS), rank, alpha / rank, None, 1, shape,
                        dtype, device)
    with torch.no_grad():
        for t in lora.A:
            lora.A[t].normal_(std=lora.A[t].shape[1] ** -0.5)
            lora.B[t].normal_(std=0.02)
    return lora


def naive_lora(lora, x):
    """The low-rank term as the adapters computed it before issue 35: per part `u B^T`, absent parts zero blocks,
    the fused layout by concatenation, then the scale (every step a full-width pass over the tokens)."""
    import torch

    lead = x.shape[:-1]
    parts = {t: (x @ lora.A[t].t()) @ lora.B[t].t() for t in lora.A}

    def get(t):
        return parts[t] if t in parts else torch.zeros(*lead, lora.widths[t], dtype=x.dtype, device=x.device)

    if lora.kind == "row":
        fused = next(iter(parts.values()))
    elif lora.kind == "fc1":
        fused = torch.cat([get("gate_proj"), get("up_proj")], dim=-1)
    else:
        g, hd = lora.groups_local, lora.shape.head_dim
        q, k, v = (get(t).reshape(*lead, g, -1, hd) for t in ("q_proj", "k_proj", "v_proj"))
        fused = torch.cat([q, k, v], dim=-2).reshape(*lead, -1)
    return fused * lora.scale


def timer(device):
    """fn -> seconds of one call: CUDA events on CUDA, wall clock on CPU."""
    import torch

    if device.type == "cuda":
        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
    else:
        def run(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    return run


def median_ms(fn, device, warmup: int, reps: int) -> float:
    run = timer(device)
    for _ in range(warmup):
        run(fn)
    return statistics.median(run(fn) for _ in range(reps)) * 1e3


def cases(kind: str, shape, args, dtype, device) -> dict:
    """name -> a closure running one forward + backward of linear `kind`."""
    import torch

    from rlhf_mcore.models.lora_linear import frozen_linear, lora_linear

    lora = adapters(kind, shape, args.rank, args.alpha, dtype, device)
    a, bs = lora.stacked()
    out_w, in_w = bs.shape[0], a.shape[1]
    w = torch.randn(out_w, in_w, dtype=dtype, device=device) * in_w ** -0.5
    bias = torch.zeros(out_w, dtype=dtype, device=device) if kind == "qkv" else None
    w_full = w.clone().requires_grad_(True)
    x = torch.randn(args.tokens, 1, in_w, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(args.tokens, 1, out_w, dtype=dtype, device=device)

    def step(forward):
        def go():
            x.grad = None
            w_full.grad = None
            for p in lora.parameters():
                p.grad = None
            torch.autograd.backward(forward(), grad)
        return go

    def base(weight):
        y = torch.matmul(x, weight.t())
        return y + bias if bias is not None else y

    return {"full": step(lambda: base(w_full)),
            "frozen": step(lambda: frozen_linear(x, w, bias)),
            "lora": step(lambda: lora_linear(x, w, bias, *lora.stacked(), row_parallel=lora.row_parallel)),
            "lora_naive": step(lambda: base(w) + naive_lora(lora, x).to(dtype))}


def head_cases(vocab: int, hidden: int, args, dtype, device) -> dict:
    import torch

    from rlhf_mcore.models.lora_linear import frozen_linear

    w = torch.randn(vocab, hidden, dtype=dtype, device=device) * hidden ** -0.5
    w_full = w.clone().requires_grad_(True)
    x = torch.randn(args.tokens, 1, hidden, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(1, args.tokens, vocab, dtype=dtype, device=device)  # the gradient of [b, s, V] logits

    def step(forward):
        def go():
            x.grad = None
            w_full.grad = None
            logits = forward().transpose(0, 1).contiguous()  # GPTModel's postprocess
            torch.autograd.backward(logits, grad)
        return go

    return {"head_megatron": step(lambda: torch.matmul(x, w.t())),  # LinearWithFrozenWeight's ops
            "head_frozen": step(lambda: frozen_linear(x, w)),
            "head_full": step(lambda: torch.matmul(x, w_full.t()))}


def profile_lora(shape, args, dtype, device) -> None:
    """The kernel table (device time, top 15 rows) of each linear's `lora` case, 5 calls after the warm-up, to
    `args.profile`: where the low-rank term's time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    tables = []
    for kind in LINEARS:
        fn = cases(kind, shape, args, dtype, device)["lora"]
        for _ in range(args.warmup):
            fn()
        with profile(activities=activities) as prof:
            for _ in range(5):
                fn()
            if device.type == "cuda":
                import torch

                torch.cuda.synchronize()
        tables.append(f"== {kind}: lora case, 5 calls of forward + backward, {args.tokens} tokens ==\n"
                      + prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=90))
    Path(args.profile).write_text("\n\n".join(tables) + "\n")
    print(f"kernel tables: {args.profile}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.5b", help="a bench_shapes.py shape: 0.5b, 7b, tiny, ...")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens in the micro-batch (the 4k-token budget)")
    ap.add_argument("--vocab", type=int, default=None, help="the LM head's rows (default: the shape's vocabulary)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default=None, help="cuda when there is a GPU, else cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="also write the kernel table (torch.profiler) of each linear's LoRA case to FILE")
    args = ap.parse_args(argv)

    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    s = shape(args.shape)
    ms = model_shape(s)
    vocab = args.vocab or s["vocab_size"]
    torch.manual_seed(0)
    results = {}
    for kind in LINEARS:
        for name, fn in cases(kind, ms, args, dtype, device).items():
            results[f"{kind}/{name}"] = median_ms(fn, device, args.warmup, args.reps)
    if args.profile:
        profile_lora(ms, args, dtype, device)
    for name, fn in head_cases(vocab, s["hidden_size"], args, dtype, device).items():
        results[name] = median_ms(fn, device, args.warmup, args.reps)
    layer = {v: sum(results[f"{k}/{v}"] for k in LINEARS) for v in ("full", "frozen", "lora", "lora_naive")}
    report = {
        "benchmark": "lora_linear", "shape": args.shape, "tokens": args.tokens, "vocab": vocab, "rank": args.rank,
        "alpha": args.alpha, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__, "commit": git_commit(),
        "warmup": args.warmup, "reps": args.reps, "ms": results, "layer_ms": layer,
        "ratios": {"lora_over_frozen": layer["lora"] / layer["frozen"],
                   "lora_over_full": layer["lora"] / layer["full"],
                   "lora_naive_over_lora": layer["lora_naive"] / layer["lora"],
                   "head_megatron_over_frozen": results["head_megatron"] / results["head_frozen"]},
    }
    print(f"lora_linear {args.shape} ({report['device']}, {args.tokens} tokens, rank {args.rank}): ms per "
          "forward + backward")
    for kind in LINEARS:
        print(f"  {kind:<5}" + "".join(f"  {v} {results[f'{kind}/{v}']:8.3f}" for v in layer))
    print("  layer" + "".join(f"  {v} {t:8.3f}" for v, t in layer.items()))
    print(f"  head (V={vocab})" + "".join(f"  {n[5:]} {results[n]:8.3f}" for n in
                                         ("head_megatron", "head_frozen", "head_full")))
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
