"""Plot a run's curves from its metrics.jsonl:  python launch/plot_metrics.py RUN_DIR [--keys K ...] [--out FILE]

Writes one PNG (default RUN_DIR/plots/curves.png), a panel per curve: the training reward (mean, with its std
band), the held-out accuracy per data source (the validation records), the response length, the KL terms, the
entropy, the gradient norm, the throughput and, for the asynchronous trainers, the staleness histogram (trained
groups by how many policy versions they lagged, over the run). A panel whose metrics the run did not log is left
out. `--keys a b ...` plots those metrics instead, one panel each (a key ending in `*` takes every metric it starts).

matplotlib is an optional dependency (`pip install -e .[plot]`); without it the script says so in one line.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from rlhf_mcore.trainer.summary import read_records

# (title, [(metric, label)], y label): the default panels, in order
PANELS = [
    ("training reward", [("critic/score/mean", "mean")], "score"),
    ("held-out accuracy", [("val/*/acc", None)], "accuracy"),
    ("response length", [("response_length/mean", "mean"), ("response_length/max", "max")], "tokens"),
    ("KL", [("actor/ppo_kl", "actor/ppo_kl"), ("actor/kl_loss", "actor/kl_loss"),
            ("actor/reward_kl_penalty", "in-reward penalty"), ("rollout/k3_kl", "rollout vs trainer (k3)")], "nats"),
    ("entropy", [("actor/entropy", "actor")], "nats"),
    ("grad norm", [("actor/grad_norm", "actor"), ("critic/grad_norm", "critic")], ""),
    ("throughput", [("perf/throughput", "tokens/s")], "tokens/s"),
]
MISSING = "launch/plot_metrics.py needs matplotlib, which is not installed: pip install -e '.[plot]' (or matplotlib)"


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in pts], [v for _, v in pts]


def _expand(records: list[dict], pattern: str) -> list[str]:
    """The metric names matching `pattern` (`a*b`: starting with a, ending with b), in first-seen order."""
    if "*" not in pattern:
        return [pattern] if any(pattern in r for r in records) else []
    head, tail = pattern.split("*", 1)
    seen = {}
    for r in records:
        for k in r:
            if k.startswith(head) and k.endswith(tail) and len(k) >= len(head) + len(tail):
                seen.setdefault(k, None)
    return list(seen)


def staleness_histogram(train: list[dict]) -> dict[int, float]:
    """Groups trained per staleness over the run (`<mode>/staleness/<k>` summed over steps)."""
    out: dict[int, float] = {}
    for r in train:
        for k, v in r.items():
            parts = k.split("/")
            if len(parts) == 3 and parts[1] == "staleness" and parts[2].isdigit():
                out[int(parts[2])] = out.get(int(parts[2]), 0.0) + v
    return dict(sorted(out.items()))


def panels_for(train: list[dict], val: list[dict], keys: list[str] | None) -> list[tuple]:
    """The panels to draw: (title, [(records, metric, label)], y label) for curves, ("staleness", histogram) last."""
    out = []
    if keys:
        for pattern in keys:
            for key in _expand(train, pattern) + _expand(val, pattern):
                recs = val if any(key in r for r in val) and not any(key in r for r in train) else train
                out.append((key, [(recs, key, None)], ""))
        return out
    for title, metrics, ylabel in PANELS:
        lines = []
        for pattern, label in metrics:
            recs = val if pattern.startswith("val/") else train
            for key in _expand(recs, pattern):
                lines.append((recs, key, label or key[len("val/"):-len("/acc")]))
        if lines:
            out.append((title, lines, ylabel))
    hist = staleness_histogram(train)
    if hist:
        out.append(("staleness (trained groups)", hist))
    return out


def plot_run(run_dir: Path, keys: list[str] | None = None, out: Path | None = None) -> tuple[Path, list[str]]:
    """Draw the panels of `run_dir/metrics.jsonl` into one PNG; returns its path and the panels' titles. Raises
    ImportError (MISSING) without matplotlib, FileNotFoundError / ValueError for a run with nothing to plot."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass the run's directory (trainer.default_local_dir), "
                                f"whose trainer.logger includes jsonl")
    train, val = read_records(path)
    panels = panels_for(train, val, keys)
    if not panels:
        raise ValueError(f"nothing to plot in {path}" + (f" for --keys {' '.join(keys)}" if keys else ""))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(MISSING) from None
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        if len(panel) == 2:  # the staleness histogram
            title, hist = panel
            ax.bar([str(k) for k in hist], list(hist.values()), color="tab:purple")
            ax.set_xlabel("policy versions behind")
            ax.set_ylabel("groups")
        else:
            title, lines, ylabel = panel
            for recs, key, label in lines:
                steps, values = _series(recs, key)
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
                if key == "critic/score/mean":
                    _, std = _series(recs, "critic/score/std")
                    if len(std) == len(values):
                        ax.fill_between(steps, [v - s for v, s in zip(values, std)],
                                        [v + s for v, s in zip(values, std)], alpha=0.2)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            if len(lines) > 1 or lines[0][2] not in (None, "mean"):
                ax.legend(fontsize=8)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(str(Path(run_dir).resolve().name), fontsize=11)
    fig.tight_layout()
    out = Path(out) if out is not None else Path(run_dir) / "plots" / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out, [p[0] for p in panels]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="the run's directory (trainer.default_local_dir)")
    ap.add_argument("--keys", nargs="+", help="metrics to plot instead of the default panels (`prefix*` allowed)")
    ap.add_argument("--out", type=Path, help="the PNG to write (default RUN_DIR/plots/curves.png)")
    args = ap.parse_args(argv)
    try:
        out, titles = plot_run(args.run_dir, args.keys, args.out)
    except (ImportError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"plots at {out} ({', '.join(titles)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
