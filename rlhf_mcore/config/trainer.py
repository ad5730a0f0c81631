"""The `trainer` section (run layout, logging, checkpoints, plugins), and the asynchronous trainers' sections:
`async_training` (the mode and its streaming knobs) and `rollout` (the rollout pool's size)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from rlhf_mcore.config.checks import above, at_least, checked, unset_or

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
UNSET_OR_ONE = dict(ok=unset_or(at_least(1)), what="unset or >= 1")


def _trace_setting(value: Any) -> bool:
    """`trainer.trace`: a bool, or the path of a file (not empty, not a directory: the trace is one JSON file)."""
    if isinstance(value, bool):
        return True
    return isinstance(value, str) and value.strip() != "" and not value.endswith("/") and not Path(value).is_dir()


@dataclass
class TrainerConfig:
    project_name: str = "rlhf_mcore"
    experiment_name: str = "run"
    logger: list[str] = checked(factory=lambda: ["console"], ok=lambda names: all(n in LOGGERS for n in names),
                                what=f"a list of loggers from {', '.join(LOGGERS)}")
    # veRL's layout keys: when set, nnodes x n_gpus_per_node must equal the processes torchrun launched
    nnodes: Optional[int] = checked(None, **UNSET_OR_ONE)
    n_gpus_per_node: Optional[int] = checked(None, **UNSET_OR_ONE)
    device: Literal["auto", "cuda", "cpu"] = "auto"
    total_epochs: int = checked(1, ok=at_least(1), what=">= 1")
    total_training_steps: Optional[int] = checked(None, **UNSET_OR_ONE)
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    log_val_generations: int = 3
    default_local_dir: Optional[str] = None  # None: outputs/<project_name>/<experiment_name>
    # auto: the newest checkpoint under default_local_dir that passes its manifest check (each newer broken one is
    # reported and skipped) | disable: start from step 0 | <checkpoint path>: that one, which must pass the check
    resume_mode: str = "auto"
    # resuming a checkpoint saved with different algorithm settings (rlhf_mcore.trainer.checkpoint.ALGORITHM_KEYS:
    # algorithm.*, the actor's loss/KL keys, model paths, rollout.n, data.train_batch_size, ...) is refused with
    # the differing keys listed; true resumes anyway
    resume_ignore_config_changes: bool = False
    max_actor_ckpt_to_keep: Optional[int] = checked(2, **UNSET_OR_ONE)
    export_hf_final: bool = True  # the final actor as a Hugging Face directory in <default_local_dir>/hf_final
    # The rollout's log-probs against the actor's recomputed ones on the same weights (`rollout/k3_kl`, the mean
    # k3 KL): numerics only (2e-6 measured in bf16 on an H200 with a tiny model). A step above the limit means the
    # engines disagree about the policy (a broken weight sync, a kernel bug): it stops the run (error) or logs a
    # warning (warn). Not applied under top-k/top-p sampling, whose rollout log-probs are renormalised over the
    # kept tokens by design. None: no limit.
    max_rollout_logprob_gap: Optional[float] = checked(0.02, ok=unset_or(above(0)), what="unset (no limit) or > 0")
    rollout_logprob_gap_action: Literal["error", "warn"] = "error"
    # the run's timeline, every rank's phases as a Chrome-trace / Perfetto JSON (rlhf_mcore/trace.py; opens in
    # ui.perfetto.dev): true -> <default_local_dir>/trace.json, a path -> that file, false -> none
    trace: Union[bool, str] = checked(False, ok=_trace_setting,
                                      what="true (writes <default_local_dir>/trace.json), false (no trace) or the path "
                                           "of the JSON file to write (not a directory), e.g. "
                                           "trainer.trace=/runs/a/trace.json")
    seed: int = 1
    # the CUDA caching allocator's expandable segments in the training process (rlhf_mcore/parallel/allocator.py):
    # auto -> on with an in-process rollout engine (native, hf), unchanged with sglang (it opens CUDA IPC handles of
    # the trainer's tensors) or where PYTORCH_CUDA_ALLOC_CONF names expandable_segments; true / false -> on / off
    cuda_expandable_segments: Union[bool, str] = checked("auto", ok=lambda v: v in (True, False, "auto"),
                                                         what="auto, true or false")
    deterministic: bool = False  # torch.use_deterministic_algorithms (warn where an op has no deterministic kernel)
    # Python files (.py) or importable modules loaded on every rank before anything is built: the place to
    # register rewards, advantage estimators or policy losses (rlhf_mcore.rewards/.algos registries).
    plugins: list[str] = field(default_factory=list)


@dataclass
class RolloutPoolConfig:
    """veRL's `rollout.nnodes` x `rollout.n_gpus_per_node`: the processes of the rollout pool under
    async_training (the training pool is trainer.nnodes x trainer.n_gpus_per_node; torchrun launches both)."""

    nnodes: Optional[int] = checked(None, **UNSET_OR_ONE)
    n_gpus_per_node: Optional[int] = checked(None, **UNSET_OR_ONE)


@dataclass
class AsyncTrainingConfig:
    # off: the colocated synchronous trainer | one_step_off: the rollout pool generates step k+1 while the
    # training pool trains step k | fully_async: the rollout pool streams samples continuously
    mode: Literal["off", "one_step_off", "fully_async"] = "off"
    # fully_async: a training step takes require_batches mini-batches (actor.ppo_mini_batch_size prompts each)
    require_batches: int = 1
    # fully_async: the rollout pool receives the actor's weights after every this many training steps
    trigger_parameter_sync_step: int = 1
    # fully_async: the most policy versions a sample may lag the trainer (by its oldest token) to be trained on;
    # older ones are dropped and counted (veRL's key; there a fraction of extra samples, here a version count)
    staleness_threshold: int = 1
    # fully_async: at a weight sync, in-flight samples pause and continue under the new weights (true), or the
    # rollout finishes them under the old weights before it takes the new ones (false)
    partial_rollout: bool = True
    # one_step_off: the rollout pool takes the weights the trainer pushes after step k while it generates step
    # k+1 (a background receive into a second copy of the weights on the rollout devices, loaded once that
    # generation ends), so the push does not wait for the generation; false (default: the second copy costs memory,
    # and the two-pool NCCL path is unverified: README): received after the generation, with no extra memory
    prefetch_weights: bool = False
