"""The run context: what every mode's loop shares -- the config, the parallel state, the run lock, the data and
its sampler, the rule scorer, the logger, the checkpoints and the hooks -- with the end of a step
(:meth:`RunContext.finish_step`: metrics, validation, checkpoint) and of the run (:meth:`RunContext.close`)."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from rlhf_mcore import trace
from rlhf_mcore.config import RLConfig, expert_parallel_size, load_plugins, parallel_layout, to_dict
from rlhf_mcore.parallel import destroy_distributed, init_distributed
from rlhf_mcore.parallel.allocator import expandable_segments_for
from rlhf_mcore.parallel.collectives import broadcast_object
from rlhf_mcore.startup import gc_time_since_last, resume_gc
from rlhf_mcore.trainer import roles
from rlhf_mcore.trainer.checkpoint import CheckpointManager
from rlhf_mcore.trainer.errors import RolloutMismatchError
from rlhf_mcore.trainer.hooks import PhaseTimer, StepHooks
from rlhf_mcore.trainer.logging import MetricLogger, middle_cut, reduce_metrics
from rlhf_mcore.trainer.plan import plan_step
from rlhf_mcore.trainer.run_lock import take_run_lock
from rlhf_mcore.trainer.stats import batch_metrics, peak_memory_gb, reset_peak_memory


class RunContext:
    def __init__(self, cfg: RLConfig, state, *, tokenizer, train_set, val_set, scorer, run_lock, out_dir: Path,
                 hooks: Optional[StepHooks] = None):
        """The parts as built (:meth:`open` builds them from the config; tests pass their own). The sampler, the
        step count and the checkpoint manager follow from them."""
        self.cfg, self.state, self.hooks = cfg, state, hooks or StepHooks()
        self.tokenizer, self.train_set, self.val_set, self.scorer = tokenizer, train_set, val_set, scorer
        self.run_lock, self.out_dir = run_lock, out_dir
        self.sampler = roles.build_sampler(cfg, len(train_set))
        steps_per_epoch = len(train_set) // cfg.data.train_batch_size
        self.total_steps = cfg.trainer.total_training_steps or steps_per_epoch * cfg.trainer.total_epochs
        self.ckpt = CheckpointManager(out_dir / "checkpoints", cfg.trainer.max_actor_ckpt_to_keep, state.rank,
                                      group=state.cpu_group)
        self.step = 0
        self.logger: Optional[MetricLogger] = None
        self.trace_file: Optional[Path] = None  # rank 0, once closed with trainer.trace on

    @classmethod
    def open(cls, cfg: RLConfig, hooks: Optional[StepHooks] = None) -> "RunContext":
        """The data and the rule scorer (bad inputs fail before any compute), the process groups, then the run
        lock (one live run per directory, taken before any model is built)."""
        load_plugins(cfg.trainer.plugins)
        out_dir = roles.run_dir(cfg)
        tokenizer, train_set, val_set = roles.build_data(cfg)
        scorer = roles.build_scorer(cfg)  # a broken reward file too
        tp, pp, vpp = parallel_layout(cfg)
        if cfg.trainer.deterministic:  # warn_only: an op without a deterministic kernel warns instead of failing
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: set it first
            torch.use_deterministic_algorithms(True, warn_only=True)
        state = init_distributed(tp, pp, vpp, device=cfg.trainer.device, seed=cfg.trainer.seed,
                                 ep=expert_parallel_size(cfg), expandable_segments=expandable_segments_for(cfg))
        run_lock = take_run_lock(out_dir, state)
        d = state.dims
        role = "train" if cfg.async_training.mode != "off" else "train + rollout"
        trace.open_trace(trace.trace_path(cfg.trainer.trace, out_dir), int(os.environ.get("RANK", state.rank)),
                         f"{role} · dp {state.dp_rank}/{d.dp} tp {state.tp_rank} pp {state.pp_rank}",
                         int(os.environ.get("WORLD_SIZE", "1")))
        try:
            return cls(cfg, state, tokenizer=tokenizer, train_set=train_set, val_set=val_set, scorer=scorer,
                       run_lock=run_lock, out_dir=out_dir, hooks=hooks)
        except BaseException:
            run_lock.release()
            raise

    @contextmanager
    def building(self):
        """Around building the models: one that fails (e.g. to load) releases the run lock, so the next run does
        not find this run's lock. Start-up ends here: the garbage collector paused by the entry point resumes."""
        try:
            yield
        except BaseException:
            self.run_lock.release()
            raise
        resume_gc()

    def open_logger(self) -> None:
        self.logger = MetricLogger(self.cfg.trainer.logger, self.out_dir, self.total_steps, to_dict(self.cfg),
                                   self.cfg.trainer.project_name, self.cfg.trainer.experiment_name,
                                   enabled=self.state.is_coordinator, start_step=self.step)

    # ------------------------------------------------------------------------------------------- prompts
    def draw(self, n: int) -> list[int]:
        """Coordinator: the next `n` dataset indices."""
        return self.sampler.next_batch(n)

    def split_over_dp(self, ids: list[int]) -> list[list[int]]:
        return plan_step(ids, [len(self.train_set[i]["input_ids"]) for i in ids], self.state.dims.dp)

    def plan(self) -> list[list[int]]:
        """Rank 0 draws the batch and splits it over DP ranks; every rank gets the dataset indices per DP rank.
        With dynamic sampling (algorithm.filter_groups) one unsplit part of data.gen_batch_size prompts: the
        rollout splits the groups it keeps."""
        plan = None
        if self.state.is_coordinator:
            d = self.cfg.data
            if self.cfg.algorithm.filter_groups.enable:
                plan = [self.draw(d.gen_batch_size or d.train_batch_size)]
            else:
                plan = self.split_over_dp(self.draw(d.train_batch_size))
        return broadcast_object(plan, group=self.state.cpu_group)

    # ------------------------------------------------------------------------------------------- a step's end
    def finish_step(self, batch, step_metrics: dict[str, float], timer: PhaseTimer, *, kl_coef: float,
                    validate: Callable[[], dict[str, float]], save: Callable[[], Any],
                    gap_prefix: str = "rollout/", renormalised: bool = True) -> dict[str, float]:
        """The step's metrics reduced and logged, the rollout-gap limit checked (on `gap_prefix*` metrics), then
        validation (`validate`) and the checkpoint (`save`) when due. Returns the logged metrics."""
        metrics = step_record(batch, step_metrics, timer, kl_coef, dp=self.state.dims.dp)
        self.logger.log(self.step, metrics)
        self.check_rollout_gap({"rollout/" + k[len(gap_prefix):]: v for k, v in metrics.items()
                                if k.startswith(gap_prefix)}, renormalised)
        for role in ("actor", "critic"):
            if metrics.get(f"{role}/update_skipped", 0.0) > 0:
                self.logger.text(f"step {self.step}: {role} skipped an optimizer step (non-finite loss); "
                                 f"its weights are unchanged by it")
        cfg = self.cfg.trainer
        last_step = self.step == self.total_steps
        if cfg.test_freq > 0 and (self.step % cfg.test_freq == 0 or last_step):
            with trace.span("validation", step=self.step):
                metrics.update(validate())
        if cfg.save_freq > 0 and (self.step % cfg.save_freq == 0 or last_step):
            with trace.span("checkpoint", step=self.step):
                save()
        trace.flush()
        return metrics

    def check_rollout_gap(self, metrics: dict[str, float], renormalised: bool = True) -> None:
        check_rollout_gap(metrics, self.cfg, self.step, lambda text: self.logger.text(text), renormalised)

    def log_validation(self, metrics: dict[str, float], samples: list[dict]) -> None:
        """Coordinator: validation's metrics and its first samples."""
        self.logger.log(self.step, metrics, kind="val")
        for s in samples:  # the question whole (up to 400 characters: longer ones lose their middle)
            self.logger.text(f"[val sample] score={s['score']:.1f} | {middle_cut(s['prompt'])!r} -> "
                             f"{middle_cut(s['response'])!r}")

    # ------------------------------------------------------------------------------------------- checkpoints
    def trainer_state(self, learner, mode_state: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """The checkpoint's trainer state: `step`, `sampler`, the learner's (`kl_ctrl`), then the mode's."""
        return {"step": self.step, "sampler": self.sampler.state_dict(), **learner.state_dict(), **(mode_state or {})}

    def save_checkpoint(self, learner, mode_state: Optional[dict[str, Any]] = None) -> Path:
        return self.ckpt.save(self.step, self.trainer_state(learner, mode_state), learner.save_engines,
                              config=to_dict(self.cfg))

    def resume(self, learner) -> Optional[dict[str, Any]]:
        """The newest usable checkpoint loaded (engines, step, sampler, learner state); returns its whole trainer
        state for the mode's own keys, or None on a fresh start."""
        path = self.ckpt.resume_point(self.cfg.trainer.resume_mode, to_dict(self.cfg),
                                      self.cfg.trainer.resume_ignore_config_changes)  # verified, config checked
        if path is None:
            return None
        learner.load_engines(path)
        state = self.ckpt.load_trainer_state(path)
        self.load_trainer_state(state, learner)
        if self.state.is_coordinator:
            print(f"resumed from {path} at step {self.step}", flush=True)
        return state

    def load_trainer_state(self, state: dict[str, Any], learner) -> None:
        """The run's and the learner's keys of a checkpoint's trainer state (the mode's own: its loop)."""
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        learner.load_state_dict(state)

    def close(self) -> None:
        try:
            if self.logger is not None:
                self.logger.close()
            self.scorer.close()
            if dist.is_initialized():
                dist.barrier(group=self.state.cpu_group)
            destroy_distributed()
        finally:  # a failed barrier (another rank died) too
            self.run_lock.release()
            failing = sys.exc_info()[0] is not None  # then the other ranks' parts are not waited for
            self.trace_file = trace.close_trace(int(os.environ.get("WORLD_SIZE", "1")), wait_s=0 if failing else 60)


def check_rollout_gap(metrics: dict[str, float], cfg: RLConfig, step: int, warn: Callable[[str], None],
                      renormalised: bool = True) -> None:
    """`trainer.max_rollout_logprob_gap` on the reduced `rollout/k3_kl` (the same on every rank, so every rank
    stops together): RolloutMismatchError, or `warn(text)` with trainer.rollout_logprob_gap_action=warn.
    `renormalised`: whether the rollout's log-probs are those of the truncated distribution under top-k / top-p
    (then they differ from the trainer's by design, and nothing is checked)."""
    t, r = cfg.trainer, cfg.actor_rollout_ref.rollout
    gap = metrics.get("rollout/k3_kl")
    truncated = (r.top_k > 0 or r.top_p < 1) and renormalised
    if t.max_rollout_logprob_gap is None or gap is None or truncated or gap <= t.max_rollout_logprob_gap:
        return
    msg = (f"step {step}: the rollout's log-probs are {gap:.3g} (mean k3 KL; worst token "
           f"{metrics.get('rollout/k3_kl/max', float('nan')):.3g}, mean |diff| "
           f"{metrics.get('rollout/logprob_diff_abs', float('nan')):.3g}) from the actor's on the same weights, "
           f"over trainer.max_rollout_logprob_gap={t.max_rollout_logprob_gap}: the rollout engine and the trainer "
           f"disagree about the policy (weight sync, dtype or kernel). Raise the limit or set "
           f"trainer.rollout_logprob_gap_action=warn to continue.")
    if t.rollout_logprob_gap_action == "error":
        raise RolloutMismatchError(msg)
    warn("warning: " + msg)


def step_record(batch, step_metrics: dict[str, float], timer: PhaseTimer, kl_coef: float, dp: int) -> dict[str, float]:
    """A step's logged metrics: the batch's, the step's, the phase times, the peak memory (reset for the next
    step), the KL coefficient the next step uses and the job's throughput, reduced over all ranks."""
    local = {**batch_metrics(batch), **step_metrics, **{f"timing_s/{k}": v for k, v in timer.seconds.items()},
             "perf/max_memory_allocated_gb/max": peak_memory_gb(),  # this step's (reset below)
             "actor/kl_coef": float(kl_coef)}
    local["perf/gc_s/max"], local["perf/gc_full_collections/max"] = gc_time_since_last()  # the slowest rank's
    reset_peak_memory()
    tokens = float(batch["attention_mask"].sum())
    if "step" in timer.spans:  # the step's sizes on its trace span (recorded, not yet flushed)
        timer.spans["step"].args.update(sequences=int(batch["attention_mask"].shape[0]), tokens=int(tokens))
    local["perf/throughput"] = tokens / max(timer.seconds["step"], 1e-9)
    metrics = reduce_metrics(local, group=None)
    metrics["perf/throughput"] *= dp  # tokens/s of the whole job
    return metrics
