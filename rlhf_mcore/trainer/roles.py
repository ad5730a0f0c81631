"""Building the trainer's parts from the config: data, engines, rollout, rewards; colocation and weight sync.

Everything config-shaped is translated here, so the loop in :mod:`rl_trainer` only speaks to components.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from rlhf_mcore.config import RLConfig
from rlhf_mcore.parallel import ParallelState
from rlhf_mcore.rollout import SamplingParams, build_rollout_engine


def _require_model_dir(path: str, key: str) -> Path:
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    if not p.exists() and not p.is_absolute() and len(p.parts) == 2 and not path.startswith("."):
        raise FileNotFoundError(
            f"{key}={path!r} is not a local directory; it looks like a Hugging Face Hub id, and rlhf_mcore reads "
            f"local model directories only: download it first (e.g. `huggingface-cli download {path} --local-dir "
            f"models/{p.name}`) and set {key}=models/{p.name}.")
    raise FileNotFoundError(
        f"{key}={path!r} is not a Hugging Face model directory (no config.json there). Point it at a local "
        f"directory with config.json, *.safetensors and the tokenizer (a tiny one for trying things out: "
        f"`python launch/make_tiny_model.py --out models/tiny`).")


def run_dir(cfg: RLConfig) -> Path:
    """`trainer.default_local_dir` (default `outputs/<project_name>/<experiment_name>`), created and writable,
    or a ConfigError before anything is built."""
    from rlhf_mcore.config import ConfigError

    t = cfg.trainer
    out = Path(t.default_local_dir or f"outputs/{t.project_name}/{t.experiment_name}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test_{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"trainer.default_local_dir={str(out)!r} cannot be used as the run directory ({e}): point "
                          f"it at a writable directory.") from None
    return out


def build_data(cfg: RLConfig):
    from rlhf_mcore.data import DataError, RLDataset
    from rlhf_mcore.models.tokenizer import load_tokenizer

    model_dir = _require_model_dir(cfg.actor_rollout_ref.model.path, "actor_rollout_ref.model.path")
    tok = load_tokenizer(model_dir, "actor_rollout_ref.model.path")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    d = cfg.data
    if not d.train_files:
        raise FileNotFoundError("data.train_files is empty: give parquet files in veRL's schema "
                                "(python launch/preprocess_data.py gsm8k --output-dir data/gsm8k).")
    truncation = "filter" if d.filter_overlong_prompts else d.truncation
    from rlhf_mcore.agents.rollout import tool_schemas

    tools = tool_schemas(cfg)  # multi-turn with tools: prompts list them, as the chat template writes them
    kw = {"chat_template_kwargs": {"tools": tools}} if tools else {}
    train = RLDataset(d.train_files, tok, d.max_prompt_length, truncation=truncation, on_bad_row=d.on_bad_row,
                      prompt_key=d.prompt_key, max_samples=d.max_train_samples, **kw)
    if len(train) < d.train_batch_size:
        raise DataError(f"data.train_batch_size={d.train_batch_size} exceeds the {len(train)} usable training "
                         f"rows in {d.train_files}: lower data.train_batch_size.")
    val = None
    if d.val_files:
        val = RLDataset(d.val_files, tok, d.max_prompt_length, truncation=truncation, on_bad_row=d.on_bad_row,
                        prompt_key=d.prompt_key, max_samples=d.max_val_samples, **kw)
    return tok, train, val


def build_agent_runner(cfg: RLConfig, rollout, tokenizer):
    """Multi-turn rollouts (`actor_rollout_ref.rollout.multi_turn.enable`): the agent runner; None when off."""
    from rlhf_mcore.agents.rollout import build_agent_runner as build

    return build(cfg, rollout, tokenizer)


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
    from rlhf_mcore.config import rollout_records_routes

    r = cfg.actor_rollout_ref.rollout
    max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    kwargs = {}
    if r.name == "native":
        kwargs = dict(max_num_seqs=r.max_num_seqs, max_model_len=max_len, device=state.device,
                      dtype=None if r.dtype == "auto" else r.dtype, cuda_graphs=None if not r.enforce_eager else False,
                      load_weights=False, weight_offload="drop" if r.sleep_level == 2 else "cpu",
                      quantization=r.quantization, kv_cache_dtype=r.kv_cache_dtype,
                      record_routes=rollout_records_routes(cfg), decode_steps_per_launch=r.decode_steps_per_launch)
        if r.tensor_model_parallel_size > 1:
            kwargs["tp_group"] = rollout_tp_group(state, r.tensor_model_parallel_size)
    elif r.name == "hf":
        kwargs = dict(device=state.device)
    elif r.name == "sglang":
        from rlhf_mcore.rollout.sglang_colocation import rollout_cpu_group

        tp = r.tensor_model_parallel_size
        kwargs = dict(tp_size=tp, gpu_memory_utilization=r.gpu_memory_utilization, max_model_len=max_len,
                      tp_group=rollout_cpu_group(state.world_size, state.rank, tp) if tp > 1 else None)
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


def train_sampling_params(cfg: RLConfig, seed: int) -> SamplingParams:
    r = cfg.actor_rollout_ref.rollout
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=cfg.data.max_response_length, seed=seed)


def val_sampling_params(cfg: RLConfig) -> SamplingParams:
    """`rollout.val_kwargs`: greedy by default, sampled with its own n/temperature/top-p/top-k when do_sample."""
    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    if vk.do_sample:
        return SamplingParams(n=vk.n, temperature=vk.temperature, top_p=vk.top_p, top_k=vk.top_k,
                              max_new_tokens=cfg.data.max_response_length, seed=cfg.trainer.seed)
    return SamplingParams.for_validation(cfg.data.max_response_length)


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
def colocated_rollout(rollout, engines: Sequence, *, free_cache: bool, sync_at_wake: Optional[Callable[[], dict]]):
    """Wake `rollout` for generation and put it back to sleep after (when `free_cache`; at level 2 when it
    syncs at wake, else 1). Meanwhile each training engine in `engines` (None entries skipped) moves to the host
    what its config asks for (:func:`offload_plan`) and nothing else: offloading is opt-in, as in veRL, because
    for a model that leaves most of the GPU free, copying its optimizer state out and back costs more than it
    saves.

    `sync_at_wake` (sleep level 2, where the rollout's weights were dropped): called after the offload and the
    wake, so the actor's optimizer state has left the GPU by then. Yields its metrics ({} without it)."""
    offloaded = []
    for e in engines:
        plan = offload_plan(e) if e is not None else {}
        if any(plan.values()):
            e.offload(**plan)
            offloaded.append(e)
    rollout.wake()
    try:
        yield sync_at_wake() if sync_at_wake is not None else {}
    finally:
        if free_cache:
            rollout.sleep(2 if sync_at_wake is not None else 1)
        for e in offloaded:
            e.onload()
        if offloaded and torch.cuda.is_initialized():
            torch.cuda.synchronize()


def sync_weights(actor, rollout, state: ParallelState, rollout_cfg) -> dict[str, float]:
    """Actor -> rollout: the actor's weights as full HF-named tensors, streamed in buckets, resharded to the
    rollout's layout. Returns the sync's metrics (`sync/*`).

    A LoRA actor sends its merged weights (`W + (alpha / r) B @ A`, formed per tensor by the export), unless
    `rollout.lora_sync=adapter_only`: then, once the native engine holds a full copy (after the first sync), only
    the adapters cross (:func:`rlhf_mcore.sync.lora.sync_adapters_to_rollout`; config/cross.py refuses it where the
    engine does not keep its weights between syncs)."""
    from rlhf_mcore.sync import sync_actor_to_rollout

    if _adapter_only_sync(actor, rollout, rollout_cfg):
        from rlhf_mcore.sync.lora import sync_adapters_to_rollout

        return sync_adapters_to_rollout(actor, rollout, state, actor.lora_base_weights,
                                        bucket_mb=rollout_cfg.sync_bucket_mb)
    metrics = sync_actor_to_rollout(actor.export_hf_weights(), rollout, state,
                                    bucket_mb=rollout_cfg.sync_bucket_mb, verify=rollout_cfg.sync_verify)
    if getattr(actor, "lora", None) is not None:
        actor.lora_full_sync_of = id(rollout)  # this engine now holds every weight
    return metrics


def _adapter_only_sync(actor, rollout, rollout_cfg) -> bool:
    if getattr(actor, "lora", None) is None or rollout_cfg.lora_sync != "adapter_only" or \
            getattr(actor, "lora_full_sync_of", None) != id(rollout):
        return False
    if getattr(actor, "lora_base_weights", None) is None:
        from rlhf_mcore.models.lora import adapter_tensors
        from rlhf_mcore.sync.lora import BaseWeights, base_name

        names = {base_name(n) for n in adapter_tensors(actor.chunks, actor.state) if ".lora_A." in n}
        actor.lora_base_weights = BaseWeights(actor.hf_dir, names)
    return True


# --- training engines: filled in against rlhf_mcore.engine ------------------------------------------------
def build_actor(cfg: RLConfig, state: ParallelState, total_steps: int):
    from rlhf_mcore.engine import build_engine

    return build_engine(cfg, state, role="actor", total_steps=total_steps)


def build_reference(cfg: RLConfig, state: ParallelState, actor=None):
    """The reference policy: its own frozen model, or -- with LoRA on the actor -- the actor with its adapters
    switched off (:class:`AdapterFreeReference`; no second model is built)."""
    from rlhf_mcore.config import lora_enabled
    from rlhf_mcore.engine import build_engine

    if lora_enabled(cfg):
        if actor is None:
            raise ValueError("with LoRA the reference is the actor's base: pass the actor to build_reference")
        return AdapterFreeReference(actor)
    return build_engine(cfg, state, role="ref", total_steps=0)


class AdapterFreeReference:
    """The reference policy of a LoRA run: the actor's frozen base, i.e. the actor's forward with every adapter
    off. `compute_log_probs` is the actor's (same temperature, micro-batching and kernels) without entropy."""

    def __init__(self, actor):
        self.actor = actor

    def compute_log_probs(self, batch: dict, with_entropy: bool = False):
        """Under router_replay R3 the actor replays the rollout's routes here too, as a reference engine would."""
        from rlhf_mcore.models.lora import adapters_disabled

        with adapters_disabled(self.actor.chunks):
            return self.actor.compute_log_probs(batch, with_entropy=with_entropy)


def build_critic(cfg: RLConfig, state: ParallelState, total_steps: int):
    from rlhf_mcore.engine import build_engine

    return build_engine(cfg, state, role="critic", total_steps=total_steps)


def build_reward_model(cfg: RLConfig, state: ParallelState, policy_tokenizer):
    """The learned reward's scorer, or None: a discriminative reward model (`reward_model.enable`) or a judge
    (`reward.judge.enable`; the config refuses both at once). Either has `score_rows(rows, items) -> metrics`."""
    if cfg.reward.judge.enable:
        return build_judge(cfg, state, policy_tokenizer)
    if not cfg.reward.reward_model.enable or cfg.reward.reward_model.reward_manager == "prime":
        return None  # PRIME's implicit PRM: build_prime
    return build_rm_scorer(cfg, state, policy_tokenizer)


def build_rm_scorer(cfg: RLConfig, state: ParallelState, policy_tokenizer):
    """The discriminative reward model's scorer for `cfg.reward.reward_model` (enabled), on the actor's process
    layout (:class:`rlhf_mcore.rewards.reward_model.RewardModelScorer`)."""
    from transformers import AutoTokenizer

    from rlhf_mcore.config import pipeline_split
    from rlhf_mcore.engine.config import EngineConfig
    from rlhf_mcore.engine.reward_engine import RewardEngine
    from rlhf_mcore.models import build_model
    from rlhf_mcore.rewards.reward_model import (
        RewardModelError,
        RewardModelScorer,
        check_reward_model_dir,
        streaming_blocker,
    )

    rm = cfg.reward.reward_model
    check_reward_model_dir(rm.model.path)
    rm_tok = AutoTokenizer.from_pretrained(rm.model.path)
    input_tok = None
    if rm.model.input_tokenizer:
        src = Path(rm.model.input_tokenizer)
        if not src.is_dir():
            raise RewardModelError(f"reward_model.model.input_tokenizer={rm.model.input_tokenizer!r} is not a "
                                   "directory: give the policy's tokenizer (usually actor_rollout_ref.model.path).")
        input_tok = AutoTokenizer.from_pretrained(src)
        if rm_tok.chat_template is None:
            raise RewardModelError(f"the reward model's tokenizer in {rm.model.path} has no chat template, so "
                                   "conversations cannot be re-templated for it: add one to its tokenizer_config.json")
    elif rm_tok.get_vocab() != policy_tokenizer.get_vocab():
        raise RewardModelError(
            f"the reward model's tokenizer ({rm.model.path}) differs from the policy's "
            f"({cfg.actor_rollout_ref.model.path}), so it cannot read the policy's token ids: set "
            f"reward_model.model.input_tokenizer={cfg.actor_rollout_ref.model.path} to re-template each "
            f"conversation for the reward model.")
    if rm_tok.pad_token_id is None:
        rm_tok.pad_token = rm_tok.eos_token
    dtype = None if rm.model.dtype == "auto" else getattr(torch, rm.model.dtype)
    chunks = build_model(rm.model.path, state, role="reward", dtype=dtype,
                         config_overrides=pipeline_split(cfg) or None)  # the actor's stage split, as ref and critic
    micro = rm.micro_batch_size_per_gpu or 1
    ecfg = EngineConfig(role="reward", micro_batch_size=micro, use_remove_padding=rm.model.use_remove_padding,
                        seed=rm.megatron.seed, cuda_graphs=rm.megatron.cuda_graphs)
    engine = RewardEngine(chunks, state, ecfg, None, hf_dir=rm.model.path, param_offload=rm.megatron.param_offload)
    blocker = streaming_blocker(state, cfg.actor_rollout_ref.rollout.tensor_model_parallel_size,
                                bool(rm.megatron.param_offload))
    return RewardModelScorer(engine, state, rm, rm_tok, input_tok, streaming_blocker=blocker)


def build_judge(cfg: RLConfig, state: ParallelState, policy_tokenizer):
    """The judge of `cfg.reward.judge` (enabled): a native engine on this rank's device
    (:class:`rlhf_mcore.rewards.judge.JudgeScorer`)."""
    from transformers import AutoTokenizer

    from rlhf_mcore.rewards.judge import JudgeScorer
    from rlhf_mcore.rewards.reward_model import RewardModelError

    j = cfg.reward.judge
    if not j.model_path or not (Path(j.model_path) / "config.json").is_file():
        raise RewardModelError(f"reward.judge.model_path={j.model_path!r} is not a Hugging Face model directory "
                               "(no config.json there): point it at the judge's causal LM directory.")
    tok = AutoTokenizer.from_pretrained(j.model_path)
    if tok.chat_template is None:
        raise RewardModelError(f"the judge's tokenizer in {j.model_path} has no chat template; add one")
    engine = build_rollout_engine("native", j.model_path, max_num_seqs=j.max_num_seqs, device=state.device,
                                  max_model_len=j.max_model_len)
    return JudgeScorer(engine, tok, policy_tokenizer, j, state)


def build_prime(cfg: RLConfig, state: ParallelState, total_steps: int):
    """PRIME's implicit process reward model (`reward_model.reward_manager=prime`), or None."""
    from rlhf_mcore.trainer.prime import build_prime as build

    return build(cfg, state, total_steps)
