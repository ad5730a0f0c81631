"""Checkpoints written before the trainers were split into parts (tests/data/resume_fixture/, written by
tests/data/make_resume_fixture.py on main at 40574c6) still resume: the synchronous trainer's whole checkpoint,
and the asynchronous modes' trainer state, whose keys are the checkpoint's contract."""
import json
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))

from e2e_helpers import parity_task, records, torchrun_train  # noqa: E402
from make_resume_fixture import TINY  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "data" / "resume_fixture"


def test_a_checkpoint_of_the_previous_trainer_resumes(tmp_path):
    """One process resumes the fixture's step-1 checkpoint (its model rebuilt from the same seed; the saved paths
    differ, hence resume_ignore_config_changes) and trains step 2: the step, the sampler's position and the KL
    controller come from the saved trainer state. Mutation: rename a trainer-state key (`sampler` -> `data_sampler`
    in the trainer state's save and load) -> fails (KeyError on the old checkpoint)."""
    from rlhf_mcore.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model", **TINY)
    out = tmp_path / "run"
    shutil.copytree(FIXTURE / "off", out)
    saved = json.loads((out / "checkpoints" / "global_step_1" / "trainer_state_rank0.json").read_text())
    args = parity_task(tmp_path, model, max_response_length=4) + [
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.total_training_steps=2",
        "trainer.save_freq=1", "trainer.export_hf_final=false", "trainer.max_rollout_logprob_gap=null",
        "algorithm.adv_estimator=grpo", "data.max_prompt_length=512", f"trainer.default_local_dir={out}",
        "trainer.resume_mode=auto", "trainer.resume_ignore_config_changes=true"]
    run = torchrun_train(1, args)
    assert run.returncode == 0, run.stderr[-4000:]
    assert re.search(r"resumed from \S+global_step_1 at step 1", run.stdout + run.stderr)
    assert [r["step"] for r in records(out)] == [2]
    state = json.loads((out / "checkpoints" / "global_step_2" / "trainer_state_rank0.json").read_text())
    assert set(state) == set(saved) and state["step"] == 2
    assert state["sampler"] == {**saved["sampler"], "position": saved["sampler"]["position"] + 2}
