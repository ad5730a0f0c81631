"""GRPO with a learned reward model as the only reward, on the CPU demo's task (run `make demo` / launch/demo.py
first: it writes the tiny model, the synthetic data and the SFT warm start under --demo-dir).

1. synthetic preference pairs from the same task (launch/preprocess_data.py synthetic-preferences): the answer in
   the format the strict reward accepts is chosen, a wrong number or a trailing full stop rejected;
2. Bradley-Terry reward-model training from the SFT warm start (launch/train_rm.py), held-out pairwise accuracy
   printed per epoch;
3. GRPO (configs/demo_cpu.yaml) with `reward_model.enable=true` and the default weights (rule_weight 0: the rule
   reward never reaches the policy) and a KL loss to the warm start (`kl_loss_coef=1.0`); validation still scores
   with the rule, so the printed curve is the task's true accuracy.

The reward model starts from the warm start, which already copies numbers: it learns the full stop at once and
the wrong number over the first two epochs (at a learning rate of 2e-4; at 1e-3 it never gets past chance on those
pairs). A reward model that knows only the format gets hacked: GRPO then finds answers it scores highly that the
rule rejects, and true accuracy rises for a few steps, then collapses. The KL loss keeps the warm start's number
copying either way.

    python launch/demo_rm.py [--demo-dir outputs/demo] [--out outputs/demo_rm] [--grpo-steps 20]
"""
import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo import ROOT, run, torchrun, validation_curve  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo-dir", default="outputs/demo", help="where launch/demo.py wrote its outputs")
    ap.add_argument("--out", default="outputs/demo_rm")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=4096)
    ap.add_argument("--rm-epochs", type=int, default=2)
    ap.add_argument("--grpo-steps", type=int, default=None, help="override trainer.total_training_steps")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reward-model", default=None, help="use this reward model instead of training one")
    ap.add_argument("overrides", nargs="*", help="extra run-config overrides for GRPO (key=value)")
    args = ap.parse_args()
    demo, out = ROOT / args.demo_dir, ROOT / args.out
    sft = demo / "sft_model"
    if not (sft / "config.json").is_file():
        print(f"no SFT warm start in {sft}: run `python launch/demo.py --out {args.demo_dir}` first", file=sys.stderr)
        return 2
    t0 = time.time()
    rm = Path(args.reward_model) if args.reward_model else out / "reward_model"
    if not args.reward_model:
        prefs = out / "preferences"
        print(f"[1/3] preference pairs -> {prefs}", flush=True)
        run([sys.executable, str(ROOT / "launch" / "preprocess_data.py"), "synthetic-preferences", "--n",
             str(args.pairs), "--n-test", "256", "--output-dir", str(prefs)])
        print(f"[2/3] Bradley-Terry reward model from {sft} -> {rm}", flush=True)
        run(torchrun(1, "train_rm.py", "--model", str(sft), "--train-file", str(prefs / "train.parquet"),
                     "--val-file", str(prefs / "test.parquet"), "--out", str(rm), "--epochs", str(args.rm_epochs),
                     "--batch-size", "32", "--micro-batch-pairs", "8", "--lr", "2e-4", "--warmup-steps", "20",
                     "--max-length", "160",
                     "--device", "cpu", "--seed", str(args.seed), "--report", str(out / "rm_report.json")))
        report = json.loads((out / "rm_report.json").read_text())
        print(f"reward model held-out pairwise accuracy per epoch: {report['val_accuracy']}", flush=True)
    grpo = out / "grpo"
    if grpo.exists():
        shutil.rmtree(grpo)
    print("[3/3] GRPO with the reward model as the only reward", flush=True)
    extra = [f"trainer.total_training_steps={args.grpo_steps}"] if args.grpo_steps else []
    run(torchrun(args.nproc, "train.py", "--config", "configs/demo_cpu.yaml", f"actor_rollout_ref.model.path={sft}",
                 f"data.train_files=[{demo / 'data' / 'synthetic' / 'train.parquet'}]",
                 f"data.val_files=[{demo / 'data' / 'synthetic' / 'test.parquet'}]",
                 "reward_model.enable=true", f"reward_model.model.path={rm}",
                 "reward_model.micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.use_kl_loss=true",
                 "actor_rollout_ref.actor.kl_loss_coef=1.0", f"trainer.n_gpus_per_node={args.nproc}",
                 f"trainer.default_local_dir={grpo}", f"trainer.seed={args.seed}", f"data.seed={args.seed}", *extra,
                 *args.overrides))
    print(validation_curve(grpo / "metrics.jsonl"))
    print(f"\ndone in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
