"""Checkpoints written before the trainers were split into parts (tests/data/resume_fixture/, written by
tests/data/make_resume_fixture.py on main at 40574c6) still resume: the synchronous trainer's whole checkpoint,
and the asynchronous modes' trainer state, whose keys are the checkpoint's contract."""
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cost(40)

sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))

from e2e_helpers import parity_task, records  # noqa: E402
from launcher import run as run_script  # noqa: E402
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
    run = run_script("launch/train.py", *args, nproc=1)
    assert re.search(r"resumed from \S+global_step_1 at step 1", run.stdout + run.stderr)
    assert [r["step"] for r in records(out)] == [2]
    state = json.loads((out / "checkpoints" / "global_step_2" / "trainer_state_rank0.json").read_text())
    assert set(state) == set(saved) and state["step"] == 2
    assert state["sampler"] == {**saved["sampler"], "position": saved["sampler"]["position"] + 2}


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_the_asynchronous_trainer_states_load_into_the_parts_and_save_the_same_keys(mode):
    """Each asynchronous mode's saved trainer state (the fixture) loads into the run, the learner, the training
    pool and the mode's schedule as their loop loads it, and saving again writes the same keys in the same order
    with the same values (fully_async: the groups in flight at the save are to be granted again, `regrant`).
    Mutation: rename a trainer-state key (`dropped_prompts` in TrainingPool.state_dict / load_state_dict) -> fails;
    mutation: drop `self.version = self.run.step` from FullyAsync.load_state_dict -> fails."""
    from types import SimpleNamespace

    from rlhf_mcore.config import load_config
    from rlhf_mcore.trainer.learner import Learner
    from rlhf_mcore.trainer.run import RunContext
    from rlhf_mcore.trainer.schedules import FullyAsync, OneStepOff
    from rlhf_mcore.trainer.training_pool import TrainingPool

    saved = json.loads((FIXTURE / f"{mode}_trainer_state.json").read_text())
    saved.pop("rng")  # the host RNGs: restored by the checkpoint manager, not by the parts
    config = json.loads((FIXTURE / "off" / "checkpoints" / "global_step_1" / "config.json").read_text())
    cfg = load_config(None, [f"actor_rollout_ref.model.path={config['actor_rollout_ref']['model']['path']}",
                             f"async_training.mode={mode}", "data.train_batch_size=2", "algorithm.adv_estimator=grpo"])
    state = SimpleNamespace(is_coordinator=True, rank=0, cpu_group=None, dims=SimpleNamespace(dp=1))
    run = RunContext(cfg, state, tokenizer=None, train_set=[{}] * saved["sampler"]["num_samples"], val_set=None,
                     scorer=None, run_lock=None, out_dir=Path("unused"))
    learner = Learner(cfg, state, actor=None)
    pool = TrainingPool(run, SimpleNamespace(layout=None, mailbox=lambda name: None), dp_ranks=[[0]])
    sched = (OneStepOff if mode == "one_step_off" else FullyAsync)(run, pool)
    run.load_trainer_state(saved, learner)  # as loops.open_pool_run loads it
    pool.load_state_dict(saved)
    sched.load_state_dict(saved)
    if mode == "fully_async":
        assert sched.regrant == saved["regrant"] and pool.ledger.produced == saved["ledger"]["produced"]
        assert sched.version == run.step == saved["step"]  # the grant limit counts the updates done
    else:
        sched.sampler_after[run.step] = saved["sampler"]  # what post_generate kept when it drew the saved step
    again = run.trainer_state(learner, {**pool.state_dict(), **sched.state_dict()})
    assert list(again) == list(saved)
    assert again == ({**saved, "regrant": []} if mode == "fully_async" else saved)
