"""Building the trainer's parts from the config: data, engines, rollout, rewards; colocation and weight sync.

Everything config-shaped is translated here, so the loop in :mod:`rl_trainer` only speaks to components.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from rlhf_mcore.config import RLConfig
from rlhf_mcore.parallel import ParallelState
from rlhf_mcore.rollout import SamplingParams, build_rollout_engine


def _require_model_dir(path: str, key: str) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"{key}={path!r} is not a Hugging Face model directory (no config.json there). Point it at a local "
            f"directory with config.json, *.safetensors and the tokenizer, e.g. one made by "
            f"`python launch/make_tiny_model.py --out {path}`.")
    return p


def build_data(cfg: RLConfig):
    from transformers import AutoTokenizer

    from rlhf_mcore.data import DataError, RLDataset

    model_dir = _require_model_dir(cfg.actor_rollout_ref.model.path, "actor_rollout_ref.model.path")
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    d = cfg.data
    if not d.train_files:
        raise FileNotFoundError("data.train_files is empty: give parquet files in veRL's schema "
                                "(python launch/preprocess_data.py gsm8k --output-dir data/gsm8k).")
    truncation = "filter" if d.filter_overlong_prompts else d.truncation
    train = RLDataset(d.train_files, tok, d.max_prompt_length, truncation=truncation, on_bad_row=d.on_bad_row,
                      prompt_key=d.prompt_key, max_samples=d.max_train_samples)
    if len(train) < d.train_batch_size:
        raise DataError(f"data.train_batch_size={d.train_batch_size} exceeds the {len(train)} usable training "
                         f"rows in {d.train_files}: lower data.train_batch_size.")
    val = None
    if d.val_files:
        val = RLDataset(d.val_files, tok, d.max_prompt_length, truncation=truncation, on_bad_row=d.on_bad_row,
                        prompt_key=d.prompt_key, max_samples=d.max_val_samples)
    return tok, train, val


def build_sampler(cfg: RLConfig, n: int):
    from rlhf_mcore.data import ResumableSampler

    return ResumableSampler(n, shuffle=cfg.data.shuffle, seed=cfg.data.seed)


def build_scorer(cfg: RLConfig):
    from rlhf_mcore.rewards import RewardScorer, load_custom_reward_fn

    crf = cfg.reward.custom_reward_function
    fn = load_custom_reward_fn(crf.path, crf.name) if crf.path else None
    return RewardScorer(fn, num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s,
                        max_failure_ratio=cfg.reward.max_failure_ratio)


def build_rollout(cfg: RLConfig, state: ParallelState):
    r = cfg.actor_rollout_ref.rollout
    max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    kwargs = {}
    if r.name == "native":
        kwargs = dict(max_num_seqs=r.max_num_seqs, max_model_len=max_len, device=state.device,
                      dtype=None if r.dtype == "auto" else r.dtype, cuda_graphs=None if not r.enforce_eager else False,
                      load_weights=False, weight_offload="drop" if r.sleep_level == 2 else "cpu")
        if r.tensor_model_parallel_size > 1:
            kwargs["tp_group"] = rollout_tp_group(state, r.tensor_model_parallel_size)
    elif r.name == "hf":
        kwargs = dict(device=state.device)
    elif r.name == "sglang":
        kwargs = dict(tp_size=r.tensor_model_parallel_size, mem_fraction_static=r.gpu_memory_utilization)
    return build_rollout_engine(r.name, cfg.actor_rollout_ref.model.path, **kwargs)


_ROLLOUT_GROUPS: dict[int, object] = {}


def rollout_tp_group(state: ParallelState, size: int):
    """Groups of ``size`` consecutive ranks (every rank must create every group, in order)."""
    import torch.distributed as dist

    if size not in _ROLLOUT_GROUPS:
        mine = None
        for start in range(0, state.world_size, size):
            g = dist.new_group(list(range(start, start + size)))
            if start <= state.rank < start + size:
                mine = g
        _ROLLOUT_GROUPS[size] = mine
    return _ROLLOUT_GROUPS[size]


def train_sampling_params(cfg: RLConfig, engine, seed: int) -> SamplingParams:
    r = cfg.actor_rollout_ref.rollout
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=cfg.data.max_response_length, seed=seed)


def offload_plan(engine) -> dict[str, bool]:
    """What `engine` moves to the host while the rollout generates: its role's `megatron.param_offload`,
    `grad_offload` and `optimizer_offload` flags (veRL's keys; all off unless the config sets them)."""
    return {"params": bool(getattr(engine, "param_offload", False)),
            "grads": bool(getattr(engine, "grad_offload", False)),
            "optimizer": bool(getattr(engine, "optimizer_offload", False))}


def syncs_at_wake(cfg: RLConfig) -> bool:
    """Whether the rollout drops its weights when it sleeps (`rollout.sleep_level=2`): the actor's weights are
    then sent at every wake instead of after every update."""
    r = cfg.actor_rollout_ref.rollout
    return r.free_cache_engine and r.sleep_level == 2


@contextmanager
def colocated_rollout(trainer):
    """Wake the rollout engine for generation and put it back to sleep after (at `rollout.sleep_level` when
    `rollout.free_cache_engine`). Meanwhile each training engine (actor, critic, reference) moves to the host
    what its config asks for (:func:`offload_plan`) and nothing else: offloading is opt-in, as in veRL. A small
    model leaves most of the GPU free, and copying its optimizer state out and back cost more than anything it
    saved (2.9 s of a 9.5 s GRPO step at 0.5B on an H200, 7-19 GiB used of 140); the 7B 8-GPU config turns it on.

    At sleep level 2 the rollout's weights were dropped, so they are synced here, after the offload and the wake
    (the actor's optimizer state has left the GPU by then): the sync's metrics go to `trainer.wake_sync_metrics`."""
    on_gpu = trainer.state.device.type == "cuda"
    offloaded = []
    for e in (trainer.actor, trainer.critic, trainer.ref):
        plan = offload_plan(e) if e is not None else {}
        if any(plan.values()):
            e.offload(**plan)
            offloaded.append(e)
    trainer.rollout.wake()
    level2 = syncs_at_wake(trainer.cfg)
    try:
        if level2:
            trainer.wake_sync_metrics = _sync_actor(trainer)
        yield
    finally:
        if trainer.cfg.actor_rollout_ref.rollout.free_cache_engine:
            trainer.rollout.sleep(2 if level2 else 1)
        for e in offloaded:
            e.onload()
        if on_gpu and offloaded:
            torch.cuda.synchronize()


def sync_weights(trainer) -> dict[str, float]:
    """Actor -> rollout after an update; at sleep level 2 nothing here (the next wake syncs)."""
    if syncs_at_wake(trainer.cfg):
        return {}
    return _sync_actor(trainer)


def _sync_actor(trainer) -> dict[str, float]:
    from rlhf_mcore.sync import sync_actor_to_rollout

    r = trainer.cfg.actor_rollout_ref.rollout
    return sync_actor_to_rollout(trainer.actor.export_hf_weights(), trainer.rollout, trainer.state,
                                 bucket_mb=r.sync_bucket_mb, verify=r.sync_verify)


# --- training engines: filled in against rlhf_mcore.engine ------------------------------------------------
def build_actor(cfg: RLConfig, state: ParallelState, total_steps: int):
    from rlhf_mcore.engine import build_engine

    return build_engine(cfg, state, role="actor", total_steps=total_steps)


def build_reference(cfg: RLConfig, state: ParallelState):
    from rlhf_mcore.engine import build_engine

    return build_engine(cfg, state, role="ref", total_steps=0)


def build_critic(cfg: RLConfig, state: ParallelState, total_steps: int):
    from rlhf_mcore.engine import build_engine

    return build_engine(cfg, state, role="critic", total_steps=total_steps)
