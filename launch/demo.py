"""`make demo`: the whole pipeline on a tiny model, on CPU, in minutes.

1. build a tiny Qwen2-shaped model (random weights, tokenizer trained on GSM8K text) if missing;
2. write the synthetic task at difficulty 0 ("What is 47?", "Mia has 47 apples. How many ...": read the number
   back in GSM8K's "#### 47" format) and a GSM8K validation slice, as veRL-schema parquet. The warm-start
   targets end with a full stop ("#### 47.") in 70% of the rows, which the strict GSM8K reward scores 0;
3. a supervised warm start on that data (launch/sft.py under torchrun): it learns to copy the number and takes
   up the data's habit of ending with a full stop, so its greedy answers mostly score 0. A rerun with the same
   SFT settings reuses the finished warm start (the same settings give the same weights: fixed seeds, one thread);
   other settings, or a warm start that did not finish, train it again;
4. GRPO (launch/train.py --config configs/demo_cpu.yaml under torchrun) on prompts drawn from the whole
   training set, validating (greedy) on held-out synthetic problems and on GSM8K through the real GSM8K
   reward: RL drops the full stop the reward rejects, and held-out greedy accuracy rises;
5. print the validation curve and where logs, metrics, checkpoints and the final model went.

SFT and GRPO processes run single-threaded (OMP_NUM_THREADS=1) with fixed seeds, so a rerun gives the same
numbers on the same machine whatever the caller's thread settings.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# share of warm-start targets ending "#### 47." (scored 0 by the strict GSM8K reward): the warm start's greedy
# answers keep the majority's full stop, and RL has a format to fix on held-out problems too
PERIOD_ANSWERS = 0.7


def run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), flush=True)
    # one thread per process: the warm start's floating-point path (and so its accuracy) must not depend on the
    # caller's thread settings; torch takes its intra-op thread count from these
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               TOKENIZERS_PARALLELISM="false")
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)


SFT_SETTINGS = "demo_sft_settings.json"  # written into the warm start's directory once its training finished


def finished_warm_start(sft_out: Path, settings: dict) -> bool:
    """Whether `sft_out` holds a warm start that finished with exactly these settings."""
    try:
        return json.loads((sft_out / SFT_SETTINGS).read_text()) == settings and (sft_out / "config.json").is_file()
    except (OSError, ValueError):
        return False


def weights_digest(model_dir: Path) -> str:
    """sha256 over the model directory's safetensors files (the base the warm start was trained from)."""
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def torchrun(nproc: int, script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(ROOT / "launch" / script), *args]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="processes per torchrun (default 2; an asynchronous config "
                                                         "launches its training + rollout pools instead)")
    ap.add_argument("--config", default="configs/demo_cpu.yaml",
                    help="the GRPO config (default configs/demo_cpu.yaml; configs/demo_async_cpu.yaml: the "
                         "fully asynchronous trainer)")
    ap.add_argument("--out", default="outputs/demo", help="where everything goes (default outputs/demo)")
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--sft-batch-size", type=int, default=32)
    ap.add_argument("--grpo-steps", type=int, default=None, help="override trainer.total_training_steps")
    ap.add_argument("--seed", type=int, default=1, help="seed of the warm start and of GRPO (sampling, data order)")
    args = ap.parse_args()
    out = ROOT / args.out
    t0 = time.time()

    from rlhf_mcore.data import preprocess_gsm8k, write_synthetic_parquet
    from rlhf_mcore.models.tiny import make_tiny_model

    tiny = out / "tiny_model"
    if not (tiny / "config.json").is_file():
        print(f"[1/4] building a tiny model in {tiny}", flush=True)
        make_tiny_model(tiny, arch="qwen2", layers=2, hidden=128, heads=4, kv_heads=2, seed=0, init_std=0.02)
    data = out / "data"
    print(f"[2/4] writing data to {data}", flush=True)
    write_synthetic_parquet(data / "synthetic", n=2048, difficulty=0, seed=0, n_test=64,
                            period_answers=PERIOD_ANSWERS)
    gsm8k = preprocess_gsm8k(output_dir=data / "gsm8k")
    _slice_parquet(data / "gsm8k" / "test.parquet", data / "gsm8k_val.parquet", rows=32)
    del gsm8k

    sft_out = out / "sft_model"
    sft = {"steps": args.sft_steps, "batch_size": args.sft_batch_size, "lr": 3e-3, "max_length": 160,
           "seed": args.seed, "nproc": args.nproc, "base": weights_digest(tiny)}
    if finished_warm_start(sft_out, sft):
        print(f"[3/4] reusing the supervised warm start in {sft_out} (made with these settings; remove it to "
              "train it again)", flush=True)
    else:
        print(f"[3/4] supervised warm start -> {sft_out}", flush=True)
        (sft_out / SFT_SETTINGS).unlink(missing_ok=True)
        run(torchrun(args.nproc, "sft.py", "--model", str(tiny), "--train-file",
                     str(data / "synthetic" / "train.parquet"), "--out", str(sft_out), "--steps", str(sft["steps"]),
                     "--batch-size", str(sft["batch_size"]), "--lr", str(sft["lr"]), "--max-length",
                     str(sft["max_length"]), "--seed", str(sft["seed"]), "trainer.device=cpu"))
        (sft_out / SFT_SETTINGS).write_text(json.dumps(sft))

    from rlhf_mcore.config import load_config

    cfg = load_config(ROOT / args.config, [])
    if cfg.async_training.mode == "off":
        nproc, layout = args.nproc, [f"trainer.n_gpus_per_node={args.nproc}"]
    else:  # the config sizes its pools
        nproc, layout = cfg.trainer.n_gpus_per_node + cfg.rollout.n_gpus_per_node, []
    grpo = out / Path(cfg.trainer.default_local_dir).name
    if grpo.exists():  # a rerun trains again: the previous run's checkpoints would otherwise be resumed
        print(f"[4/4] removing the previous demo run in {grpo}", flush=True)
        shutil.rmtree(grpo)
    print("[4/4] GRPO", flush=True)
    extra = [f"trainer.total_training_steps={args.grpo_steps}"] if args.grpo_steps else []
    run(torchrun(nproc, "train.py", "--config", args.config, f"actor_rollout_ref.model.path={sft_out}",
                 f"data.train_files=[{data / 'synthetic' / 'train.parquet'}]",
                 f"data.val_files=[{data / 'synthetic' / 'test.parquet'},{data / 'gsm8k_val.parquet'}]",
                 *layout, f"trainer.default_local_dir={grpo}",
                 f"trainer.seed={args.seed}", f"data.seed={args.seed}", *extra))

    print("\n" + validation_curve(grpo / "metrics.jsonl"))
    plots = grpo / "plots" / "curves.png"  # train.py draws them when matplotlib is installed
    print(f"\ndone in {time.time() - t0:.0f} s. Outputs:\n"
          f"  metrics (JSONL)     {grpo / 'metrics.jsonl'}\n"
          + (f"  plots (PNG)         {plots}\n" if plots.is_file() else
             f"  plots               python launch/plot_metrics.py {grpo}  (needs matplotlib)\n") +
          f"  TensorBoard         tensorboard --logdir {grpo / 'tensorboard'}\n"
          f"  checkpoints         {grpo / 'checkpoints'}\n"
          f"  final actor (HF)    {grpo / 'hf_final'}\n"
          f"  SFT warm start (HF) {sft_out}\n"
          "Next: README.md, 'Training a real model (one GPU)'.")
    return 0


def validation_curve(metrics_jsonl: Path) -> str:
    """A text table from a run's metrics.jsonl: per validation step, held-out synthetic and GSM8K accuracy
    (greedy) and the mean training reward of the steps since the previous validation."""
    rows = [json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip()]
    train = {r["step"]: r for r in rows if r["kind"] == "train"}
    val = {r["step"]: r for r in rows if r["kind"] == "val"}
    lines = ["validation curve (greedy accuracy on held-out problems; training reward = mean sampled score)",
             f"{'step':>5} | {'held-out synthetic':>18} | {'GSM8K':>6} | training reward (steps)"]
    prev = 0
    for step in sorted(val):
        syn, gsm = (f"{val[step][k]:.3f}" if k in val[step] else "-"
                    for k in ("val/synthetic/arithmetic/acc", "val/openai/gsm8k/acc"))
        since = [train[s]["critic/score/mean"] for s in range(prev + 1, step + 1) if s in train]
        reward = f"{sum(since) / len(since):.3f} ({prev + 1}-{step})" if since else "-"
        lines.append(f"{step:>5} | {syn:>18} | {gsm:>6} | {reward}")
        prev = step
    return "\n".join(lines)


def _slice_parquet(src: Path, dst: Path, rows: int) -> None:
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(src).slice(0, rows), dst)


if __name__ == "__main__":
    sys.exit(main())
