"""The VLA demo on CPU: a behaviour-cloning warm start, then GRPO on task success lifts the held-out success.

1. write a tiny LLaVA (SigLIP tower over 16x16 images in 4x4 patches, a 2-layer Qwen2) if missing;
2. the warm start: `vla.bc_steps` behaviour-cloning steps (the trainer's own `VLARun.behaviour_cloning`) on the
   scripted expert's demonstrations, of which `vla.demo_stop_short` (0.7) stop 0.2 short of the block and stand
   there (an imperfect expert with one consistent habit, as the text demo's warm start ends its answers with a full
   stop the strict reward rejects); written as a Hugging Face directory OUT/bc_model (with warm_start.json: the
   settings it was trained with), or `--warm-start DIR` reuses one (tests/test_vla_learning.py reuses a committed
   one, tests/data/warm_starts/vla_reachpush);
3. the VLA trainer from it (configs/vla_reachpush_cpu.yaml, through the same `train` as `launch/train.py`, fresh
   Adam moments, `vla.bc_steps=0`): a greedy evaluation on `vla.held_out_states` held-out scenes (success_before),
   GRPO steps on task success, the same evaluation (success_after);
4. print the table and write OUT/summary.json: success_before, success_after, episodes_evaluated, the curve.

    python launch/demo_vla.py [--seed 1] [--bc-steps N] [--steps N] [--warm-start DIR | --bc-only] [key=value ...]
    python launch/demo_vla.py --config configs/vla_reachpush_ppo_cpu.yaml ...   # PPO with a value head instead

The same warm start serves both configs (its settings are the `vla.*` keys and the seed, which they share).

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
CONFIG = "configs/vla_reachpush_cpu.yaml"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/demo_vla")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bc-steps", type=int, default=None, help="default: the config's vla.bc_steps")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's)")
    ap.add_argument("--image-size", type=int, default=16, help="the rendered scene and the tower's input")
    ap.add_argument("--config", default=str(ROOT / CONFIG))
    ap.add_argument("--warm-start", default=None, help="reuse this behaviour-cloned policy (a Hugging Face directory "
                    "written by --bc-only or a full run) instead of training one")
    ap.add_argument("--bc-only", action="store_true", help="stop after writing the warm start OUT/bc_model")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from rlhf_mcore.config import load_config
    from rlhf_mcore.models.vision.tiny import make_tiny_llava
    from rlhf_mcore.trainer import train

    out = Path(args.out)
    model = out / f"tiny_llava_{args.image_size}"
    if not args.warm_start and not (model / "config.json").is_file():
        make_tiny_llava(model, image_size=args.image_size, patch_size=4, seed=0)
    algorithm = "ppo" if load_config(args.config, [f"actor_rollout_ref.model.path={model}", *args.overrides]
                                     ).algorithm.adv_estimator == "gae" else "grpo"
    run = out / f"{algorithm}_seed{args.seed}"
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
    bc_seconds = 0.0
    if args.warm_start:
        bc_model = Path(args.warm_start).resolve()
        settings = json.loads((bc_model / WARM_START_FILE).read_text())
        if settings != warm_start_settings(cfg):
            raise SystemExit(f"--warm-start {bc_model} was trained with {settings}, this run would train with "
                             f"{warm_start_settings(cfg)}: retrain it (--bc-only) or match the settings")
    else:
        start = time.time()
        bc_model = behaviour_cloning(cfg, out / "bc_model")
        bc_seconds = time.time() - start
        if args.bc_only:
            print(f"warm start: {bc_model} ({bc_seconds:.0f} s; reuse it with --warm-start {bc_model})")
            return {"bc_model": str(bc_model), "seconds": round(bc_seconds, 1)}
    bc_steps = cfg.vla.bc_steps
    cfg = load_config(args.config, overrides + list(args.overrides) + [f"actor_rollout_ref.model.path={bc_model}",
                                                                        "vla.bc_steps=0"])
    start = time.time()
    train(cfg)
    seconds = time.time() - start + bc_seconds
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    vals = [(r["step"], r["val/success"]) for r in records if "val/success" in r]
    summary = {"success_before": vals[0][1], "success_after": vals[-1][1],
               "episodes_evaluated": cfg.vla.held_out_states, "seed": args.seed, "bc_steps": bc_steps,
               "demo_stop_short": cfg.vla.demo_stop_short, "bc_seconds": round(bc_seconds, 1),
               "algorithm": algorithm, "rl_steps": cfg.trainer.total_training_steps, "tasks": cfg.vla.tasks,
               "seconds": round(seconds, 1),
               "val_curve": vals,
               "train_success": [(r["step"], r["train/success"]) for r in records if "train/success" in r]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nheld-out success over {summary['episodes_evaluated']} greedy episodes ({'+'.join(cfg.vla.tasks)}, "
          f"seed {args.seed}, {seconds:.0f} s):")
    print(f"  {'after behaviour cloning':<26}{summary['success_before']:.3f}")
    print(f"  {'after ' + algorithm.upper():<26}{summary['success_after']:.3f}")
    print("  curve (step: success): " + ", ".join(f"{s}: {v:.2f}" for s, v in vals))
    print(f"wrote {out / 'summary.json'}")
    return summary


WARM_START_FILE = "warm_start.json"
# the config keys a warm start depends on (a reused one must have been trained with the run's values)
_WARM_START_KEYS = ("env", "chunk", "num_bins", "max_steps", "image_size", "tasks", "colors", "demo_episodes",
                    "demo_wrong_target", "demo_stop_short", "bc_steps", "bc_batch_size", "bc_lr")


def warm_start_settings(cfg) -> dict:
    return {"seed": cfg.trainer.seed, **{f"vla.{k}": getattr(cfg.vla, k) for k in _WARM_START_KEYS}}


def behaviour_cloning(cfg, out: Path) -> Path:
    """`vla.bc_steps` steps of the trainer's behaviour cloning (VLARun.behaviour_cloning: the same demonstrations,
    batches and engine as `vla.bc_steps` inside a run), saved as a Hugging Face directory `out`."""
    from rlhf_mcore.parallel import destroy_distributed, init_distributed
    from rlhf_mcore.parallel.allocator import expandable_segments_for
    from rlhf_mcore.trainer.vla import VLARun

    state = init_distributed(1, 1, None, device=cfg.trainer.device, seed=cfg.trainer.seed,
                             expandable_segments=expandable_segments_for(cfg))
    run = None
    try:
        run = VLARun(cfg, state, Path(cfg.trainer.default_local_dir))
        losses = run.behaviour_cloning(cfg.vla.bc_steps, cfg.vla.bc_batch_size)
        print(f"behaviour cloning: {cfg.vla.bc_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        run.engine.save_hf(out)
        (out / WARM_START_FILE).write_text(json.dumps(warm_start_settings(cfg), indent=1) + "\n")
    finally:
        if run is not None:
            run.close()
        destroy_distributed()
    return out


if __name__ == "__main__":  # the guard matters: the checkpoint writer starts processes that re-import this module
    main()
