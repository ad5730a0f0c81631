"""Train with PPO/GRPO:  torchrun --nproc_per_node=N launch/train.py --config configs/X.yaml [key=value ...]

`python launch/train.py ...` runs as a single process. `--print-config` prints the resolved config and exits
(checked against the layout it names: no process launched, no model or data file read). A finished run ends with
a short summary on rank 0 (rlhf_mcore/trainer/summary.py): its steps and time, the training reward and held-out
accuracy, where its checkpoints, metrics, plots and trace are. With the console and jsonl loggers and matplotlib
installed it also draws the curves (launch/plot_metrics.py) into <run dir>/plots/curves.png.
"""
import importlib.util
import os
import sys
import time

from rlhf_mcore.cli import main


def run(cfg):
    from rlhf_mcore.trainer import train

    t0 = time.time()
    train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print("\n".join(end_of_run(cfg, time.time() - t0)), flush=True)


def end_of_run(cfg, seconds: float) -> list[str]:
    """Rank 0, after training: the curves drawn (console + jsonl loggers, matplotlib installed), then the
    summary."""
    from rlhf_mcore.trace import trace_path
    from rlhf_mcore.trainer.roles import run_dir
    from rlhf_mcore.trainer.summary import summary_lines

    out = run_dir(cfg)
    loggers = set(cfg.trainer.logger)
    plots = f"python launch/plot_metrics.py {out}" if "jsonl" in loggers else None
    if plots and "console" in loggers and importlib.util.find_spec("matplotlib") is not None:
        from plot_metrics import plot_run  # launch/ is this script's directory, first on sys.path

        try:
            plots = str(plot_run(out)[0])
        except ValueError:  # no record to plot (a run of no step)
            pass
    elif plots and "console" in loggers:
        plots += "  (needs matplotlib: pip install -e '.[plot]')"
    trace = trace_path(cfg.trainer.trace, out)
    return summary_lines(out, seconds, plots=plots, trace_file=trace if trace is not None and trace.is_file() else None)


if __name__ == "__main__":  # the guard matters: dist_checkpointing's writer spawns processes
    sys.exit(main(run, description=__doc__))
