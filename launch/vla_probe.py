"""Probe the VLA demo's learning signal: GRPO steps on the demo's policy and env with per-step diagnostics.

Issue 37's tool for finding why GRPO does not lift the demo's held-out success (README, "VLA"). It builds the
trainer's own `VLARun` from configs/vla_reachpush_cpu.yaml, runs (or loads, cached per seed) the behaviour-cloning
warm start, then its own loop of the trainer's pieces (`train_states` -> `rollout` -> `flatten_rollout` ->
`training_batch` -> the engine's PPO update), printing per step, as JSON lines:

- `succ` (train success at the sampling temperature), `mixed` (episodes in groups of mixed success: the ones
  with a non-zero GRPO advantage), `tok_s` / `tok_f` (masked action tokens of a successful / failed episode),
  `pos_w` (the share of the loss's weight on positive-advantage tokens: under token-mean, failures' long
  episodes dominate), `ent`, `clip`, `kl`, `gn` (the engine's entropy, clip fraction, PPO KL, grad norm);
- `gain`, `dpos`, `dneg`: the update's effect on the batch it trained on, re-scored after the step (token-mean
  advantage x log-prob change, and the mean log-prob change of positive- and negative-advantage tokens): a
  positive gain says the step moved the policy the way the advantages ask (the sign and broadcast are right);

and at validation `greedy` (the trainer's `val/success`), `sampled` / `sampled_any` (T=1 success over
`--val-sampled` episodes per held-out state / any of them). `--weight episode` scales each episode's advantage by
(mean tokens of a mixed-group episode / its tokens), so every episode weighs the same under token-mean;
`--analyse` adds where the greedy held-out episodes end: failures within 0.2 of another block
(`fail_near_other`; `fail_at_habit`: within 0.2 of the block `--wrong`'s expert heads for) or within 0.3 of the
target (`fail_near_target`; `fail_short`: 0.1-0.3 between the edges, where `--short`'s expert stands), as
fractions of all episodes;
`--fixed K` trains on K fixed training states and validates on them (can RL fit them at all?).

    python launch/vla_probe.py --seed 2 --steps 20 --lr 3e-3 --states 16 --n 4 --epochs 4 --weight episode

One process, single-threaded; the warm start (minutes) is cached under --cache. Results are appended to
OUT/results.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--states", type=int, default=8, help="initial states a step (x --n episodes)")
    ap.add_argument("--n", type=int, default=4, help="episodes per state (rollout.n)")
    ap.add_argument("--epochs", type=int, default=1, help="actor.ppo_epochs")
    ap.add_argument("--weight", default="token", choices=["token", "episode"])
    ap.add_argument("--temp", type=float, default=1.0)
    ap.add_argument("--val-every", type=int, default=10)
    ap.add_argument("--val-sampled", type=int, default=0, help="T=1 held-out episodes per state (0: none)")
    ap.add_argument("--analyse", action="store_true", help="where the greedy held-out episodes end")
    ap.add_argument("--fixed", type=int, default=0, help="train on this many fixed states and validate on them")
    ap.add_argument("--bc-steps", type=int, default=300)
    ap.add_argument("--bc-lr", type=float, default=3e-3)
    ap.add_argument("--image-size", type=int, default=16)
    ap.add_argument("--wrong", type=float, default=0.0, help="vla.demo_wrong_target (the expert's habit)")
    ap.add_argument("--short", type=float, default=0.0, help="vla.demo_stop_short (the expert's other habit)")
    ap.add_argument("--out", default="outputs/vla_probe")
    ap.add_argument("--cache", default="outputs/vla_probe/bc_cache")
    ap.add_argument("overrides", nargs="*", help="config key=value")
    return ap.parse_args(argv)


def build(args):
    from rlhf_mcore.config import load_config
    from rlhf_mcore.engine import checkpoint as ck
    from rlhf_mcore.models.vision.tiny import make_tiny_llava
    from rlhf_mcore.parallel import init_distributed
    from rlhf_mcore.trainer.vla import VLARun, reset_adam_moments

    out = Path(args.out)
    model = out / f"tiny_llava_{args.image_size}"
    if not (model / "config.json").is_file():
        make_tiny_llava(model, image_size=args.image_size, patch_size=4, seed=0)
    run_dir = out / f"run_{os.getpid()}"
    ov = [f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={run_dir}",
          f"trainer.seed={args.seed}", "trainer.resume_mode=disable", f"vla.image_size={args.image_size}",
          f"vla.num_envs={args.states * args.n}", f"actor_rollout_ref.rollout.n={args.n}",
          f"actor_rollout_ref.actor.optim.lr={args.lr}", f"actor_rollout_ref.actor.ppo_epochs={args.epochs}",
          f"actor_rollout_ref.rollout.temperature={args.temp}", f"vla.bc_steps={args.bc_steps}",
          f"vla.bc_lr={args.bc_lr}", "vla.bc_reset_optimizer=false", f"vla.demo_wrong_target={args.wrong}",
          f"vla.demo_stop_short={args.short}",
          f"trainer.total_training_steps={max(args.steps, 1)}"]
    cfg = load_config(str(ROOT / "configs/vla_reachpush_cpu.yaml"), ov + list(args.overrides))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    state = init_distributed(1, 1, None, device="cpu", seed=args.seed)
    run = VLARun(cfg, state, run_dir)
    eng = run.engine
    cache = Path(args.cache) / (f"s{args.seed}_b{args.bc_steps}_lr{args.bc_lr}_i{args.image_size}"
                                + (f"_w{args.wrong}" if args.wrong else "") + (f"_s{args.short}" if args.short else ""))
    if (cache / "metadata.json").exists():  # saved with BC's Adam moments (then reset below, as the trainer does)
        ck.load_checkpoint(cache, eng.modules, state, eng.optimizer, None, load_rng=False)
        print("loaded the warm start", cache, flush=True)
    elif args.bc_steps:
        start = time.time()
        losses = run.behaviour_cloning(args.bc_steps, cfg.vla.bc_batch_size)
        print(f"BC loss {losses[0]:.3f} -> {losses[-1]:.3f} in {time.time() - start:.0f} s", flush=True)
        ck.save_checkpoint(cache, eng.modules, state, eng.optimizer, None)
    reset_adam_moments(eng.optimizer)
    if args.fixed:
        import numpy as np

        from rlhf_mcore.vla.envs.reach_push import HELD_OUT_OFFSET, ReachPush

        fixed = np.random.default_rng([args.seed, 777]).integers(0, HELD_OUT_OFFSET - cfg.vla.demo_episodes,
                                                                 size=args.fixed)
        run.train_states = lambda step: fixed[:args.states]
        run.val_ids, run.val_env = fixed, ReachPush(len(fixed), **run.env_kwargs)
    return cfg, run


def validate(args, run, step: int) -> dict:
    import numpy as np

    from rlhf_mcore.trainer.vla import _keyed_generator
    from rlhf_mcore.vla.envs.reach_push import BLOCK_R, PUSHER_R, ReachPush
    from rlhf_mcore.vla.rollout import rollout

    rec = {"step": step, "greedy": run.validate()["val/success"]}
    if args.val_sampled:
        ids = np.repeat(run.val_ids, args.val_sampled)
        ro = rollout([ReachPush(len(ids), **run.env_kwargs)], run._policy_fn(_keyed_generator(99, step), 1.0), ids,
                     overlap=False)
        rec["sampled"] = float(ro.success.mean())
        rec["sampled_any"] = float(ro.success.reshape(-1, args.val_sampled).any(1).mean())
    if args.analyse:  # the greedy episodes' final scenes (run.validate ran them in run.val_env, in process)
        env = run.val_env
        rows = np.arange(env.num_envs)
        d_target = np.linalg.norm(env.pusher - env.blocks[rows, env.target], axis=1)
        d_other = np.linalg.norm(env.pusher[:, None] - env.blocks, axis=2)
        d_other[rows, env.target] = np.inf
        fail = ~env.terminated
        rec["fail_near_other"] = float((fail & (d_other.min(1) < 0.2)).mean())
        rec["fail_near_target"] = float((fail & (d_target < 0.3)).mean())
        habit = (env.target + 1) % env.blocks.shape[1]  # the block vla.demo_wrong_target's expert heads for
        d_habit = np.linalg.norm(env.pusher - env.blocks[rows, habit], axis=1)
        rec["fail_at_habit"] = float((fail & (d_habit < 0.2)).mean())
        gap = d_target - PUSHER_R - BLOCK_R  # vla.demo_stop_short's expert stands STOP_GAP (0.2) short
        rec["fail_short"] = float((fail & (gap > 0.1) & (gap < 0.3)).mean())
    print("VAL", json.dumps(rec), flush=True)
    return rec


def probe_step(args, cfg, run, step: int) -> dict:
    import numpy as np

    from rlhf_mcore.trainer.vla import _keyed_generator, episode_advantages
    from rlhf_mcore.vla.rollout import rollout
    from rlhf_mcore.vla.rows import flatten_rollout, repeat_for_groups

    start = time.perf_counter()
    ids, group = repeat_for_groups(run.train_states(step), run.n)
    ro = rollout(run.stages, run._policy_fn(_keyed_generator(cfg.trainer.seed, step, 0), args.temp), ids,
                 overlap=False)
    success = ro.success.astype(np.float32)
    adv = episode_advantages(success, group, cfg.algorithm.norm_adv_by_std_in_grpo)
    rows = flatten_rollout(ro, group)
    toks = np.bincount(rows.traj, weights=rows.response_mask.sum(1), minlength=len(ids))  # (B,) masked tokens
    rate = np.array([success[group == g].mean() for g in group])
    mixed = (rate > 0) & (rate < 1)
    w = adv
    if args.weight == "episode" and mixed.any():
        w = adv * toks[mixed].mean() / np.maximum(toks, 1)
    batch, _ = run.training_batch(rows, np.arange(len(rows)), w)
    upd = run.engine.update(batch)
    new, _ = run.engine.compute_log_probs(batch, with_entropy=False)
    m, a = batch["response_mask"], batch["advantages"]
    dlp = (new - batch["old_log_probs"]) * m
    rec = {"step": step, "succ": float(success.mean()), "mixed": float(mixed.mean()),
           "tok_s": float(toks[success > 0].mean()) if success.any() else 0.0,
           "tok_f": float(toks[success == 0].mean()) if (success == 0).any() else 0.0,
           "pos_w": float((np.clip(w, 0, None) * toks).sum() / max((np.abs(w) * toks).sum(), 1e-9)),
           "ent": upd["actor/entropy"], "clip": upd["actor/pg_clipfrac"], "kl": upd["actor/ppo_kl"],
           "gn": upd["actor/grad_norm"], "gain": float((a * dlp).sum() / m.sum()),
           "dpos": float(dlp[a > 0].mean()) if (a > 0).any() else 0.0,
           "dneg": float(dlp[a < 0].mean()) if (a < 0).any() else 0.0, "s": time.perf_counter() - start}
    print("TRAIN", json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
    return rec


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    start = time.time()
    cfg, run = build(args)
    try:
        vals, hist = [validate(args, run, 0)], []
        for step in range(1, args.steps + 1):
            hist.append(probe_step(args, cfg, run, step))
            if step % args.val_every == 0 or step == args.steps:
                vals.append(validate(args, run, step))
    finally:
        from rlhf_mcore.parallel import destroy_distributed

        run.close()
        destroy_distributed()  # main() may run again in this process (the tests do)
    res = {"args": vars(args), "vals": vals, "train": hist, "seconds": round(time.time() - start, 1)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "results.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
    return res


if __name__ == "__main__":  # the guard matters: the checkpoint writer starts processes that re-import this module
    main()
