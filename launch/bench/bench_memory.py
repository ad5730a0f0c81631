"""GPU memory of a colocated GRPO step, 7B shape, one H200: the computed plan, and (`--measure`) a measured one.

    python launch/bench/bench_memory.py [--shape 7b] [--measure] [--out FILE.json]
    python launch/bench/bench_memory.py --tiny --measure           # CPU smoke run (no memory numbers on CPU)

Workload: TRL's GRPO workload at the 7B shape (64 prompts x 8 samples, prompts <= 512, responses <= 256 tokens:
rollout KV cache for 512 sequences x 769 positions), no reference model unless `--ref`. Actor: bf16 parameters,
fp32 gradient buffer, distributed optimizer (fp32 master weights + Adam; nothing is sharded at DP=1), full
activation recomputation, packed micro-batches of `--micro-tokens` tokens (token budget).

Computed (always): bytes per component and what is resident in each phase, for two plans:
- `trainer_today`: what `rlhf_mcore.trainer` does now (roles.colocated_rollout) with the actor's
  `megatron.grad_offload` + `optimizer_offload` set (offloading is opt-in): during generation the actor moves
  gradients + optimizer state to the host (parameters stay), the rollout engine sleeps at level 1 after
  generation (KV cache freed, weights kept), the reference stays resident, weights are synced right after the
  update;
- `fits_7b`: what a 7B step on one H200 needs: the rollout engine sleeps at level 2 (weights dropped: they are
  re-sent anyway), the reference (if any) parks its parameters on the host while the actor trains, and the
  weight sync runs after the actor's optimizer state has left the GPU (at the next rollout's wake).

Measured (`--measure`, on the GPU): the `fits_7b` order executed with the real components — a TrainEngine actor
(random weights), `offload`/`onload`, the native rollout engine (`weight_offload="drop"`, CUDA graphs off) filled
by `sync_actor_to_rollout` and generating for all 512 sequences (32 new tokens each: the KV cache is allocated
for the full workload either way), `compute_log_probs` and `update_policy` on 8 sequences of 768 tokens. Peak
memory per phase is `torch.cuda.max_memory_allocated` since the phase began; it is set by the micro-batch
(tokens) and the resident state, not by the number of micro-batches, so 8 sequences stand for 512.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_shapes import (  # noqa: E402
    git_commit,  # noqa: E402
    num_params,
    write_config,
    write_report,  # noqa: E402
)
from bench_shapes import shape as get_shape  # noqa: E402

GB = 1e9
GIB = 2**30


def kv_cache_bytes(s: dict, seqs: int, max_len: int, dtype_bytes: int = 2) -> int:
    """The native engine's static KV cache: layers x (seqs + 1 scratch) x (max_len + 1) x kv heads x head_dim x
    (K, V)."""
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    return 2 * s["num_hidden_layers"] * (seqs + 1) * (max_len + 1) * s["num_key_value_heads"] * head_dim * dtype_bytes


def activation_bytes(s: dict, tokens: int, chunk_rows: int = 2048) -> int:
    """Rough update-time activations with full recomputation, one micro-batch of `tokens` tokens: the layer inputs
    kept for recomputation, one layer's recomputed activations, the bf16 logits and their gradient, and one fp32
    log-softmax chunk (with its gradient)."""
    h, f, V, L = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["num_hidden_layers"]
    checkpoints = L * tokens * h * 2
    one_layer = tokens * (10 * h + 4 * f) * 2
    logits = tokens * V * 2 * 2
    chunk = min(tokens, chunk_rows) * V * 4 * 3
    return checkpoints + one_layer + logits + chunk


def computed_plan(s: dict, *, seqs: int, max_len: int, micro_tokens: int, ref: bool, capacity: float) -> dict:
    P = num_params(s)
    comp = {"actor_params_bf16": 2 * P, "actor_grads_fp32": 4 * P, "actor_master_fp32": 4 * P,
            "actor_adam_fp32": 8 * P, "ref_params_bf16": 2 * P if ref else 0, "rollout_weights_bf16": 2 * P,
            "rollout_kv_cache": kv_cache_bytes(s, seqs, max_len),
            "update_activations_est": activation_bytes(s, micro_tokens)}
    actor_all = sum(comp[k] for k in ("actor_params_bf16", "actor_grads_fp32", "actor_master_fp32", "actor_adam_fp32"))
    act = comp["update_activations_est"]
    fwd_act = act // 3  # forward-only: no kept checkpoints for backward, logits without gradient (rough)
    refp, roll, kv = comp["ref_params_bf16"], comp["rollout_weights_bf16"], comp["rollout_kv_cache"]
    ap = comp["actor_params_bf16"]
    plans = {
        "trainer_today": {
            "rollout": ap + refp + roll + kv,
            "onload_after_rollout": actor_all + refp + roll,
            "old_log_prob_and_ref": actor_all + refp + roll + fwd_act,
            "update": actor_all + refp + roll + act,
            "sync": actor_all + refp + roll,
        },
        "fits_7b": {
            "sync_at_wake (actor offloaded)": ap + refp + roll,
            "rollout": ap + refp + roll + kv,
            "onload_after_rollout": actor_all + refp,
            "old_log_prob_and_ref": actor_all + refp + fwd_act,
            "update (ref parked on host)": actor_all + act,
        },
    }
    out = {"params": P, "components_gb": {k: v / GB for k, v in comp.items()}, "capacity_gb": capacity / GB,
           "plans": {}}
    for name, phases in plans.items():
        out["plans"][name] = {ph: {"gb": b / GB, "gib": b / GIB, "fits": b <= capacity} for ph, b in phases.items()}
        out["plans"][name]["peak_gb"] = max(phases.values()) / GB
        out["plans"][name]["fits"] = max(phases.values()) <= capacity
    return out


def measure(shape_name: str, s: dict, *, seqs: int, prompt_len: int, new_tokens: int, micro_tokens: int,
            update_seqs: int, update_len: int) -> dict:
    """Execute the fits_7b order with the real components and record memory per phase."""
    import torch

    from rlhf_mcore.config import OptimConfig
    from rlhf_mcore.engine import EngineConfig, TrainEngine
    from rlhf_mcore.engine.builder import recompute_overrides
    from rlhf_mcore.models import build_model, export_hf_weights
    from rlhf_mcore.parallel import destroy_distributed, init_distributed
    from rlhf_mcore.rollout import SamplingParams, build_rollout_engine
    from rlhf_mcore.sync import sync_actor_to_rollout

    state = init_distributed(tp=1, pp=1, seed=1)
    on_gpu = state.device.type == "cuda"
    phases: list[dict] = []
    result = {"phases": phases, "error": None}

    def gib(x):
        return x / GIB if on_gpu else None

    class Phase:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()
            return self

        def __exit__(self, et, ev, tb):
            if on_gpu:
                torch.cuda.synchronize()
            rec = {"phase": self.name, "seconds": time.perf_counter() - self.t0,
                   "peak_gib": gib(torch.cuda.max_memory_allocated()) if on_gpu else None,
                   "after_gib": gib(torch.cuda.memory_allocated()) if on_gpu else None,
                   "reserved_gib": gib(torch.cuda.memory_reserved()) if on_gpu else None}
            if et is not None:
                rec["error"] = f"{et.__name__}: {str(ev).splitlines()[0] if str(ev) else ''}"
                result["error"] = f"{self.name}: {rec['error']}"
            phases.append(rec)
            print(f"[memory] {json.dumps(rec)}", flush=True)
            return et is torch.cuda.OutOfMemoryError  # record an OOM and stop the sequence below

    def batch_of(n, length, vocab):
        g = torch.Generator().manual_seed(0)
        P = length // 4
        ids = torch.randint(0, vocab, (n, length), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones(n, length, dtype=torch.long),
                "responses": ids[:, P:], "response_mask": torch.ones(n, length - P, dtype=torch.long),
                "old_log_probs": torch.full((n, length - P), -math.log(vocab)),
                "advantages": torch.randn(n, length - P, generator=g)}

    with tempfile.TemporaryDirectory() as tmp:
        write_config(s, Path(tmp), dtype="bfloat16" if on_gpu else "float32")
        batch = batch_of(update_seqs, update_len, s["vocab_size"])
        with Phase("build actor (params + fp32 grad buffer + fp32 master)"):
            chunks = build_model(tmp, state, role="actor", load_weights=False,
                                 config_overrides=recompute_overrides(True))
            ecfg = EngineConfig(role="actor", use_dynamic_bsz=True, max_token_len=micro_tokens,
                                forward_max_token_len=micro_tokens)
            actor = TrainEngine(chunks, state, ecfg, OptimConfig(lr=1e-6))
        if result["error"] is None:
            with Phase("update 1 (creates Adam state)"):
                actor.update_policy(batch)
        if result["error"] is None:
            with Phase("offload actor grads + optimizer (rollout begins)"):
                moved = actor.offload()
            phases[-1]["moved_gb"] = {k: v / GB for k, v in moved.items()}
        rollout = None
        if result["error"] is None:
            with Phase("rollout engine built + weights synced (at wake)"):
                rollout = build_rollout_engine("native", tmp, max_num_seqs=seqs, max_model_len=prompt_len + new_tokens,
                                               device=state.device, cuda_graphs=False, load_weights=False,
                                               weight_offload="drop")
                sync_actor_to_rollout(export_hf_weights(actor.chunks, state), rollout, state)
        if result["error"] is None:
            with Phase(f"rollout: generate {seqs} seqs"):
                g = torch.Generator().manual_seed(1)
                prompts = torch.randint(0, s["vocab_size"], (seqs, max(8, prompt_len // 4)), generator=g).tolist()
                rollout.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True,
                                                         seed=0))
        if result["error"] is None:
            with Phase("rollout sleep(2) + actor onload"):
                rollout.sleep(2)
                actor.onload()
        if result["error"] is None:
            with Phase("old log-probs (forward only)"):
                actor.compute_log_probs(batch)
        if result["error"] is None:
            with Phase("update 2"):
                m = actor.update_policy(batch)
            phases[-1]["tokens_per_s"] = m.get("perf/actor/tokens_per_s")
    if on_gpu:
        result["device_total_gib"] = torch.cuda.get_device_properties(0).total_memory / GIB
    destroy_distributed()
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="7b")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--measure", action="store_true", help="also run the phases on this machine")
    p.add_argument("--ref", action="store_true", help="count a reference model (KL loss) in the plan")
    p.add_argument("--seqs", type=int, default=512, help="rollout sequences (64 prompts x 8)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--micro-tokens", type=int, default=4096, help="token budget of one micro-batch")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    name = "tiny" if args.tiny else args.shape
    s = get_shape(name)
    capacity = (torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available()
                else 143771 * 2**20)  # an H200 as this workplace's machines report it
    seqs, plen, ntok, micro = ((8, 32, 8, 256) if args.tiny else
                               (args.seqs, args.prompt_len, args.new_tokens, args.micro_tokens))
    report = {"benchmark": "colocated_grpo_memory", "shape": name, "commit": git_commit(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "workload": {"rollout_seqs": seqs, "max_model_len": plen + ntok, "micro_tokens": micro, "ref": args.ref},
              "computed": computed_plan(s, seqs=seqs, max_len=plen + ntok, micro_tokens=micro, ref=args.ref,
                                        capacity=capacity)}
    print(json.dumps(report["computed"], indent=1), flush=True)
    if args.measure:
        report["measured"] = measure(name, s, seqs=seqs, prompt_len=plen, new_tokens=32 if not args.tiny else ntok,
                                     micro_tokens=micro, update_seqs=8 if not args.tiny else 2,
                                     update_len=768 if not args.tiny else 32)
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
