"""FP8 against bf16 on one GPU: the GEMMs, the native rollout engine and its mismatch (BENCHMARKS.md, "FP8").

    python launch/bench/bench_fp8.py --shapes 0.5b 1.5b --batches 64 256 --out $OUT/bench_fp8.json

- gemm: the decoder linears of the 1.5B shape at M = 64, 256, 4096 rows: bf16 F.linear against fp8_linear with
  per-channel and 128 x 128 block scales (activation quantization included), microseconds and relative error
  against the dequantized fp32 reference;
- train: the FP8 training linear's forward + backward at 4,096 tokens against bf16, and its parts (quantizations,
  transposes, GEMMs), per decoder linear of `--train-shape` (bench_train_linear);
- rollout: tokens/s of the native engine (CUDA graphs, sampling at T = 1, eos ignored) bf16 vs FP8 at each shape
  and batch, 256-token prompts + 256 new tokens, timed after a warm-up; the quantization seconds of one sync. The
  FP8 variants: each `--layouts` scale layout through cuBLAS's FP8 GEMM, and `fp8_channel_w8a16` (the decode
  GEMMs read the FP8 weights, activations unquantized: `fp8_decode="w8a16"`);
- mismatch: greedy first-token agreement and |log-prob| difference (same context) over 64 prompts, and the k3 KL
  of FP8-rollout log-probs against bf16 teacher-forced scoring (transformers, bf16: the actor's numerics) of the
  same sampled tokens, with the share of tokens a TIS cap of 2 clips, next to the same numbers for the bf16 engine.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shapes import git_commit, random_model_dir, shape  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rlhf_mcore.kernels import fp8  # noqa: E402


def bench_gemm(s: dict, rows=(64, 256, 4096)) -> list[dict]:
    from triton.testing import do_bench

    h, f = s["hidden_size"], s["intermediate_size"]
    d = h // s["num_attention_heads"]
    linears = {"qkv": ((s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * d, h), "o_proj": (h, h),
               "gate_up": (2 * f, h), "down": (h, f)}
    out = []
    for m in rows:
        for name, (n, k) in linears.items():
            x = torch.randn(m, k, device="cuda").bfloat16()
            w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
            row = {"m": m, "linear": name, "n": n, "k": k,
                   "bf16_us": do_bench(lambda x=x, w=w: torch.nn.functional.linear(x, w)) * 1e3}
            for layout in fp8.LAYOUTS:
                try:
                    fw = fp8.Fp8Weight.empty_like(w, layout)
                    fw.update_(w)
                    xq, xs = fp8.quantize_rows(x) if layout == "channel" else fp8.quantize_row_blocks(x)
                    ref = fp8.reference_mm(xq, xs, fw.q, fw.scale)
                    y = fp8.fp8_linear(x, fw).float()
                    row[f"{layout}_rel_err"] = ((y - ref).norm() / ref.norm()).item()
                    row[f"{layout}_us"] = do_bench(lambda x=x, fw=fw: fp8.fp8_linear(x, fw)) * 1e3
                except Exception as e:  # noqa: BLE001  (recorded: a layout cuBLAS refuses here)
                    row[f"{layout}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def bench_train_linear(s: dict, rows: int = 4096) -> dict:
    """Where an FP8 training linear's time goes (megatron.fp8, kernels/fp8_linear.py), per decoder linear of shape
    `s` at `rows` tokens: forward + backward of bf16 F.linear against fp8_linear_train, and each part of the FP8
    one alone -- the six quantizations, the three FP8 GEMMs -- against the three bf16 GEMMs, the column operands'
    earlier path (bf16 transpose copy + row quantization), and a bf16 copy of x and dy (the memory-bandwidth
    yardstick of a one-pass, delayed-scaling cast); and the same parts of the tensorwise recipe
    (`fp8_linear_train_tensorwise`: three per-tensor quantizations writing both layouts, tensor-wise GEMMs) and the
    delayed recipe's casts of x and dy (one read each).
    Microseconds (do_bench, eager: the small linears' forward + backward is launch-bound here, unlike under the
    engine's CUDA graphs); `per_micro_batch_ms` sums them over the decoder's layers."""
    h, f, d = s["hidden_size"], s["intermediate_size"], s["hidden_size"] // s["num_attention_heads"]
    linears = {"qkv": ((s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * d, h), "o_proj": (h, h),
               "gate_up": (2 * f, h), "down": (h, f)}
    out = {"rows": rows, "layers": s["num_hidden_layers"], "linears": []}
    for name, (n, k) in linears.items():
        out["linears"].append({"linear": name, "n": n, "k": k, **_train_linear_parts(n, k, rows)})
        print(json.dumps(out["linears"][-1]), flush=True)
    keys = [k for k in out["linears"][0] if k not in ("linear", "n", "k")]
    out["per_micro_batch_ms"] = {k: sum(r[k] for r in out["linears"]) * s["num_hidden_layers"] / 1e3 for k in keys}
    print(json.dumps(out["per_micro_batch_ms"]), flush=True)
    out["swiglu_casts"] = _swiglu_cast_parts(f, rows)
    print(json.dumps({"swiglu_casts": out["swiglu_casts"]}), flush=True)
    out["swiglu_cast_tiles"] = _swiglu_cast_tiles(f, rows)
    print(json.dumps({"swiglu_cast_tiles": out["swiglu_cast_tiles"]}), flush=True)
    return out


def _swiglu_cast_parts(f: int, rows: int) -> dict[str, float]:
    """The delayed recipe's MLP (kernels/fp8_mlp.py) at F = `f`, `rows` tokens, microseconds a layer: SwiGLU then
    the cast of fc2's input (codes and transpose, under a known amax, folding its amax), against the SwiGLU kernel
    writing the codes (`fp8_swiglu.swiglu_cast`); the same for the backward (fc1's output gradient, e5m2); the
    bf16 SwiGLU kernels alone as the yardstick."""
    from triton.testing import do_bench

    from rlhf_mcore.kernels.fp8_swiglu import swiglu_bwd_cast, swiglu_cast
    from rlhf_mcore.kernels.fused_layer import swiglu, swiglu_grad

    y = torch.randn(rows, 2 * f, device="cuda").bfloat16()
    g = torch.randn(rows, f, device="cuda").bfloat16()
    amax, seen = torch.tensor(4.0, device="cuda"), torch.zeros(1, device="cuda")
    e4m3, e5m2 = fp8.E4M3, fp8.E5M2
    parts = {
        "swiglu_bf16": lambda: swiglu(y),
        "swiglu_then_cast": lambda: fp8.quantize_tensor(swiglu(y), e4m3, amax=amax, transpose=True, seen=seen),
        "swiglu_cast": lambda: swiglu_cast(y, e4m3, amax, seen, True),
        "swiglu_grad_bf16": lambda: swiglu_grad(g, y),
        "swiglu_grad_then_cast": lambda: fp8.quantize_tensor(swiglu_grad(g, y), e5m2, amax=amax, transpose=True,
                                                             seen=seen),
        "swiglu_bwd_cast": lambda: swiglu_bwd_cast(g, y, e5m2, amax, seen, True),
    }
    with torch.no_grad():
        return {name: do_bench(fn) * 1e3 for name, fn in parts.items()}


def _swiglu_cast_tiles(f: int, rows: int) -> dict[str, list]:
    """The SwiGLU-cast kernels' tiles and warps at F = `f`, `rows` tokens: {"fwd|bwd_BMxBK_wW": [microseconds,
    codes bit for bit those of the shipped tiles]} (session 44: the backward at 616 us moved ~776 MB at the 7B width,
    ~1.3 TB/s, where the forward reaches ~2 TB/s)."""
    import itertools

    from triton.testing import do_bench

    from rlhf_mcore.kernels.fp8_swiglu import swiglu_bwd_cast, swiglu_cast

    y = torch.randn(rows, 2 * f, device="cuda").bfloat16()
    g = torch.randn(rows, f, device="cuda").bfloat16()
    amax, seen = torch.tensor(4.0, device="cuda"), torch.zeros(1, device="cuda")
    kernels = {"fwd": lambda **kw: swiglu_cast(y, fp8.E4M3, amax, seen, True, **kw),
               "bwd": lambda **kw: swiglu_bwd_cast(g, y, fp8.E5M2, amax, seen, True, **kw)}
    out = {}
    with torch.no_grad():
        for name, fn in kernels.items():
            want = [t.view(torch.uint8) for t in fn()[::2]]  # codes and transposed codes of the shipped tiles
            for bm, bk, w in itertools.product((32, 64, 128), (32, 64, 128), (4, 8)):
                if bm * bk > 128 * 64:
                    continue
                cfg = dict(bm=bm, bk=bk, num_warps=w)
                same = all(torch.equal(a.view(torch.uint8), b) for a, b in zip(fn(**cfg)[::2], want))
                out[f"{name}_{bm}x{bk}_w{w}"] = [do_bench(lambda fn=fn, cfg=cfg: fn(**cfg)) * 1e3, same]
    return out


def _train_linear_parts(n: int, k: int, rows: int) -> dict[str, float]:
    from triton.testing import do_bench

    from rlhf_mcore.kernels.fp8_linear import WeightAmax, fp8_linear_train, fp8_linear_train_tensorwise, scaled_mm_rows

    e4m3, bf16, q = fp8.E4M3, torch.bfloat16, fp8.quantize_rows
    x = torch.randn(rows, k, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16().requires_grad_()
    dy = torch.randn(rows, n, device="cuda").bfloat16()
    xd, wd = x.detach(), w.detach()
    wt, dyt, xt = wd.t().contiguous(), dy.t().contiguous(), xd.t().contiguous()
    (xq, xs), (wq, ws), (dq, ds), (wtq, wts), (dtq, dts), (xtq, xts) = (q(a) for a in (xd, wd, dy, wt, dyt, xt))
    # the tensorwise recipe's codes: one scale each, both layouts from one read
    (tx, txs, txt), (tw, tws, twt), (td, tds, tdt) = (fp8.quantize_tensor(a, e4m3, transpose=True)
                                                      for a in (xd, wd, dy))
    w_amax = WeightAmax()
    x_amax, dy_amax, seen = fp8.tensor_amax(xd).float(), fp8.tensor_amax(dy).float(), torch.zeros(2, device="cuda")
    parts = {
        "bf16_fwd_bwd": lambda: torch.autograd.grad(torch.nn.functional.linear(x, w), (x, w), dy),
        "fp8_fwd_bwd": lambda: torch.autograd.grad(fp8_linear_train(x, w), (x, w), dy),
        "fp8_tensorwise_fwd_bwd": lambda: torch.autograd.grad(
            fp8_linear_train_tensorwise(x, w, None, e4m3, None, w_amax), (x, w), dy),
        "bf16_gemms": lambda: (xd @ wd.t(), dy @ wd, dyt @ xd),
        "fp8_gemms": lambda: (
            torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t().contiguous(), out_dtype=bf16),
            torch._scaled_mm(dq, wtq.t(), scale_a=ds, scale_b=wts.t().contiguous(), out_dtype=bf16),
            torch._scaled_mm(dtq, xtq.t(), scale_a=dts, scale_b=xts.t().contiguous(), out_dtype=bf16)),
        "fp8_tensorwise_gemms": lambda: (
            torch._scaled_mm(tx, tw.t(), scale_a=txs, scale_b=tws, out_dtype=bf16),
            torch._scaled_mm(td, twt.t(), scale_a=tds, scale_b=tws, out_dtype=bf16),
            torch._scaled_mm(tdt, txt.t(), scale_a=tds, scale_b=txs, out_dtype=bf16)),
        # the tensorwise quantizations of a training step: x and dy (amax + one cast writing both layouts), W's
        # cast with its amax kept (once per optimizer step: `tensor_amax_weight`)
        "tensorwise_quant_x_dy": lambda: (fp8.quantize_tensor(xd, e4m3, transpose=True),
                                          fp8.quantize_tensor(dy, e4m3, transpose=True)),
        # the delayed recipe's: the same casts under amaxes from earlier steps, each folding its tensor's amax into
        # the history from its own read (`fp8_linear.ActivationAmaxes`)
        "delayed_quant_x_dy": lambda: (fp8.quantize_tensor(xd, e4m3, amax=x_amax, transpose=True, seen=seen[0:1]),
                                       fp8.quantize_tensor(dy, e4m3, amax=dy_amax, transpose=True, seen=seen[1:2])),
        "tensorwise_quant_weight": lambda: fp8.quantize_tensor(wd, e4m3, amax=w_amax(wd), transpose=True),
        "tensor_amax_weight": lambda: fp8.tensor_amax(wd),
        "fp8_gemms_with_quant": lambda: (scaled_mm_rows(xd, wd, e4m3, e4m3, bf16),
                                         scaled_mm_rows(dy, wt, e4m3, e4m3, bf16),
                                         scaled_mm_rows(dyt, xt, e4m3, e4m3, bf16)),
        "quant_weight": lambda: (q(wd), fp8.quantize_cols_t(wd)),  # what caching W per optimizer step would save
        "quant_act_rows": lambda: (q(xd), q(dy)),
        "quant_act_cols": lambda: (fp8.quantize_cols_t(dy), fp8.quantize_cols_t(xd)),
        # the backward's column operands before quantize_cols_t: a bf16 transpose copy, then the row kernel
        "quant_cols_by_transpose": lambda: (q(wd.t().contiguous()), q(dy.t().contiguous()), q(xd.t().contiguous())),
        "transposes": lambda: (wd.t().contiguous(), dy.t().contiguous(), xd.t().contiguous()),
        "copy_x_dy": lambda: (xd.clone(), dy.clone()),
    }
    return {name: do_bench(fn) * 1e3 for name, fn in parts.items()}


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


def fp8_variants(layouts) -> dict[str, dict]:
    """The FP8 engine configurations compared with bf16: each scale layout as the engine ships it (per channel: the
    decode step's FP8 linears on Triton's FP8 x FP8 GEMMs, `model.FP8_TRITON_DECODE`; blockwise: cuBLAS), per-channel
    weights read by the Triton decode GEMMs with bf16 activations (`fp8_decode="w8a16"`), the per-channel w8a8
    decode step on cuBLAS's FP8 GEMM (the variant switches `FP8_TRITON_DECODE` off for its own engine), and the FP8
    KV cache (`kv_cache_dtype="fp8_e4m3"`) alone and with per-channel FP8 weights."""
    out = {f"fp8_{lay}": {"quantization": "fp8", "fp8_layout": lay} for lay in layouts}
    if "channel" in layouts:
        out["fp8_channel_w8a16"] = {"quantization": "fp8", "fp8_layout": "channel", "fp8_decode": "w8a16"}
        out["fp8_channel_cublas"] = {"quantization": "fp8", "fp8_layout": "channel", "fp8_triton_decode": False}
        out["fp8_channel_kv8"] = {"quantization": "fp8", "fp8_layout": "channel", "kv_cache_dtype": "fp8_e4m3"}
    out["bf16_kv8"] = {"kv_cache_dtype": "fp8_e4m3"}
    return out


@contextlib.contextmanager
def engine_switches(cfg: dict):
    """A variant's engine keyword arguments (yielded), with `fp8_triton_decode` taken out and applied to the model
    module while the block runs (restored after it, also on an error)."""
    from rlhf_mcore.rollout.native import model as nm

    cfg = dict(cfg)
    saved, nm.FP8_TRITON_DECODE = nm.FP8_TRITON_DECODE, cfg.pop("fp8_triton_decode", nm.FP8_TRITON_DECODE)
    try:
        yield cfg
    finally:
        nm.FP8_TRITON_DECODE = saved


def bench_rollout(model_dir: Path, s: dict, batches, prompt_len: int, new_tokens: int, variants) -> list[dict]:
    rows = []
    for name, cfg in variants.items():
        try:
            rows += _bench_variant(model_dir, s, batches, prompt_len, new_tokens, name, cfg)
        except Exception as e:  # noqa: BLE001  (recorded; the other variants still run)
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def _bench_variant(model_dir, s, batches, prompt_len, new_tokens, name, cfg) -> list[dict]:
    """One engine configuration `cfg` (NativeRolloutEngine's keyword arguments, plus `fp8_triton_decode`: the model
    switch, set for this engine only) timed at each batch size."""
    with engine_switches(cfg) as kwargs:
        return _bench_engine(model_dir, s, batches, prompt_len, new_tokens, name, kwargs)


def _bench_engine(model_dir, s, batches, prompt_len, new_tokens, name, cfg) -> list[dict]:
    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine
    from rlhf_mcore.rollout.native.weights import iter_safetensors

    rows = []
    eng = NativeRolloutEngine(model_dir, max_num_seqs=max(batches), max_model_len=prompt_len + new_tokens + 8,
                              **cfg)
    for b in batches:
        prompts = _prompts(b, prompt_len, s["vocab_size"])
        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
        eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=1))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.generate(prompts, params)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        row = {"variant": name, "batch": b, "seconds": dt, "tokens_per_s": b * new_tokens / dt,
               "decode_s": eng.last_stats["decode_s"], "prefill_s": eng.last_stats["prefill_s"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if cfg.get("quantization"):
        eng.update_weights(iter_safetensors(model_dir))  # a sync: new values, then quantized once
        eng.generate(_prompts(1, 8, s["vocab_size"]), SamplingParams(temperature=1.0, max_new_tokens=2))
        rows.append({"variant": name, "sync_quantize_s": eng.last_stats["fp8_quantize_s"],
                     "fp8_bytes": eng._fp8.nbytes()})
        print(json.dumps(rows[-1]), flush=True)
    eng.shutdown()
    return rows


def _k3(lp_rollout: torch.Tensor, lp_actor: torch.Tensor, cap: float = 2.0) -> dict:
    """k3 KL(rollout || actor) estimate on rollout-sampled tokens, and TIS: the share of IS weights
    pi_actor / pi_rollout above `cap` (clipped by token-level TIS) and the weights' mean before and after."""
    d = lp_actor - lp_rollout
    w = d.exp()
    return {"k3_kl": (w - d - 1).mean().item(), "is_weight_mean": w.mean().item(),
            "tis_clipped_frac": (w > cap).float().mean().item(), "tis_weight_mean": w.clamp(max=cap).mean().item()}


def bench_mismatch(model_dir: Path, s: dict, layouts, n: int = 64, prompt_len: int = 64, new_tokens: int = 64
                   ) -> list[dict]:
    """Per engine variant: the k3 KL of its sampled tokens against the HF bf16 model, and its greedy first tokens
    against the bf16 engine's. A variant that raises is recorded with its error and the others still run."""
    prompts = _prompts(n, prompt_len, s["vocab_size"], seed=3)
    actor_logprobs = _hf_scorer(model_dir, prompts, prompt_len)
    rows, greedy = [], {}
    # fp32: the noise floor of a random model's flat logits (bf16 against fp32 agree only so often)
    for name, cfg in {"bf16": {}, "fp32": {"dtype": torch.float32}, **fp8_variants(layouts)}.items():
        try:
            rows.append(_mismatch_row(model_dir, name, cfg, prompts, new_tokens, actor_logprobs, greedy))
        except Exception as e:  # noqa: BLE001  (recorded; the other variants still run)
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def _hf_scorer(model_dir: Path, prompts: list[list[int]], prompt_len: int):
    """outs -> (the HF bf16 model's log-probs of their sampled tokens, the engine's own), both (n, new_tokens)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()

    def actor_logprobs(outs) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([p + o.samples[0].token_ids for p, o in zip(prompts, outs)], device="cuda")
        with torch.inference_mode():
            logits = hf(input_ids=ids).logits[:, prompt_len - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, prompt_len:, None]).squeeze(-1)
        return lp, torch.tensor([o.samples[0].logprobs for o in outs], device="cuda")

    return actor_logprobs


def _mismatch_row(model_dir, name, cfg, prompts, new_tokens, actor_logprobs, greedy: dict) -> dict:
    """One variant's mismatch row; its greedy outputs go into `greedy` (the bf16 ones are the reference)."""
    from rlhf_mcore.rollout import SamplingParams
    from rlhf_mcore.rollout.native.engine import NativeRolloutEngine

    n, prompt_len = len(prompts), len(prompts[0])
    with engine_switches(cfg) as kwargs:
        eng = NativeRolloutEngine(model_dir, max_num_seqs=n, max_model_len=prompt_len + new_tokens + 8, **kwargs)
        try:
            greedy[name] = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens,
                                                                ignore_eos=True))
            sampled = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens,
                                                           ignore_eos=True, seed=5))
        finally:
            eng.shutdown()
    lp_actor, lp_rollout = actor_logprobs(sampled)
    row = {"variant": name, **_k3(lp_rollout, lp_actor)}
    if name != "bf16":
        pairs = [(a.samples[0], b.samples[0]) for a, b in zip(greedy["bf16"], greedy[name])]
        same = [a.token_ids[0] == b.token_ids[0] for a, b in pairs]
        dlp = torch.tensor([abs(a.logprobs[0] - b.logprobs[0]) for (a, b), ok in zip(pairs, same) if ok])
        prefix = [next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), new_tokens)
                  for a, b in pairs]
        row.update(first_token_agreement=sum(same) / n, first_token_dlogprob_mean=dlp.mean().item(),
                   first_token_dlogprob_max=dlp.max().item(), greedy_prefix_match=sum(prefix) / (n * new_tokens))
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--layouts", nargs="+", default=list(fp8.LAYOUTS), choices=fp8.LAYOUTS)
    p.add_argument("--skip", nargs="*", default=[], choices=["gemm", "train", "rollout", "mismatch"])
    p.add_argument("--train-shape", default="1.5b", help="the shape of the training-linear breakdown")
    p.add_argument("--mismatch-shapes", nargs="*", default=None, help="default: the first shape")
    p.add_argument("--variants", nargs="*", default=None, help="rollout variants to run (default: bf16 and every one "
                   "of `fp8_variants`)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    report = {"commit": git_commit(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "call": "python launch/bench/bench_fp8.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if "gemm" not in a.skip:
        report["gemm"] = bench_gemm(shape("1.5b"))
    if "train" not in a.skip:
        report["train_linear"] = bench_train_linear(shape(a.train_shape))
    tmp = Path(tempfile.mkdtemp(prefix="bench_fp8_"))
    variants = {"bf16": {}, **fp8_variants(a.layouts)}
    unknown = sorted(set(a.variants or ()) - set(variants))
    if unknown:
        p.error(f"--variants {' '.join(unknown)}: choose from {', '.join(variants)}")
    variants = {k: v for k, v in variants.items() if a.variants is None or k in a.variants}
    mismatch_shapes = a.shapes[:1] if a.mismatch_shapes is None else a.mismatch_shapes
    for name in a.shapes if {"rollout", "mismatch"} - set(a.skip) else ():  # the engine sections need a model
        s = shape(name)
        model_dir = random_model_dir(s, tmp / name, torch.device("cuda"), torch.bfloat16)
        if "rollout" not in a.skip:
            report.setdefault("rollout", {})[name] = bench_rollout(model_dir, s, a.batches, a.prompt_len,
                                                                   a.new_tokens, variants)
        if "mismatch" not in a.skip and name in mismatch_shapes:
            report.setdefault("mismatch", {})[name] = bench_mismatch(model_dir, s, a.layouts)
    out = Path(a.out or Path(os.environ.get("OUT", ".")) / "bench_fp8.json")
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
