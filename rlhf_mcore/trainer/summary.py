"""The end of a run in a few lines (launch/train.py prints them on rank 0): its steps and time, the training reward
at its first and last step, the held-out accuracy per data source (best and last), and where its outputs are.

Every number is read back from the run's metrics.jsonl, so the summary says what the log says."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

REWARD = "critic/score/mean"


def read_records(path: Path) -> tuple[list[dict], list[dict]]:
    """(training, validation) records of a metrics.jsonl in step order; unreadable lines (a killed run's cut
    record) skipped."""
    train, val = [], []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        (val if rec.get("kind") == "val" else train).append(rec)
    return sorted(train, key=lambda r: r["step"]), sorted(val, key=lambda r: r["step"])


def held_out(val: list[dict]) -> dict[str, tuple[tuple[int, float], tuple[int, float]]]:
    """Per data source (`val/<source>/acc`, `all` for `val/acc`): ((best step, best accuracy), (last step, last
    accuracy)); the best is the earliest step at the highest value."""
    out = {}
    for key in dict.fromkeys(k for r in val for k in r if k.startswith("val/") and k.endswith("/acc")):
        pts = [(r["step"], r[key]) for r in val if key in r]
        best = max(pts, key=lambda p: (p[1], -p[0]))
        out["all" if key == "val/acc" else key[len("val/"):-len("/acc")]] = (best, pts[-1])
    return out


def summary_lines(run_dir: Path, seconds: float, plots: Optional[str] = None,
                  trace_file: Optional[Path] = None) -> list[str]:
    """The summary of the run in `run_dir` whose command ran `seconds`. `plots`: where the curves are, or how to
    draw them; `trace_file`: the run's timeline, when it wrote one."""
    metrics = run_dir / "metrics.jsonl"
    train, val = read_records(metrics)
    n = train[-1]["step"] if train else 0
    steps = f"{n} step{'' if n == 1 else 's'}" if train else "no step logged"
    lines = [f"run summary: {steps}, {seconds:.0f} s"]
    rewards = [(r["step"], r[REWARD]) for r in train if REWARD in r]
    if rewards:
        (s0, r0), (s1, r1) = rewards[0], rewards[-1]
        lines.append(f"  training reward     first {r0:.4f} (step {s0}), last {r1:.4f} (step {s1})")
    for source, ((bs, bv), (ls, lv)) in held_out(val).items():
        lines.append(f"  held-out accuracy   {source}: best {bv:.4f} (step {bs}), last {lv:.4f} (step {ls})")
    ckpts = sorted((run_dir / "checkpoints").glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1])
                   if p.name.rsplit("_", 1)[1].isdigit() else -1)
    if ckpts:
        lines.append(f"  checkpoints         {run_dir / 'checkpoints'} (newest {ckpts[-1].name})")
    if (run_dir / "hf_final").is_dir():
        lines.append(f"  final actor (HF)    {run_dir / 'hf_final'}")
    lines.append(f"  metrics             {metrics}" if metrics.is_file() else
                 "  metrics             none written (trainer.logger has no jsonl)")
    if plots:
        lines.append(f"  plots               {plots}")
    if trace_file is not None:
        lines.append(f"  trace               {trace_file} (open in ui.perfetto.dev)")
    return lines
