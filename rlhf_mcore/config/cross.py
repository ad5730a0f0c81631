"""Every rule that relates several keys, the world size, the model or a registry: the one module of the config
package that asks the registries (algos, rewards, models.pipeline_layout), each lazily inside the function that
needs it and through their torch-free parts (`rlhf_mcore.algos.names`, `rlhf_mcore.rewards.judge_template`), so
that loading and validating a config imports neither torch nor any component.

- :func:`check_relations` runs in ``load_config``, after the single-key rules (:mod:`.checks`): what a config
  says about itself (a reward model needs a path, PRIME needs RLOO, DAPO's sizes, off-policy correction's keys).
- :func:`validate_config` runs before a launch (or ``--print-config``): the world size and process layout, batch
  divisibility, the model's context and layers, the registered names.

A refusal that is about one key reads as :func:`.checks.value_error` does (``need``); one about several keys says
them all and the fix in one sentence (``require``).
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from rlhf_mcore.config.algorithm import FILTER_METRICS
from rlhf_mcore.config.checks import check_sections, value_at, value_error
from rlhf_mcore.config.errors import ConfigError
from rlhf_mcore.config.hf import model_architecture, model_is_moe, model_num_layers
from rlhf_mcore.config.plugins import load_plugins
from rlhf_mcore.config.trainer import AsyncTrainingConfig

if TYPE_CHECKING:
    from rlhf_mcore.config.schema import RLConfig


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _need(cfg: RLConfig):
    """`need(key, ok, what)`: refuse the value at `key` of `cfg` unless `ok`, in the single-key shape."""
    def need(key: str, ok: bool, what: str) -> None:
        if not ok:
            raise value_error(key, value_at(cfg, key), what)
    return need


# --------------------------------------------------------------------------------------------- roles


def critic_enabled(cfg: RLConfig) -> bool:
    """`critic.enable` when set, else whether the advantage estimator needs a critic (its registered facts)."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return estimator_needs(cfg).needs_critic


def estimator_needs(cfg: RLConfig):
    """What the configured advantage estimator needs (the registry's facts, read without torch)."""
    from rlhf_mcore.algos.names import adv_estimator_names, adv_estimator_needs

    name = cfg.algorithm.adv_estimator
    needs = adv_estimator_needs(name)
    if needs is None:
        names = adv_estimator_names()
        close = difflib.get_close_matches(name, names, n=1)
        raise ConfigError(f"algorithm.adv_estimator={name!r} is not registered; choose one of "
                          f"{', '.join(names)} or register your own with "
                          f"rlhf_mcore.algos.register_adv_estimator in a trainer.plugins file."
                          + (f" Did you mean '{close[0]}'?" if close else ""))
    return needs


def reference_enabled(cfg: RLConfig) -> bool:
    """A reference policy is only built when some KL term, or PRIME's implicit PRM, needs it."""
    return (cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss
            or prime_enabled(cfg))


def prime_enabled(cfg: RLConfig) -> bool:
    """PRIME's implicit process reward model (`reward_model.reward_manager=prime`, `reward_model.enable`)."""
    rm = cfg.reward.reward_model
    return rm.enable and rm.reward_manager == "prime"


# --------------------------------------------------------------------------------------------- at load


def check_relations(cfg: RLConfig) -> None:
    """The rules between keys of one config, before anything is built; fails on the first problem."""
    need, r = _need(cfg), "actor_rollout_ref.rollout"
    _check_rollout_correction(cfg, need)
    _check_reward_model(cfg, need)
    for k, data_key in (("prompt_length", "max_prompt_length"), ("response_length", "max_response_length")):
        v = value_at(cfg, f"{r}.{k}")
        need(f"{r}.{k}", v is None or v == value_at(cfg, f"data.{data_key}"),
             f"unset or equal to data.{data_key} ({value_at(cfg, f'data.{data_key}')}), which sets it")
    name = cfg.actor_rollout_ref.rollout.name
    need(f"{r}.decode_steps_per_launch", value_at(cfg, f"{r}.decode_steps_per_launch") is None or name == "native",
         f"unset with rollout.name={name}: several decode steps a launch are the native engine's (set "
         "actor_rollout_ref.rollout.name=native)")
    need("trainer.cuda_expandable_segments", cfg.trainer.cuda_expandable_segments is not True
         or cfg.trainer.device != "cpu",
         "auto or false with trainer.device=cpu: expandable segments are the CUDA allocator's (set trainer.device=auto "
         "or cuda)")
    _check_dapo(cfg, need)
    _check_multi_turn(cfg, need)
    _check_fp8(cfg, need)
    _check_grad_accum_fusion(cfg, need)
    _check_lora(cfg, need)
    _check_router_replay(cfg, need)
    _check_shared_prefix(cfg, need)


def _check_shared_prefix(cfg: RLConfig, need) -> None:
    """`model.share_prompt_prefix` (the actor's and reference's; the critic's) runs in the engine's packed layout
    only (rlhf_mcore.engine.shared_prefix)."""
    arr = cfg.actor_rollout_ref
    m = arr.actor.megatron
    layout = ("pipeline parallelism (its stages exchange micro-batches of one shape)"
              if (m.pipeline_model_parallel_size or 1) > 1 or m.virtual_pipeline_model_parallel_size else
              "context parallelism" if m.context_parallel_size > 1 else None)
    if arr.model.share_prompt_prefix:
        why = ("padded sequences (model.use_remove_padding=false): it packs" if not arr.model.use_remove_padding
               else layout or
               ("actor.megatron.cuda_graphs=true (each micro-batch has its own layout)" if m.cuda_graphs is True else
                "ref.megatron.cuda_graphs=true (each micro-batch has its own layout)"
                if arr.ref.megatron.cuda_graphs is True else
                f"actor.router_replay.mode={arr.actor.router_replay.mode}"
                if arr.actor.router_replay.mode != "disabled" else None))
        need("actor_rollout_ref.model.share_prompt_prefix", why is None, f"false with {why}")
    c = cfg.critic
    if c.model.share_prompt_prefix and critic_enabled(cfg):
        why = ("padded sequences (critic.model.use_remove_padding=false): it packs" if not c.model.use_remove_padding
               else layout or ("critic.megatron.cuda_graphs=true (each micro-batch has its own layout)"
                               if c.megatron.cuda_graphs is True else None))
        need("critic.model.share_prompt_prefix", why is None, f"false with {why}")


def rollout_records_routes(cfg: RLConfig) -> bool:
    """Whether the rollout records each token's experts (`rollout.enable_rollout_routing_replay`; unset: exactly
    when `actor.router_replay.mode=R3`, which replays them)."""
    on = cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay
    return cfg.actor_rollout_ref.actor.router_replay.mode == "R3" if on is None else on


def _check_router_replay(cfg: RLConfig, need) -> None:
    """Routing replay where it cannot apply is refused (the model's experts are checked in validate_config)."""
    arr = cfg.actor_rollout_ref
    mode, key = arr.actor.router_replay.mode, "actor_rollout_ref.actor.router_replay.mode"
    records, rk = rollout_records_routes(cfg), "actor_rollout_ref.rollout.enable_rollout_routing_replay"
    if mode == "R3":
        need(rk, records, "unset or true with router_replay.mode=R3: R3 replays the routes the rollout records")
    if records:  # named by the key that asked for it: the explicit one, else the mode (R3)
        asked, fix = (rk, "unset or false") if arr.rollout.enable_rollout_routing_replay else (key, "R2 or disabled")
        need(asked, arr.rollout.name == "native",
             f"{fix} with rollout.name={arr.rollout.name}: only the native engine records each token's experts "
             "(set actor_rollout_ref.rollout.name=native)")
        need(asked, not arr.rollout.multi_turn.enable,
             f"{fix} with rollout.multi_turn.enable=true: a trajectory's routes are not assembled across its turns "
             "(the engine reuses a session's cached tokens without routing them again)")
    if mode == "disabled":
        return
    need(key, not (mode == "R2" and arr.actor.use_rollout_log_probs),
         "R3 or disabled with actor.use_rollout_log_probs=true: R2 records the routes of the old-log-prob pass, "
         "which that setting skips")
    need(key, recompute_mode(arr.model, arr.actor.megatron) != "full",
         f"disabled with model.enable_gradient_checkpointing=true (or megatron.override_transformer_config."
         f"recompute_granularity=full): the recomputation in the backward pass would route again without the "
         f"replayed routes (mode={mode} needs whole-layer recompute off)")
    need(key, not arr.actor.megatron.sequence_parallel,
         "disabled with actor.megatron.sequence_parallel=true: the replayed routes are not split over the "
         "tensor-parallel ranks' sequence shards")
    need(key, arr.actor.megatron.cuda_graphs is not True,
         "disabled with actor.megatron.cuda_graphs=true: a captured decoder would keep the first micro-batch's "
         "routes")


def _check_vision(cfg: RLConfig) -> None:
    """A vision-language model (LLaVA) as a text trainer's policy: refused until the VLA trainer feeds it images."""
    for key in ("actor_rollout_ref.model.path", "critic.model.path"):
        path = value_at(cfg, key)
        arch = model_architecture(path) if path else None
        require(arch != "LlavaForConditionalGeneration",
                f"{key}={path} is a {arch} (a vision-language policy): this trainer feeds it no images and its rollout "
                "engines run text models. Train it with the VLA trainer (vla.enable=true, e.g. "
                "configs/vla_reachpush_cpu.yaml), or point this trainer at a text model.")


def _check_grad_accum_fusion(cfg: RLConfig, need) -> None:
    """`override_transformer_config.gradient_accumulation_fusion` (rlhf_mcore.models.grad_accum_fusion) accumulates
    the weight gradients into the trained parameters' main_grad: a role that trains them, eager (bf16/fp32 linears
    through cuBLAS, FP8 ones through kernels.fp8_wgrad)."""
    arr = cfg.actor_rollout_ref
    roles = [("actor_rollout_ref.actor.megatron", arr.actor.megatron, "actor_rollout_ref.model"),
             ("critic.megatron", cfg.critic.megatron, "critic.model"),
             ("actor_rollout_ref.ref.megatron", arr.ref.megatron, None),
             ("reward.reward_model.megatron", cfg.reward.reward_model.megatron, None)]
    for key, megatron, model in roles:
        if not megatron.override_transformer_config.gradient_accumulation_fusion:
            continue
        k = f"{key}.override_transformer_config.gradient_accumulation_fusion"
        need(k, model is not None, "false: this model runs no backward pass (only the actor and the critic train)")
        need(k, value_at(cfg, f"{model}.lora_rank") == 0,
             f"false with {model}.lora_rank > 0: the frozen base weights have no main_grad to accumulate into")
        need(k, megatron.cuda_graphs is not True,
             f"false with {key}.cuda_graphs=true: the captured decoder's layers see parameter aliases without "
             "main_grad (leave cuda_graphs unset: off with the fusion)")


def _check_fp8(cfg: RLConfig, need) -> None:
    """FP8 rollout and FP8 training need a CUDA GPU and the code paths that implement them (the GPU generation
    and the shapes are checked where the weights are: rlhf_mcore.kernels.fp8)."""
    r, on_cpu = cfg.actor_rollout_ref.rollout, cfg.trainer.device == "cpu"
    if r.quantization is not None:
        k = "actor_rollout_ref.rollout.quantization"
        need(k, r.name == "native", f"null with rollout.name={r.name}: FP8 rollout is built in the native engine "
                                    "(set actor_rollout_ref.rollout.name=native)")
        need(k, not on_cpu, "null with trainer.device=cpu: FP8 GEMMs need a CUDA GPU with FP8 tensor cores (sm >= 89)")
    if r.kv_cache_dtype != "auto":
        k = "actor_rollout_ref.rollout.kv_cache_dtype"
        need(k, r.name == "native", f"auto with rollout.name={r.name}: the FP8 KV cache is built in the native engine "
                                    "(set actor_rollout_ref.rollout.name=native)")
        need(k, not on_cpu, "auto with trainer.device=cpu: the FP8 KV cache needs a CUDA GPU with FP8 (sm >= 89)")
    roles = [("actor_rollout_ref.actor.megatron", cfg.actor_rollout_ref.actor.megatron, True),
             ("critic.megatron", cfg.critic.megatron, True),
             ("actor_rollout_ref.ref.megatron", cfg.actor_rollout_ref.ref.megatron, False),
             ("reward.reward_model.megatron", cfg.reward.reward_model.megatron, False)]
    for key, megatron, trained in roles:
        if megatron.fp8 is None:
            need(f"{key}.fp8_recipe", megatron.fp8_recipe == "rowwise",
                 f"rowwise (the default) while {key}.fp8 is null: the recipe only applies to FP8 GEMMs (set fp8 too)")
            need(f"{key}.fp8_weight_cache", not megatron.fp8_weight_cache,
                 f"false (the default) while {key}.fp8 is null: it keeps FP8 weight codes (set fp8 too)")
            need(f"{key}.fp8_amax_history_len", megatron.fp8_amax_history_len == 16,
                 f"16 (the default) while {key}.fp8 is null: it is the delayed FP8 recipe's (set fp8 and "
                 "fp8_recipe=delayed too)")
            continue
        need(f"{key}.fp8_amax_history_len", megatron.fp8_amax_history_len == 16 or megatron.fp8_recipe == "delayed",
             f"16 (the default) with fp8_recipe={megatron.fp8_recipe}: only the delayed recipe keeps an amax history "
             f"(set {key}.fp8_recipe=delayed, or drop the key)")
        need(f"{key}.fp8_weight_cache", not megatron.fp8_weight_cache or megatron.fp8_recipe != "rowwise",
             f"false with fp8_recipe={megatron.fp8_recipe}: only the per-tensor recipes keep their weights' codes (set "
             f"{key}.fp8_recipe=tensorwise or delayed)")
        need(f"{key}.fp8", trained, "null: FP8 GEMMs are built for the trained models (actor, critic); the "
                                    "reference and reward model score in their dtype")
        need(f"{key}.fp8", not on_cpu, "null with trainer.device=cpu: FP8 GEMMs need a CUDA GPU (sm >= 89)")
        need(f"{key}.fp8", not megatron.sequence_parallel,
             "null with sequence_parallel=true: the FP8 linear does not gather sequence-parallel inputs")


def lora_enabled(cfg: RLConfig) -> bool:
    """LoRA on the actor (`actor_rollout_ref.model.lora_rank > 0`): the reference policy is then the actor with its
    adapters switched off, and no reference model is built (rlhf_mcore.trainer.roles.build_reference)."""
    return cfg.actor_rollout_ref.model.lora_rank > 0


def _check_lora(cfg: RLConfig, need) -> None:
    """LoRA keys of the actor and the critic: an adapter to start from needs adapters; no sequence parallelism."""
    for model, megatron in (("actor_rollout_ref.model", "actor_rollout_ref.actor.megatron"),
                            ("critic.model", "critic.megatron")):
        rank = value_at(cfg, f"{model}.lora_rank")
        need(f"{model}.lora_adapter_path", rank > 0 or not value_at(cfg, f"{model}.lora_adapter_path"),
             f"unset while {model}.lora_rank=0 (set lora_rank, lora_alpha and target_modules to the adapter's)")
        need(f"{megatron}.sequence_parallel", rank == 0 or not value_at(cfg, f"{megatron}.sequence_parallel"),
             f"false with {model}.lora_rank > 0 (the LoRA adapters take the full sequence)")
        need(f"{megatron}.fp8", rank == 0 or value_at(cfg, f"{megatron}.fp8") is None,
             f"null with {model}.lora_rank > 0 (the FP8 linear carries no LoRA adapters)")
    r, k = cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout.lora_sync"
    if r.lora_sync == "adapter_only":  # the adapter-only sync needs an engine that keeps its weights between syncs
        need(k, lora_enabled(cfg), "merged with actor_rollout_ref.model.lora_rank=0 (no adapters to send)")
        need(k, r.name == "native", f"merged with rollout.name={r.name}: only the native engine takes partial "
                                    "weight updates")
        need(k, cfg.async_training.mode == "off", f"merged with async_training.mode={cfg.async_training.mode}: the "
                                                  "rollout pool gets the merged weights by broadcast (README, LoRA)")
        need(k, not (r.free_cache_engine and r.sleep_level == 2),
             "merged with rollout.sleep_level=2: the engine drops its weights after generating, so every sync is full")
        need(k, not r.sync_verify, "merged with rollout.sync_verify=true: the verification checks full syncs")


def _check_multi_turn(cfg: RLConfig, need) -> None:
    mt, m = cfg.actor_rollout_ref.rollout.multi_turn, "actor_rollout_ref.rollout.multi_turn"
    if not mt.enable:
        return
    need(f"{m}.tool_config_path", mt.tool_config_path is None or Path(mt.tool_config_path).is_file(),
         "an existing YAML file listing the tools (e.g. configs/tools/calculator.yaml), or unset for no tools")
    need("algorithm.adv_estimator", cfg.algorithm.adv_estimator != "remax",
         f"not remax with {m}.enable=true: the greedy baseline is generated single-turn")
    need("actor_rollout_ref.rollout.tensor_model_parallel_size",
         cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 1,
         f"1 with {m}.enable=true: the ranks of a tensor-parallel rollout would have to see tool results at the "
         f"same engine step")


def _check_reward_model(cfg: RLConfig, need) -> None:
    """`reward_model.*` when enabled: a model path, weights, the layout (the model directory itself: build time)."""
    _check_judge(cfg, need)
    rm, k = cfg.reward.reward_model, "reward.reward_model"
    if rm.reward_manager == "prime":
        _check_prime(cfg, need)
        return
    if not rm.enable:
        return
    need(f"{k}.enable", not cfg.reward.judge.enable, "false while reward.judge.enable=true: score with one learned "
         "model at a time (a reward model or a judge)")
    need(f"{k}.model.path", bool(rm.model.path),
         "set with reward_model.enable=true: a Hugging Face *ForSequenceClassification directory (num_labels=1), "
         "e.g. one written by launch/train_rm.py")
    need(f"{k}.reward_weight", rm.reward_weight != 0, "non-zero with reward_model.enable=true (0 ignores the model: "
         "turn reward_model.enable off instead)")
    need("algorithm.adv_estimator", cfg.algorithm.adv_estimator != "remax",
         "not remax with reward_model.enable=true: ReMax's greedy baselines are scored by rule functions only")
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        got, want = getattr(rm.megatron, name), getattr(cfg.actor_rollout_ref.actor.megatron, name) or 1
        need(f"{k}.megatron.{name}", got is None or got == want,
             f"unset or the actor's ({want}): every training-side model shares the actor's process layout")


def _check_prime(cfg: RLConfig, need) -> None:
    """PRIME: the implicit PRM is the actor's model (its reference is the reference policy), RLOO advantages."""
    rm, k, a = cfg.reward.reward_model, "reward.reward_model", cfg.algorithm
    need(f"{k}.enable", rm.enable, "true with reward_manager=prime (the implicit PRM is a reward model)")
    need(f"{k}.model.path", rm.model.path in (None, cfg.actor_rollout_ref.model.path),
         f"unset or the actor's model ({cfg.actor_rollout_ref.model.path}) with reward_manager=prime: the implicit "
         f"PRM starts from the policy's weights and is measured against the reference policy")
    need("algorithm.adv_estimator", a.adv_estimator == "rloo",
         "rloo with reward_manager=prime (PRIME's advantages are RLOO on the process and the outcome rewards)")
    need("algorithm.use_kl_in_reward", not a.use_kl_in_reward, "false with reward_manager=prime")
    need("critic.enable", not cfg.critic.enable, "false or unset with reward_manager=prime")
    need("algorithm.reward_dpo_coef", a.reward_dpo_coef != 0 or a.reward_gt_coef != 0,
         "non-zero, or algorithm.reward_gt_coef non-zero: with both 0 every advantage is 0")


def _check_judge(cfg: RLConfig, need) -> None:
    """`reward.judge.*` when enabled: model path, template fields (parser names: at build time, after
    trainer.plugins)."""
    from rlhf_mcore.rewards.judge_template import check_template

    j, k = cfg.reward.judge, "reward.judge"
    if not j.enable:
        return
    need(f"{k}.model_path", bool(j.model_path), "set with reward.judge.enable=true: the judge's causal LM directory")
    try:
        check_template(j.prompt_template)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    need("algorithm.adv_estimator", cfg.algorithm.adv_estimator != "remax",
         "not remax with reward.judge.enable=true: ReMax's greedy baselines are scored by rule functions only")


def _check_dapo(cfg: RLConfig, need) -> None:
    """Overlong reward shaping and dynamic sampling (filter groups) against the batch and response sizes."""
    ob, o = cfg.reward.reward_model.overlong_buffer, "reward.reward_model.overlong_buffer"
    if ob.enable:
        need(f"{o}.len", 1 <= ob.len <= cfg.data.max_response_length,
             f"in [1, data.max_response_length={cfg.data.max_response_length}] with {o}.enable=true (DAPO uses a "
             f"quarter of the response length, e.g. 4096 of 20480)")
    fg, f, d = cfg.algorithm.filter_groups, "algorithm.filter_groups", cfg.data
    if not fg.enable:
        need("data.gen_batch_size", d.gen_batch_size in (None, d.train_batch_size),
             f"unset or data.train_batch_size ({d.train_batch_size}) unless {f}.enable=true: it sizes dynamic "
             f"sampling's generation batches")
        return
    need(f"{f}.metric", fg.metric is not None, f"set with {f}.enable=true: one of {', '.join(FILTER_METRICS)}")
    need(f"{f}.metric", fg.metric != "seq_final_reward" or not cfg.algorithm.use_kl_in_reward,
         "acc, score or seq_reward with algorithm.use_kl_in_reward=true: the KL penalty is computed after "
         "the groups are filtered here")
    need("actor_rollout_ref.rollout.n", cfg.actor_rollout_ref.rollout.n >= 2,
         f">= 2 with {f}.enable=true: a group of one response has nothing to compare with, so none would be "
         f"filtered")
    need("data.gen_batch_size", d.gen_batch_size is None or d.gen_batch_size >= d.train_batch_size,
         f">= data.train_batch_size ({d.train_batch_size}) or unset: filtering only removes groups, so a smaller "
         f"generation batch can never fill a step (DAPO draws 3x train_batch_size)")


def _check_rollout_correction(cfg: RLConfig, need) -> None:
    rc, p = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    need(f"{p}.rollout_is_batch_normalize", not rc.rollout_is_batch_normalize or rc.rollout_is is not None,
         f"false while {p}.rollout_is is null (there are no IS weights to normalise)")
    for k in ("rollout_rs_threshold", "rollout_rs_threshold_lower"):
        v = getattr(rc, k)
        need(f"{p}.{k}", v is None or (rc.rollout_rs is not None and v > 0),
             f"> 0, and set only with {p}.rollout_rs (token, sequence or geometric)")
    need(f"{p}.rollout_rs_threshold", rc.rollout_rs is None or rc.rollout_rs_threshold is not None,
         f"set when {p}.rollout_rs is on: the largest ratio pi_old/pi_rollout kept, e.g. 2.0")
    lower = rc.rollout_rs_threshold_lower
    need(f"{p}.rollout_rs_threshold_lower", lower is None or lower < rc.rollout_rs_threshold,
         f"below {p}.rollout_rs_threshold ({rc.rollout_rs_threshold}); unset means its reciprocal")
    need(f"{p}.rollout_rs_threshold", rc.rollout_rs_threshold is None or lower is not None
         or rc.rollout_rs_threshold >= 1, f">= 1 while {p}.rollout_rs_threshold_lower is unset (the band "
         f"[1/threshold, threshold] is empty otherwise), or set rollout_rs_threshold_lower")
    corrects = rc.rollout_is is not None or rc.rollout_rs is not None or rc.rollout_token_veto_threshold is not None
    need("actor_rollout_ref.actor.use_rollout_log_probs",
         not (cfg.actor_rollout_ref.actor.use_rollout_log_probs and corrects),
         f"false while {p} is on: with the rollout's log-probs as the old policy every ratio pi_old/pi_rollout is 1 "
         f"(the PPO ratio pi/pi_rollout already corrects the mismatch); turn one of them off")


# --------------------------------------------------------------------------------------------- process layout

_SPLIT_KEYS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
_SHARED = (("actor_rollout_ref.ref.megatron", lambda c: c.actor_rollout_ref.ref.megatron),
           ("critic.megatron", lambda c: c.critic.megatron))


def parallel_layout(cfg: RLConfig) -> tuple[int, int, Optional[int]]:
    """(TP, PP, VPP) of the training side: the actor's layout, which ref and critic must share."""
    m = cfg.actor_rollout_ref.actor.megatron
    tp, pp = m.tensor_model_parallel_size or 1, m.pipeline_model_parallel_size or 1
    for name, get in _SHARED:
        other = get(cfg)
        for attr, want in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
            got = getattr(other, attr)
            if got is not None and got != want:
                raise ConfigError(
                    f"config key '{name}.{attr}' is {got} but the actor's is {want}: all training models share one "
                    f"process layout. Remove '{name}.{attr}' or set it to {want}.")
    pipeline_split(cfg)
    return tp, pp, m.virtual_pipeline_model_parallel_size


def expert_parallel_size(cfg: RLConfig) -> int:
    """The actor's `megatron.expert_model_parallel_size` (1 when unset), which ref and critic must share."""
    want = cfg.actor_rollout_ref.actor.megatron.expert_model_parallel_size or 1
    for name, get in _SHARED:
        got = get(cfg).expert_model_parallel_size
        if got is not None and got != want:
            raise ConfigError(
                f"config key '{name}.expert_model_parallel_size' is {got} but the actor's is {want}: all training "
                f"models share one process layout. Remove it or set it to {want}.")
    return want


def moe_overrides(megatron) -> dict:
    """A role's MoE loss coefficients (its `megatron.override_transformer_config`) as TransformerConfig overrides:
    only those set away from their defaults, so a dense model sees none unless asked (and then refuses them)."""
    o = megatron.override_transformer_config
    out = {"moe_aux_loss_coeff": o.moe_aux_loss_coeff} if o.moe_aux_loss_coeff else {}
    if o.moe_z_loss_coeff is not None:
        out["moe_z_loss_coeff"] = o.moe_z_loss_coeff
    return out


def pipeline_split(cfg: RLConfig) -> dict:
    """The actor's `override_transformer_config` stage split as TransformerConfig overrides (only the keys set),
    which ref and critic share: a different value under their `megatron` sections is refused."""
    actor = cfg.actor_rollout_ref.actor.megatron.override_transformer_config
    split = {k: getattr(actor, k) for k in _SPLIT_KEYS if getattr(actor, k) is not None}
    for name, get in _SHARED:
        other = get(cfg).override_transformer_config
        for k in _SPLIT_KEYS:
            got = getattr(other, k)
            if got is not None and got != getattr(actor, k):
                key = f"{name}.override_transformer_config.{k}"
                raise ConfigError(
                    f"config key '{key}' is {got} but the actor's is {getattr(actor, k)}: ref and critic share the "
                    f"actor's pipeline stages. Remove '{key}' or set "
                    f"actor_rollout_ref.actor.megatron.override_transformer_config.{k} to the same value.")
    return split


def _check_pipeline_split(cfg: RLConfig, pp: int, vpp: Optional[int]) -> None:
    """The stage split against the layer count of the actor's (and a separate critic's) model, where readable."""
    from rlhf_mcore.models.pipeline_layout import PipelineLayoutError, resolve_split

    split = pipeline_split(cfg)
    paths = [("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path)]
    if critic_enabled(cfg) and cfg.critic.model.path:
        paths.append(("critic.model.path", cfg.critic.model.path))
    for key, path in paths:
        layers = model_num_layers(path)
        if layers is None:
            continue  # unreadable config.json: build_model reports it
        try:
            resolve_split(layers, pp, vpp, split.get(_SPLIT_KEYS[0]), split.get(_SPLIT_KEYS[1]))
        except PipelineLayoutError as e:
            raise ConfigError(
                f"{key}={path} has num_hidden_layers={layers}; with "
                f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}"
                + (f" and virtual_pipeline_model_parallel_size={vpp}" if vpp else "")
                + f": {e} (keys under actor_rollout_ref.actor.megatron.override_transformer_config)") from None


def _check_router_replay_model(cfg: RLConfig) -> None:
    """Routing replay and route recording need a mixture-of-experts policy (config.json read; unreadable: the
    model's build reports it)."""

    arr = cfg.actor_rollout_ref
    if model_is_moe(arr.model.path) is not False:
        return
    for key, on in (("actor_rollout_ref.actor.router_replay.mode", arr.actor.router_replay.mode != "disabled"),
                    ("actor_rollout_ref.rollout.enable_rollout_routing_replay", rollout_records_routes(cfg))):
        require(not on, f"config key '{key}' has value {value_at(cfg, key)!r}, but actor_rollout_ref.model.path="
                        f"{arr.model.path} is a dense model (no experts to route): remove it (disabled / unset).")


def check_moe_tensor_parallel(cfg: RLConfig, tp: int) -> None:
    """A trained mixture-of-experts model (actor, critic) at TP > 1 needs sequence parallelism: megatron-core
    0.16.1's `MoELayer.forward` raises at the first training forward without it ("performance may degrade ..."), after
    the first rollout. Refused here, before anything is built; where the role's settings refuse sequence
    parallelism too (routing replay, LoRA), the fix is TP=1 (config.json read; unreadable: the build reports it)."""
    if tp == 1:
        return
    arr, need = cfg.actor_rollout_ref, _need(cfg)
    mode = arr.actor.router_replay.mode
    roles = [("actor_rollout_ref.actor.megatron", arr.model.path,
              [f"actor.router_replay.mode={mode}"] * (mode != "disabled")
              + ["model.lora_rank > 0"] * (arr.model.lora_rank > 0))]
    if critic_enabled(cfg):
        c = cfg.critic
        roles.append(("critic.megatron", c.model.path or arr.model.path, ["critic.model.lora_rank > 0"] *
                      (c.model.lora_rank > 0)))
    for megatron, path, refusing in roles:
        if model_is_moe(path) is not True:
            continue
        fix = (f"{' and '.join(refusing)} refuses sequence parallelism: set tensor_model_parallel_size=1 "
               if refusing else "or set tensor_model_parallel_size=1 ")
        need(f"{megatron}.sequence_parallel", value_at(cfg, f"{megatron}.sequence_parallel"),
             f"true with tensor_model_parallel_size={tp}: {path} is a mixture-of-experts model, and megatron-core "
             f"0.16.1's MoE layer refuses a training forward at TP > 1 without sequence parallelism (which needs "
             f"Transformer Engine); {fix}(expert_model_parallel_size splits the experts)")


def recompute_mode(model, megatron) -> Optional[str]:
    """A training role's activation recompute: "full" (whole layers: model.enable_gradient_checkpointing=true, or
    veRL's megatron way, override_transformer_config.recompute_granularity=full), "selective" (the modules of
    recompute_modules), or None."""
    granularity = megatron.override_transformer_config.recompute_granularity
    if model.enable_gradient_checkpointing or granularity == "full":
        return "full"
    return granularity


def _check_recompute(cfg: RLConfig, pp: int, vpp: Optional[int], read_model: bool) -> None:
    """`override_transformer_config`'s recompute keys: only on a role with a backward pass, consistent with its
    model.enable_gradient_checkpointing, only what runs without Transformer Engine, and against the layers of a
    model chunk where config.json is readable (uniform: a divisor, else Megatron indexes past the chunk; block: at
    most the chunk's layers)."""
    from rlhf_mcore.models.pipeline_layout import chunk_layers, resolve_split

    arr = cfg.actor_rollout_ref
    roles = [("actor_rollout_ref.actor", arr.actor.megatron, "actor_rollout_ref.model", arr.model.path),
             ("actor_rollout_ref.ref", arr.ref.megatron, None, None),
             ("reward.reward_model", cfg.reward.reward_model.megatron, None, None)]
    if critic_enabled(cfg):
        roles.append(("critic", cfg.critic.megatron, "critic.model", cfg.critic.model.path or arr.model.path))
    for role, megatron, model_key, path in roles:
        o, pre = megatron.override_transformer_config, f"{role}.megatron.override_transformer_config."
        named = [k for k in ("recompute_granularity", "recompute_method", "recompute_num_layers")
                 if getattr(o, k) is not None] + (["recompute_modules"] if o.recompute_modules != ["core_attn"] else [])
        if not named:
            continue
        who = {"actor_rollout_ref.ref": "the reference policy", "reward.reward_model": "the reward model"}.get(role)
        require(who is None, f"{pre}{named[0]} is set, but {who} runs no backward pass, so nothing is recomputed: "
                             "remove it.")
        model = value_at(cfg, model_key)
        mode = recompute_mode(model, megatron)
        require(not (model.enable_gradient_checkpointing and o.recompute_granularity == "selective"),
                f"{pre}recompute_granularity=selective with {model_key}.enable_gradient_checkpointing=true, which "
                "recomputes whole layers: keep one of the two.")
        require(mode == "selective" or o.recompute_modules == ["core_attn"],
                f"{pre}recompute_modules={list(o.recompute_modules)} is read only with recompute_granularity="
                "selective: set that, or remove recompute_modules.")
        other = [m for m in o.recompute_modules if m != "core_attn"]
        require(not other, f"{pre}recompute_modules={list(o.recompute_modules)}: {other} need Transformer Engine in "
                           "megatron-core 0.16.1, which this trainer runs without; only core_attn recomputes here.")
        if o.recompute_method is None and o.recompute_num_layers is None:
            continue
        key = pre + ("recompute_method" if o.recompute_method is not None else "recompute_num_layers")
        require(mode is not None, f"{key} is set, but activation recompute is off: set {model_key}."
                                  f"enable_gradient_checkpointing=true (or {pre}recompute_granularity=full) to "
                                  "recompute, or remove it.")
        require(mode == "full", f"{key} chooses which whole layers recompute; recompute_granularity=selective "
                                "recomputes modules of every layer: remove it, or use recompute_granularity=full.")
        layers = model_num_layers(path) if read_model else None
        if layers is None or o.recompute_num_layers is None:
            continue
        split = pipeline_split(cfg)
        first, last = resolve_split(layers, pp, vpp, split.get(_SPLIT_KEYS[0]), split.get(_SPLIT_KEYS[1]))
        sizes = sorted({len(r) for stage in chunk_layers(layers, pp, first, last, vpp) for r in stage})
        n, method, nk = o.recompute_num_layers, o.recompute_method or "uniform", pre + "recompute_num_layers"
        if method == "uniform":
            require(all(k % n == 0 for k in sizes),
                    f"{nk}={n} with recompute_method=uniform must divide the layers of each model chunk ({path} has "
                    f"{layers} layers: chunks of {', '.join(map(str, sizes))} at PP={pp}"
                    + (f", VPP={vpp}" if vpp else "") + "): choose a divisor, or recompute_method=block.")
        else:
            require(n <= max(sizes), f"{nk}={n} with recompute_method=block is more than the {max(sizes)} layers of a "
                                     f"model chunk ({path} has {layers} at PP={pp}): at most {max(sizes)} (all of "
                                     "them is what recompute_method=uniform with 1 does).")


def _check_cuda_graphs(cfg: RLConfig, tp: int, pp: int, vpp: Optional[int]) -> None:
    """`megatron.cuda_graphs=true` where graphs cannot run is refused here, before anything is built (the engine
    checks again with the built model: `rlhf_mcore.engine.cuda_graphs.graphs_supported`)."""
    arr = cfg.actor_rollout_ref
    roles = [("actor_rollout_ref.actor", arr.actor.megatron, arr.model.use_remove_padding,
              recompute_mode(arr.model, arr.actor.megatron) is not None),
             ("actor_rollout_ref.ref", arr.ref.megatron, arr.model.use_remove_padding, False)]
    if critic_enabled(cfg):
        c = cfg.critic
        roles.append(("critic", c.megatron, c.model.use_remove_padding,
                      recompute_mode(c.model, c.megatron) is not None))
    rm = cfg.reward.reward_model
    if rm.enable:
        roles.append(("reward_model", rm.megatron, rm.model.use_remove_padding, False))
    for role, megatron, packed, recompute in roles:
        if megatron.cuda_graphs is not True:
            continue
        why = ("trainer.device=cpu" if cfg.trainer.device == "cpu" else
               "TP or PP > 1 (or virtual pipeline stages)" if tp > 1 or pp > 1 or vpp else
               "context_parallel_size > 1" if megatron.context_parallel_size > 1 else
               "padded sequences (use_remove_padding=false)" if not packed else
               "activation recompute (enable_gradient_checkpointing=true, or recompute_granularity)" if recompute
               else None)
        require(why is None, f"{role}.megatron.cuda_graphs=true, but CUDA graphs cannot run with {why}: set it to "
                             "false, or leave it unset (graphs where they run).")


# --------------------------------------------------------------------------------------------- before a launch


def validate_config(cfg: RLConfig, world_size: int, model_max_positions: Optional[int] = None,
                    read_model: bool = True) -> None:
    """Checks that relate several keys, the world size and the model. Fails on the first problem.

    `world_size`: the launched processes (the launch-layout keys must name them). `read_model=False` skips the
    checks that read the models' config.json (the pipeline split against the layer count): `--print-config`
    reads no model file. The single-key rules run again first (a config built or changed in code meets them
    too)."""
    check_sections(cfg)
    if cfg.vla.enable:
        return _validate_vla(cfg, world_size)
    load_plugins(cfg.trainer.plugins)  # plugins may register estimators, losses and rewards used below
    t = cfg.trainer
    if cfg.async_training.mode != "off":
        train_size, _ = pool_sizes(cfg, world_size)
        _check_async(cfg, train_size)
        world_size = train_size  # TP x PP x DP below: the training pool's
    else:
        _check_async(cfg, world_size)
    if t.nnodes is not None or t.n_gpus_per_node is not None:
        nodes, per_node = t.nnodes or 1, t.n_gpus_per_node or world_size // (t.nnodes or 1)
        require(nodes * per_node == world_size,
                f"trainer.nnodes={nodes} x trainer.n_gpus_per_node={per_node} = {nodes * per_node} processes, but "
                f"{world_size} were launched: launch with `torchrun --nnodes={nodes} --nproc_per_node={per_node} "
                f"launch/train.py ...`, or set the two keys to the launched layout (or leave them unset).")
    tp, pp, vpp = parallel_layout(cfg)
    require(tp >= 1 and pp >= 1, f"tensor/pipeline parallel sizes must be >= 1, got TP={tp}, PP={pp}.")
    require(
        world_size % (tp * pp) == 0,
        f"world size {world_size} is not divisible by TP×PP = {tp}×{pp} = {tp * pp}: set "
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size / pipeline_model_parallel_size so their "
        f"product divides {world_size}, or launch with a multiple of {tp * pp} processes.")
    if vpp is not None:
        require(pp > 1, "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size needs "
                        "pipeline_model_parallel_size > 1.")
    if read_model:
        _check_vision(cfg)
        _check_pipeline_split(cfg, pp, vpp)
        _check_router_replay_model(cfg)
        check_moe_tensor_parallel(cfg, tp)
    _check_recompute(cfg, pp, vpp, read_model)
    _check_cuda_graphs(cfg, tp, pp, vpp)
    dp = world_size // (tp * pp)
    ep = expert_parallel_size(cfg)
    require(dp % ep == 0,
            f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep} must divide the data-parallel size {dp} "
            f"(world {world_size} / TP {tp} / PP {pp}): the experts are split over data-parallel ranks; set it to a "
            f"divisor of {dp}, or launch a multiple of {tp * pp * ep} processes.")
    d, rollout = cfg.data, cfg.actor_rollout_ref.rollout
    require(d.train_batch_size > 0, f"data.train_batch_size must be > 0, got {d.train_batch_size}.")
    require(d.max_prompt_length > 0 and d.max_response_length > 0,
            "data.max_prompt_length and data.max_response_length must be > 0.")
    require(
        d.train_batch_size % dp == 0,
        f"data.train_batch_size={d.train_batch_size} is not divisible by the data-parallel size {dp} "
        f"(world {world_size} / TP {tp} / PP {pp}); all samples of a prompt stay on one DP rank, so use a "
        f"multiple of {dp}.")
    _check_batches(cfg, dp)
    if model_max_positions is not None:
        total = d.max_prompt_length + d.max_response_length
        require(
            total <= model_max_positions,
            f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length} + {d.max_response_length} "
            f"= {total} exceeds the model's context of {model_max_positions} tokens (max_position_embeddings): "
            f"shorten one of them.")
    require(rollout.sleep_level in (1, 2),
            f"actor_rollout_ref.rollout.sleep_level must be 1 (free the KV cache) or 2 (KV cache and weights), got "
            f"{rollout.sleep_level}.")
    require(rollout.sleep_level == 1 or rollout.free_cache_engine,
            "actor_rollout_ref.rollout.sleep_level=2 releases the rollout's memory after generating, which "
            "free_cache_engine=false turns off: set free_cache_engine=true or sleep_level=1.")
    _check_algorithm_names(cfg)
    require(cfg.async_training.mode != "off" or world_size % rollout.tensor_model_parallel_size == 0,
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} must divide "
            f"the world size {world_size}.")


def _validate_vla(cfg: RLConfig, world_size: int) -> None:
    """A VLA run (rlhf_mcore/trainer/vla.py): its keys were checked at load (config/vla.py); here the layout."""
    tp, pp, vpp = parallel_layout(cfg)
    require(vpp is None, "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size is set, but the VLA "
                         "policy decodes with one model chunk per rank: leave it unset.")
    require(tp >= 1 and pp >= 1 and world_size % (tp * pp) == 0,
            f"world size {world_size} is not divisible by TP×PP = {tp}×{pp}: launch a multiple of {tp * pp} processes.")
    dp, v, n = world_size // (tp * pp), cfg.vla, cfg.actor_rollout_ref.rollout.n
    require((v.num_envs // n) % dp == 0 and v.held_out_states % dp == 0,
            f"vla.num_envs / rollout.n = {v.num_envs // n} initial states per step and vla.held_out_states="
            f"{v.held_out_states} must split evenly over the {dp} data-parallel ranks (world {world_size} / TP {tp} / "
            f"PP {pp}): change them or the launch.")
    t = cfg.trainer
    if t.nnodes is not None or t.n_gpus_per_node is not None:
        nodes, per_node = t.nnodes or 1, t.n_gpus_per_node or world_size // (t.nnodes or 1)
        require(nodes * per_node == world_size,
                f"trainer.nnodes={nodes} x trainer.n_gpus_per_node={per_node} = {nodes * per_node} processes, but "
                f"{world_size} were launched.")


def _check_batches(cfg: RLConfig, dp: int) -> None:
    """Mini- and micro-batch sizes of each trained role against the batch, the DP size and rollout.n."""
    d, actor, n = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    roles = [("actor_rollout_ref.actor", actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu,
              actor.use_dynamic_bsz)]
    if critic_enabled(cfg):
        c = cfg.critic
        roles.append(("critic", c.ppo_mini_batch_size or actor.ppo_mini_batch_size,
                      c.ppo_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu, c.use_dynamic_bsz))
    for role, mini, micro, dynamic in roles:
        require(mini > 0, f"{role}.ppo_mini_batch_size must be > 0, got {mini}.")
        require(
            d.train_batch_size % mini == 0,
            f"data.train_batch_size={d.train_batch_size} is not divisible by {role}.ppo_mini_batch_size={mini}: "
            f"choose a mini-batch size that divides the batch (e.g. {_divisor_hint(d.train_batch_size, mini)}).")
        require(
            mini % dp == 0,
            f"{role}.ppo_mini_batch_size={mini} (prompts) is not divisible by the data-parallel size {dp}: "
            f"use a multiple of {dp}.")
        per_rank = mini * n // dp
        if not dynamic:
            require(micro is not None and micro > 0,
                    f"{role}.ppo_micro_batch_size_per_gpu must be set (> 0) unless {role}.use_dynamic_bsz=true.")
            require(
                per_rank % micro == 0,
                f"{role}: a mini-batch is {mini} prompts × rollout.n {n} / DP {dp} = {per_rank} sequences "
                f"per rank, not divisible by ppo_micro_batch_size_per_gpu={micro}: use a divisor of {per_rank} "
                f"(e.g. {_divisor_hint(per_rank, micro)}).")


def pool_sizes(cfg: RLConfig, world_size: int) -> tuple[int, int]:
    """(training pool, rollout pool) process counts under async_training: the rollout pool is rollout.nnodes x
    rollout.n_gpus_per_node, the training pool trainer.nnodes x trainer.n_gpus_per_node (or the rest of the world);
    together they must be the launched world."""
    rp, t = cfg.rollout, cfg.trainer
    require(rp.n_gpus_per_node is not None,
            f"async_training.mode={cfg.async_training.mode} splits the world into a training and a rollout pool: set "
            f"rollout.n_gpus_per_node (and rollout.nnodes, default 1) to the rollout pool's processes per node, "
            f"e.g. rollout.n_gpus_per_node=1 trainer.n_gpus_per_node={max(world_size - 1, 1)}.")
    rollout = (rp.nnodes or 1) * rp.n_gpus_per_node
    train = (t.nnodes or 1) * t.n_gpus_per_node if t.n_gpus_per_node is not None else world_size - rollout
    require(train >= 1 and train + rollout == world_size,
            f"async_training: the training pool (trainer.nnodes x trainer.n_gpus_per_node = {train}) and the rollout "
            f"pool (rollout.nnodes x rollout.n_gpus_per_node = {rollout}) must add up to the {world_size} processes "
            f"torchrun launched: launch {max(train, 1) + rollout} processes or change the pool sizes.")
    return train, rollout


def _check_async(cfg: RLConfig, train_world: int) -> None:
    a, r = cfg.async_training, cfg.actor_rollout_ref.rollout
    defaults = AsyncTrainingConfig()
    if a.mode == "off":
        require(cfg.rollout.nnodes is None and cfg.rollout.n_gpus_per_node is None,
                "rollout.nnodes / rollout.n_gpus_per_node size the rollout pool of the asynchronous trainers: set "
                "async_training.mode=one_step_off or fully_async, or remove them (the synchronous trainer colocates "
                "the rollout on every rank).")
    if a.mode != "fully_async":
        for k in ("require_batches", "trigger_parameter_sync_step", "staleness_threshold", "partial_rollout"):
            require(getattr(a, k) == getattr(defaults, k),
                    f"async_training.{k}={getattr(a, k)!r} applies to async_training.mode=fully_async only (the mode "
                    f"is {a.mode}): remove it or set the mode.")
    require(a.mode == "one_step_off" or a.prefetch_weights == defaults.prefetch_weights,
            f"async_training.prefetch_weights={a.prefetch_weights!r} applies to async_training.mode=one_step_off "
            f"only (the mode is {a.mode}): remove it or set the mode.")
    if a.mode == "off":
        return
    _, rollout = pool_sizes(cfg, train_world + (cfg.rollout.nnodes or 1) * cfg.rollout.n_gpus_per_node)
    require(rollout % r.tensor_model_parallel_size == 0,
            f"the rollout pool has {rollout} processes, not a multiple of "
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={r.tensor_model_parallel_size}.")
    # reward_model.enable (a discriminative reward model) runs on the training pool (trainer/training_pool.py scores
    # each batch)
    require(not cfg.reward.judge.enable,
            f"reward.judge.enable=true serves the judge with a second rollout engine colocated with the synchronous "
            f"trainer's; with async_training.mode={a.mode} the training pool holds no rollout engine to serve it: "
            f"turn the judge off or set async_training.mode=off.")
    require(cfg.reward.reward_model.reward_manager != "prime",
            f"reward_model.reward_manager=prime updates its implicit PRM inside the synchronous step, on that step's "
            f"freshly generated samples before the actor's update; async_training.mode={a.mode} has no such step: "
            f"use another reward_manager or set async_training.mode=off.")
    require(not cfg.algorithm.filter_groups.enable,
            f"algorithm.filter_groups (dynamic sampling) runs with async_training.mode=off only, not "
            f"{a.mode}: set algorithm.filter_groups.enable=false or async_training.mode=off.")
    if a.mode == "fully_async":
        need = a.require_batches * cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        require(a.require_batches >= 1 and a.trigger_parameter_sync_step >= 1 and a.staleness_threshold >= 0,
                "async_training.require_batches and .trigger_parameter_sync_step must be >= 1, "
                ".staleness_threshold >= 0 (policy versions).")
        require(a.staleness_threshold >= a.trigger_parameter_sync_step - 1,
                f"async_training.staleness_threshold={a.staleness_threshold} is below "
                f"trigger_parameter_sync_step - 1 = {a.trigger_parameter_sync_step - 1}: the rollout pool's weights "
                f"lag the trainer by up to that many versions between syncs, so every sample would be dropped as "
                f"stale and the run would never finish a step: raise the threshold or sync more often.")
        require(cfg.data.train_batch_size == need,
                f"async_training.mode=fully_async trains require_batches x actor.ppo_mini_batch_size = "
                f"{a.require_batches} x {cfg.actor_rollout_ref.actor.ppo_mini_batch_size} = {need} prompts a step: "
                f"set data.train_batch_size={need} (it is {cfg.data.train_batch_size}).")
        require(r.name == "native",
                f"async_training.mode=fully_async streams samples from the native engine; "
                f"actor_rollout_ref.rollout.name={r.name} does not stream: set it to native, or use one_step_off.")
        require(r.tensor_model_parallel_size == 1,
                "async_training.mode=fully_async runs rollout replicas of one process each: set "
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1 (one_step_off takes rollout TP > 1).")
        require(not estimator_needs(cfg).needs_greedy_baseline,
                f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs a greedy baseline per prompt, which "
                f"the streaming rollout does not generate: use one_step_off or another estimator.")


def _check_algorithm_names(cfg: RLConfig) -> None:
    """Names users can extend are checked against the registries (after trainer.plugins were imported)."""
    from rlhf_mcore.algos.names import kl_estimator_names, loss_agg_mode_names, policy_loss_names

    actor = cfg.actor_rollout_ref.actor
    for key, value, names, how in (
            ("actor_rollout_ref.actor.policy_loss", actor.policy_loss, policy_loss_names(),
             " or register your own with rlhf_mcore.algos.register_policy_loss in a trainer.plugins file"),
            ("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, loss_agg_mode_names(), ""),
            ("critic.loss_agg_mode", cfg.critic.loss_agg_mode, loss_agg_mode_names(), ""),
            ("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type.rstrip("+"), kl_estimator_names(),
             " (a '+' suffix takes k2's gradient)"),
            ("algorithm.kl_penalty", cfg.algorithm.kl_penalty.rstrip("+"), kl_estimator_names(),
             " (a '+' suffix takes k2's gradient)")):
        if value not in names:
            close = difflib.get_close_matches(str(value), names, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"config key '{key}' has value {value!r}; choose one of {', '.join(names)}{how}.{hint}")
    est, name, n = estimator_needs(cfg), cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n
    if est.needs_critic and cfg.critic.enable is False:
        raise ConfigError(f"algorithm.adv_estimator={name} needs a critic but critic.enable is false: set "
                          f"critic.enable=true or choose an estimator without one (e.g. grpo).")
    require(not est.needs_group_index or n >= 2,
            f"algorithm.adv_estimator={name} compares the samples of each prompt with each other, but "
            f"actor_rollout_ref.rollout.n={n}: set rollout.n >= 2 (e.g. 5), or use an estimator that needs no "
            f"group (gae, remax, reinforce_plus_plus).")


def _divisor_hint(total: int, near: int) -> int:
    divisors = [k for k in range(1, total + 1) if total % k == 0]
    return min(divisors, key=lambda k: (abs(k - near), k))
