"""Metric reduction across ranks and the logging sinks: console, JSONL, TensorBoard, wandb.

Each rank produces a flat ``{name: float}`` dict; :func:`reduce_metrics` averages them over the data-parallel
group (keys ending in ``/max`` take the max, ``/min`` the min), and rank 0 hands the result to the sinks chosen by
``trainer.logger``.
"""
from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from rlhf_mcore import trace
from rlhf_mcore.parallel.dist import collective_device


def reduce_metrics(metrics: dict[str, float], group=None) -> dict[str, float]:
    """Mean over ranks of ``group`` (max for ``*/max``, min for ``*/min``); same key set required on all ranks.

    The values travel on the device the group's backend needs: CUDA for NCCL (the default group on GPU), CPU
    for gloo."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(metrics)
    keys = sorted(metrics)
    device = collective_device(group)
    vals = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device)
    kinds = {"max": [], "min": [], "mean": []}
    for i, k in enumerate(keys):
        kinds["max" if k.endswith("/max") else "min" if k.endswith("/min") else "mean"].append(i)
    out = vals.clone()
    for kind, idx in kinds.items():
        if not idx:
            continue
        part = vals[idx].clone()
        op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "mean": dist.ReduceOp.SUM}[kind]
        dist.all_reduce(part, op=op, group=group)
        if kind == "mean":
            part /= dist.get_world_size(group)
        out[idx] = part
    return {k: out[i].item() for i, k in enumerate(keys)}


_CONSOLE_KEYS = [  # (metric, short label, format) for the one-line summary
    ("critic/score/mean", "reward", "{:.3f}"), ("critic/score/std", "±", "{:.3f}"),
    ("response_length/mean", "len", "{:.0f}"), ("response_length/clip_ratio", "clip", "{:.2f}"),
    ("actor/pg_loss", "pg", "{:.4f}"), ("actor/ppo_kl", "kl", "{:.4f}"), ("actor/entropy", "ent", "{:.3f}"),
    ("critic/vf_loss", "vf", "{:.4f}"), ("actor/grad_norm", "gn", "{:.3f}"),
    ("perf/throughput", "tok/s", "{:.0f}"), ("perf/mfu", "mfu", "{:.1%}"), ("timing_s/step", "s", "{:.1f}"),
]


def console_lines(step: int, total: int, metrics: dict[str, float], kind: str) -> list[str]:
    """The console's lines for a record: a training step's one-line summary (:data:`_CONSOLE_KEYS`); a
    validation's `val/*` metrics, the multi-turn `val/agent/*` ones on a line of their own."""
    if kind == "train":
        parts = [f"step {step}/{total}"]
        parts += [f"{label} {fmt.format(metrics[k])}" for k, label, fmt in _CONSOLE_KEYS if k in metrics]
        return [" | ".join(parts)]
    val = sorted((k, v) for k, v in metrics.items() if k.startswith("val/"))
    lines = []
    for head, keep in ((f"[{kind} @ step {step}]", lambda k: not k.startswith("val/agent/")),
                       (f"[{kind}/agent @ step {step}]", lambda k: k.startswith("val/agent/"))):
        parts = [f"{k} {v:.4f}" for k, v in val if keep(k)]
        if parts or not lines:
            lines.append(" | ".join([head] + parts))
    return lines


def middle_cut(text: str, limit: int = 400) -> str:
    """`text` whole when it has at most `limit` characters, else its start and end with the middle elided."""
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]} ... {text[len(text) - half:]}"


def cut_back_jsonl(path: Path, start_step: int) -> int:
    """Make a ``metrics.jsonl`` continue a run that (re)starts after step `start_step`: drop the records of later
    steps (written after the checkpoint a resumed run went back to) and unreadable lines (a record cut by a
    kill); at ``start_step == 0`` (a fresh start) drop everything. Rewrites the file atomically; returns how
    many lines were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            dropped += 1
            continue
        if start_step > 0 and step <= start_step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(x + "\n" for x in kept))
        tmp.replace(path)
    return dropped


class MetricLogger:
    """Fan-out to the configured sinks; only rank 0 writes anything.

    `start_step`: the step the run continues from (a resume); the JSONL log is cut back to it
    (:func:`cut_back_jsonl`) and TensorBoard purges its later events, so no step is recorded twice."""

    def __init__(self, loggers: list[str], out_dir: Path, total_steps: int, config: Optional[dict] = None,
                 project: str = "rlhf_mcore", name: str = "run", enabled: bool = True, start_step: int = 0):
        self.enabled = enabled
        self.loggers = set(loggers)
        self.total = total_steps
        self._bar = None
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = out_dir / "metrics.jsonl"
        if "jsonl" in self.loggers:
            cut_back_jsonl(self.jsonl_path, start_step)
            self._jsonl = open(self.jsonl_path, "a", buffering=1)
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            purge = start_step + 1 if start_step > 0 else 0  # the events of later steps (a fresh start: all)
            self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"), purge_step=purge)
        if "wandb" in self.loggers:
            try:
                import wandb
            except ImportError:
                print("trainer.logger has 'wandb' but wandb is not installed (pip install wandb); skipping it.",
                      file=sys.stderr)
            else:
                self._wandb = wandb.init(project=project, name=name, config=config, dir=str(out_dir))
        if "console" in self.loggers and sys.stderr.isatty():  # a terminal: a bar with the running phase
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stderr, leave=True)
            self._phase, self._shown_at = "", 0.0  # the running phase's words; when its progress was last drawn
            trace.on_phase(self._show_phase, self._show_progress)
        self._t0 = time.time()

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "kind": kind, **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if "console" in self.loggers:
            self.console(step, clean, kind)

    def console(self, step: int, metrics: dict[str, float], kind: str) -> None:
        for line in console_lines(step, self.total, metrics, kind):
            self.text(line)
        if self._bar is not None and kind == "train":
            self._bar.set_postfix_str("")
            self._bar.update(1)

    def text(self, message: str) -> None:
        """A line of the run's log: above the bar in a terminal, else a plain line on stdout."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def _show_phase(self, s) -> None:
        """A terminal's bar names the step's phase running now (the first step's long generation is not silent):
        the spans with a step number (the step's phases, validation, checkpoint), not those inside them."""
        step = s.args.get("step")
        if step is not None and threading.current_thread() is threading.main_thread():
            self._phase = f"{s.name} (step {step}) ..."
            self._bar.set_postfix_str(self._phase)

    def _show_progress(self, counts: dict[str, Any]) -> None:
        """... and how far it got (the rollout engine's tokens so far), redrawn at most 4 times a second."""
        now = time.monotonic()
        if threading.current_thread() is threading.main_thread() and now - self._shown_at >= 0.25:
            self._shown_at = now
            self._bar.set_postfix_str(f"{self._phase} " + ", ".join(f"{v:,} {k}" for k, v in counts.items()))

    def close(self) -> None:
        if self._bar is not None:
            trace.on_phase(None)
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
