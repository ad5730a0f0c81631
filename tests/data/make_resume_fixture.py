"""Writes tests/data/resume_fixture/: a tiny checkpoint of the synchronous trainer (mode off, one step), which
tests/test_checkpoint_resume.py resumes, and the trainer state (trainer_state_rank0.json) of each asynchronous mode's
one-step checkpoint, whose keys that test loads and saves again (their engines' checkpoints are the synchronous
trainer's). Run it once with the code whose checkpoints must keep
resuming (it was run on main at 40574c6, before the trainers were split into parts):

    python tests/data/make_resume_fixture.py

The model is the smallest tiny Qwen2 the trainer accepts (rlhf_mcore.models.tiny, seed 0: the test rebuilds the
same one); the task is tests/e2e_helpers.parity_task."""
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from e2e_helpers import parity_task  # noqa: E402
from launcher import run  # noqa: E402

OUT = ROOT / "tests" / "data" / "resume_fixture"
TINY = dict(arch="qwen2", layers=1, hidden=16, heads=2, kv_heads=1, vocab=320, seed=0)  # the test's model too
MODES = {"off": (1, []),
         "one_step_off": (2, ["async_training.mode=one_step_off", "rollout.n_gpus_per_node=1"]),
         "fully_async": (2, ["async_training.mode=fully_async", "rollout.n_gpus_per_node=1"])}


def main() -> None:
    from rlhf_mcore.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_tiny_model(tmp / "model", **TINY)
        args = parity_task(tmp, model, max_response_length=4) + [
            "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "trainer.total_training_steps=1", "trainer.save_freq=1", "trainer.export_hf_final=false",
            "trainer.max_rollout_logprob_gap=null", "algorithm.adv_estimator=grpo", "data.max_prompt_length=512"]
        shutil.rmtree(OUT, ignore_errors=True)
        for mode, (nproc, extra) in MODES.items():
            run("launch/train.py", *args, *extra, f"trainer.default_local_dir={tmp / mode}", nproc=nproc)
            step = tmp / mode / "checkpoints" / "global_step_1"
            if mode == "off":
                shutil.copytree(step, OUT / mode / "checkpoints" / "global_step_1")
            else:
                shutil.copy(step / "trainer_state_rank0.json", OUT / f"{mode}_trainer_state.json")
    subprocess.run(["du", "-sh", str(OUT)], check=True)


if __name__ == "__main__":
    main()
