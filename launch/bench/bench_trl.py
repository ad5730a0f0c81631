"""The peer: TRL's `GRPOTrainer` on the GRPO workload of the performance targets, timed step by step.

    python launch/bench/bench_trl.py [--steps 3] [--model-dir DIR] [--out FILE.json]
    python launch/bench/bench_trl.py --gradient-checkpointing off   # TRL's faster configuration (more memory)
    python launch/bench/bench_trl.py --tiny            # CPU smoke run (skipped, with a reason, when trl is missing)

Workload ("TRL 1.16 GRPOTrainer ... 64 prompts x 8 samples x up to 256 new tokens a step"): the
Qwen2.5-0.5B shape with a vocabulary of 8,192 and random weights, the same HF directory and GSM8K prompts as
`bench_ppo_step.py --workload trl_grpo` (`bench_shapes.tokenizer_model_dir`), a tiny rule reward (digits in the
completion, so groups have non-zero advantages), Hugging Face `generate` (use_vllm=False), no reference model
(beta=0, TRL's default), one optimizer step a step: `per_device_train_batch_size=64` completions a micro-step
× `gradient_accumulation_steps=8` = 512 completions = 64 prompts × `num_generations=8`, all generated at once
(generation_batch_size 512). Everything else is TRL's default (fp32 parameters under bf16 autocast, gradient
checkpointing on unless `--gradient-checkpointing off`, loss_type "dapo", temperature 1). A random-weight model
practically never samples its eos token, so every completion has 256 tokens — the same for both trainers.

A step is one optimizer step (TRL's `on_step_begin` -> `on_step_end`, device-synchronised); the first is a
warm-up; the median of the rest is reported.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_shapes import shape as get_shape  # noqa: E402
from bench_shapes import tokenizer_model_dir, write_report  # noqa: E402

GSM8K_SUFFIX = ' Let\'s think step by step and output the final answer after "####".'
# TRL 1.16 calls transformers' older gradient-checkpointing names (renamed activation_checkpointing in transformers
# 5): the same switches, one FutureWarning each per run; silenced here, at the peer, by message and module
PEER_WARNINGS = (r"`(is_)?gradient_checkpointing\w*` is deprecated and will be removed in v6", r"transformers\.")


def silence_peer_warnings() -> None:
    import warnings

    warnings.filterwarnings("ignore", message=PEER_WARNINGS[0], category=FutureWarning, module=PEER_WARNINGS[1])


def gsm8k_prompts(n: int) -> list[list[dict]]:
    """The first `n` GSM8K training questions as chat prompts, veRL's instruction appended."""
    from rlhf_mcore.data.preprocess import VENDORED_GSM8K_DIR

    out = []
    with open(Path(VENDORED_GSM8K_DIR) / "train.jsonl") as f:
        for line in f:
            out.append([{"role": "user", "content": json.loads(line)["question"] + GSM8K_SUFFIX}])
            if len(out) == n:
                break
    return out


def digits_reward(completions, **kwargs) -> list[float]:
    """Fraction of digit characters in the completion: cheap, and not constant within a group."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (the first is a warm-up)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--micro", type=int, default=64, help="completions a micro-step (per_device_train_batch_size)")
    p.add_argument("--gradient-checkpointing", choices=("on", "off"), default="on",
                   help="TRL's default is on; off is its faster configuration where memory allows (the strongest peer)")
    p.add_argument("--tiny", action="store_true", help="tiny shape and batch (CPU smoke run)")
    p.add_argument("--model-dir", default=None, help="reuse/create the model directory here")
    p.add_argument("--out", default=None)
    silence_peer_warnings()
    args = p.parse_args(argv)

    import torch

    report = {"benchmark": "trl_grpo_step", "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
              else "cpu", "torch": torch.__version__}
    try:
        import transformers
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except Exception as e:  # noqa: BLE001 - a peer that cannot be imported is reported, not fatal
        report.update(skipped=f"trl not importable: {e!r}")
        print(json.dumps(report), flush=True)
        write_report(report, args.out)
        return report
    from datasets import Dataset
    from transformers import TrainerCallback

    if args.tiny:
        args.prompts, args.generations, args.new_tokens, args.micro = 2, 2, 8, 2
    on_gpu = torch.cuda.is_available()
    s = get_shape("tiny") if args.tiny else get_shape("qwen2.5-0.5b", vocab_size=8192)
    tmp = tempfile.TemporaryDirectory(prefix="bench_trl_")
    model_dir = Path(args.model_dir or Path(tmp.name) / "model")
    t0 = time.perf_counter()
    tokenizer_model_dir(s, model_dir, dtype="bfloat16" if on_gpu else "float32")
    model_s = time.perf_counter() - t0

    total = args.prompts * args.generations
    accum = max(1, total // args.micro)
    dataset = Dataset.from_list([{"prompt": m} for m in gsm8k_prompts(args.prompts * (args.steps + 1))])
    config = GRPOConfig(
        output_dir=str(Path(tmp.name) / "out"), per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=accum, num_generations=args.generations,
        max_completion_length=args.new_tokens, max_steps=args.steps, learning_rate=1e-6, use_vllm=False,
        beta=0.0, bf16=on_gpu, use_cpu=not on_gpu, logging_steps=1, report_to="none", save_strategy="no",
        seed=0, dataloader_num_workers=0, shuffle_dataset=False,
        gradient_checkpointing=args.gradient_checkpointing == "on")

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            if on_gpu:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            print(f"[trl] step {len(times)}: {times[-1]:.2f} s", flush=True)

    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=digits_reward, args=config, train_dataset=dataset,
                          callbacks=[StepTimer()])
    init_s = time.perf_counter() - t0
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    timed = times[1:] or times
    step_s = statistics.median(timed)
    lengths = [h.get("completions/mean_length") for h in trainer.state.log_history if "completions/mean_length" in h]
    report.update(
        trl=trl.__version__, transformers=transformers.__version__, model_build_s=model_s, trainer_init_s=init_s,
        prompts=args.prompts, generations=args.generations, new_tokens=args.new_tokens, micro=args.micro,
        gradient_accumulation_steps=accum, step_times=times, step_s=step_s,
        completion_tokens_per_s=total * (statistics.mean(lengths) if lengths else args.new_tokens) / step_s,
        completion_mean_length=lengths, peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        config={k: getattr(config, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                                "num_generations", "generation_batch_size", "steps_per_generation",
                                                "max_completion_length", "beta", "loss_type", "bf16",
                                                "gradient_checkpointing", "use_vllm", "temperature")})
    print(f"\nTRL {trl.__version__} GRPOTrainer: median step {step_s:.2f} s over {len(timed)} steps "
          f"({args.prompts} prompts x {args.generations} x <= {args.new_tokens} tokens); all: "
          f"{[round(t, 2) for t in times]}", flush=True)
    write_report(report, args.out)
    tmp.cleanup()
    return report


if __name__ == "__main__":
    main()
