"""Trains the warm starts of tests/warm_starts.py (all, or those named; AGENT through launch/demo_agent.py) and
writes each Hugging Face directory (VLA through launch/demo_vla.py) with its manifest.json (the spec and the commit
it was trained at) under
tests/data/warm_starts/NAME/:

    python tests/data/make_warm_starts.py [NAME ...]

Run it after a change to a spec, to the tiny model, to the synthetic task or to SFT that should change the warm
starts (tests/test_warm_starts.py fails when a committed directory no longer matches its spec). One process, CPU;
about 1-2 minutes each on one core."""
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from launcher import CPU, QUIET, run  # noqa: E402
from warm_starts import AGENT, AGENT_ARGS, DATA, SPECS, VLA, VLA_ARGS, write_task  # noqa: E402


def train_agent() -> None:
    """The agent demo's warm start: launch/demo_agent.py --sft-only at AGENT_ARGS (its settings in warm_start.json)."""
    with tempfile.TemporaryDirectory() as tmp:
        run("launch/demo_agent.py", "--out", tmp, *AGENT_ARGS, "--sft-only", env_extra={**CPU, **QUIET}, timeout=1800)
        save(AGENT, Path(tmp) / "sft_model", {"demo_agent": AGENT_ARGS})


def train_vla() -> None:
    """The VLA demo's warm start: launch/demo_vla.py --bc-only at VLA_ARGS (its settings in warm_start.json)."""
    with tempfile.TemporaryDirectory() as tmp:
        run("launch/demo_vla.py", "--out", tmp, *VLA_ARGS, "--bc-only", env_extra={**CPU, **QUIET}, timeout=1800)
        save(VLA, Path(tmp) / "bc_model", {"demo_vla": VLA_ARGS})


def save(name: str, model_dir: Path, spec: dict) -> None:
    out = DATA / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(model_dir, out)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    (out / "manifest.json").write_text(json.dumps({"spec": spec, "commit": commit}, indent=1) + "\n")
    print(f"{name}: {sum(f.stat().st_size for f in out.iterdir()) / 1e6:.2f} MB in {out}")


def train(name: str) -> None:
    from rlhf_mcore.models.tiny import make_tiny_model

    spec = SPECS[name]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_tiny_model(tmp / "tiny", **spec["model"])
        write_task(name, tmp / "task")
        sft = spec["sft"]
        run("launch/sft.py", "--model", tmp / "tiny", "--train-file", tmp / "task" / "train.parquet",
            "--out", tmp / "sft", "--steps", sft["steps"], "--batch-size", sft["batch_size"], "--lr", sft["lr"],
            "--max-length", sft["max_length"], "--seed", sft["seed"], "trainer.device=cpu",
            env_extra={**CPU, **QUIET}, timeout=1800)
        save(name, tmp / "sft", spec)


if __name__ == "__main__":
    for name in sys.argv[1:] or [*SPECS, AGENT, VLA]:
        if name in (AGENT, VLA):
            {AGENT: train_agent, VLA: train_vla}[name]()
        else:
            train(name)
