"""The VLA demo on CPU: a behaviour-cloning warm start, then GRPO on task success lifts the held-out success.

1. write a tiny LLaVA (SigLIP tower over 16x16 images in 4x4 patches, a 2-layer Qwen2) if missing;
2. run the VLA trainer (configs/vla_reachpush_cpu.yaml, through the same `train` as `launch/train.py`):
   `vla.bc_steps` behaviour-cloning steps on the scripted expert's demonstrations, a greedy evaluation on
   `vla.held_out_states` held-out scenes (success_before), GRPO steps, the same evaluation (success_after);
3. print the table and write OUT/summary.json: success_before, success_after, episodes_evaluated, the curve.

    python launch/demo_vla.py [--seed 1] [--bc-steps N] [--steps N] [key=value ...]

Single process, single-threaded (OMP_NUM_THREADS=1). Numbers: README, "VLA".
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/demo_vla")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bc-steps", type=int, default=None, help="default: the config's vla.bc_steps")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the config's)")
    ap.add_argument("--image-size", type=int, default=16, help="the rendered scene and the tower's input")
    ap.add_argument("--config", default=str(ROOT / "configs/vla_reachpush_cpu.yaml"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from rlhf_mcore.config import load_config
    from rlhf_mcore.models.vision.tiny import make_tiny_llava
    from rlhf_mcore.trainer import train

    out = Path(args.out)
    model = out / f"tiny_llava_{args.image_size}"
    if not (model / "config.json").is_file():
        make_tiny_llava(model, image_size=args.image_size, patch_size=4, seed=0)
    run = out / f"grpo_seed{args.seed}"
    shutil.rmtree(run, ignore_errors=True)
    overrides = [f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={run}",
                 f"trainer.seed={args.seed}", "trainer.resume_mode=disable", f"vla.image_size={args.image_size}"]
    if args.bc_steps is not None:
        overrides.append(f"vla.bc_steps={args.bc_steps}")
    if args.steps is not None:
        overrides.append(f"trainer.total_training_steps={args.steps}")
    cfg = load_config(args.config, overrides + list(args.overrides))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    start = time.time()
    train(cfg)
    seconds = time.time() - start
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    vals = [(r["step"], r["val/success"]) for r in records if "val/success" in r]
    summary = {"success_before": vals[0][1], "success_after": vals[-1][1],
               "episodes_evaluated": cfg.vla.held_out_states, "seed": args.seed, "bc_steps": cfg.vla.bc_steps,
               "grpo_steps": cfg.trainer.total_training_steps, "tasks": cfg.vla.tasks, "seconds": round(seconds, 1),
               "val_curve": vals,
               "train_success": [(r["step"], r["train/success"]) for r in records if "train/success" in r]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nheld-out success over {summary['episodes_evaluated']} greedy episodes ({'+'.join(cfg.vla.tasks)}, "
          f"seed {args.seed}, {seconds:.0f} s):")
    print(f"  {'after behaviour cloning':<26}{summary['success_before']:.3f}")
    print(f"  {'after GRPO':<26}{summary['success_after']:.3f}")
    print("  curve (step: success): " + ", ".join(f"{s}: {v:.2f}" for s, v in vals))
    print(f"wrote {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    main()
