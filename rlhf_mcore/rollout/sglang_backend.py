"""SGLang as a colocated rollout engine (in-process `sglang.Engine`, one per rollout TP group).

NOT VERIFIED HERE: SGLang cannot be installed on this project's machines (it needs a newer torch and CUDA
kernel wheels). This backend is written against SGLang's documented offline API:
  sglang.Engine(model_path=, tp_size=, mem_fraction_static=, enable_memory_saver=, base_gpu_id=, ...)
  .generate(input_ids=, sampling_params=, return_logprob=True) -> one dict per request with
      ["meta_info"]["output_token_logprobs"] = [(logprob, token_id, text|None), ...] and
      ["meta_info"]["finish_reason"] = {"type": "stop" | "length" | "abort", ...}
  .update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)
  .release_memory_occupation(tags) / .resume_memory_occupation(tags), tags in {"weights", "kv_cache", "cuda_graph"}
  .flush_cache(), .shutdown()
Its unit test checks our translation of parameters and outputs against a fake module, not SGLang itself.

Colocation: the first rank of each rollout TP group (the "driver") owns the engine, which spawns SGLang's own
TP workers on GPUs [base_gpu_id, base_gpu_id + tp_size); the other ranks of the group call the same methods,
which then only take part in broadcasting results (so every rank returns the same outputs).

Semantics that differ from the native engine, by SGLang's design:
  - the model's eos ids always stop a sample unless stop_token_ids=() or ignore_eos (then none does);
  - log-probs are SGLang's (after temperature scaling);
  - `seed` becomes a per-sample `sampling_seed`, derived from (seed, request id, sample) as in the native
    engine; SGLang honours it only in its deterministic-sampling mode.
  - after sleep(level=2) the weights are gone: call update_weights() after wake() before generating.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from .base import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    RolloutEngine,
    Sample,
    SamplingParams,
    read_eos_token_ids,
    validate_sleep_level,
)

SLEEP_TAGS = {1: ["kv_cache"], 2: ["kv_cache", "weights", "cuda_graph"]}
_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH}


def to_sglang_sampling_params(params: SamplingParams, sample_seed: int | None = None) -> dict:
    """One SGLang sampling_params dict for one sample (n is expanded into separate requests)."""
    out = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": 0.0 if params.greedy else float(params.temperature),
        "top_p": float(params.top_p) if params.top_p_active else 1.0,
        "top_k": int(params.top_k) if params.top_k_active else -1,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    stop = list(params.stop_token_ids or ())
    if params.ignore_eos or not stop:
        out["ignore_eos"] = True
    else:
        out["stop_token_ids"] = stop
    if sample_seed is not None:
        out["sampling_seed"] = int(sample_seed)
    return out


def parse_sglang_output(ret: dict) -> Sample:
    """One SGLang result dict -> Sample. Raises RuntimeError on an aborted request."""
    meta = ret["meta_info"]
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason not in _FINISH:
        raise RuntimeError(f"SGLang finished a request with finish_reason={meta.get('finish_reason')!r}; "
                           "expected 'stop' or 'length' (was it aborted, e.g. for exceeding context_length?).")
    entries = meta["output_token_logprobs"]
    token_ids = [int(e[1]) for e in entries]
    if "output_ids" in ret and list(ret["output_ids"]) != token_ids:
        raise RuntimeError("SGLang output_ids disagree with output_token_logprobs; cannot align log-probs.")
    return Sample(token_ids=token_ids, logprobs=[float(e[0]) for e in entries], finish_reason=_FINISH[reason])


class SGLangRolloutEngine(RolloutEngine):
    """Drive an in-process SGLang engine; see the module docstring for what is and is not verified."""

    def __init__(self, model_dir, *, tp_size: int = 1, mem_fraction_static: float = 0.5,
                 base_gpu_id: int | None = None, enable_memory_saver: bool = True, max_model_len: int | None = None,
                 random_seed: int = 0, tp_group=None, engine_kwargs: dict | None = None):
        try:
            import sglang
        except ImportError as e:
            raise ImportError("rollout engine 'sglang' needs the sglang package (pip install 'sglang[all]'); "
                              "or use actor_rollout_ref.rollout.name=native.") from e
        self.model_dir = str(model_dir)
        self.tp_group = tp_group
        self.is_driver = tp_group is None or dist.get_rank(tp_group) == 0
        self._stop_ids_default = read_eos_token_ids(model_dir)
        self._needs_weights = False
        self.engine = None
        if self.is_driver:
            if base_gpu_id is None:
                base_gpu_id = torch.cuda.current_device() if torch.cuda.is_available() else 0
            kwargs = dict(model_path=self.model_dir, tp_size=tp_size, mem_fraction_static=mem_fraction_static,
                          enable_memory_saver=enable_memory_saver, base_gpu_id=base_gpu_id,
                          skip_tokenizer_init=True, random_seed=random_seed)
            if max_model_len is not None:
                kwargs["context_length"] = max_model_len
            kwargs.update(engine_kwargs or {})
            self.engine = sglang.Engine(**kwargs)

    @property
    def default_stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_ids_default

    def _broadcast(self, obj):
        if self.tp_group is None or dist.get_world_size(self.tp_group) == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        return box[0]

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 request_ids: Sequence[int] | None = None) -> list[GenerationOutput]:
        if self._needs_weights:
            raise RuntimeError("SGLang weights were released by sleep(level=2); call update_weights() after wake().")
        params = params.with_stop_ids(self._stop_ids_default)
        outputs = None
        if self.is_driver:
            from .native.sampling import sequence_key

            rids = list(range(len(prompts))) if request_ids is None else list(request_ids)
            input_ids, sp = [], []
            for i, p in enumerate(prompts):
                for j in range(params.n):
                    input_ids.append(list(p))
                    seed = None if params.seed is None else sequence_key(params.seed, rids[i], j)
                    sp.append(to_sglang_sampling_params(params, seed))
            rets = self.engine.generate(input_ids=input_ids, sampling_params=sp, return_logprob=True)
            if isinstance(rets, dict):
                rets = [rets]
            if len(rets) != len(input_ids):
                raise RuntimeError(f"SGLang returned {len(rets)} results for {len(input_ids)} requests.")
            outputs = [GenerationOutput(prompt_ids=list(p),
                                        samples=[parse_sglang_output(rets[i * params.n + j]) for j in range(params.n)])
                       for i, p in enumerate(prompts)]
        return self._broadcast(outputs)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], flush_cache: bool = True) -> None:
        """Send full HF-named tensors to SGLang (which shards them over its own TP workers)."""
        named = list(named_tensors)
        if self.is_driver:
            self.engine.update_weights_from_tensor(named, load_format=None, flush_cache=flush_cache)
        self._needs_weights = False

    def sleep(self, level: int = 1) -> int:
        validate_sleep_level(level)
        freed = 0
        if self.is_driver:
            free_before = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
            self.engine.release_memory_occupation(tags=SLEEP_TAGS[level])
            if torch.cuda.is_available():
                freed = max(0, torch.cuda.mem_get_info()[0] - free_before)
        self._sleep_level = level
        if level == 2:
            self._needs_weights = True
        return int(self._broadcast(freed))

    def wake(self) -> None:
        level = getattr(self, "_sleep_level", 0)
        if self.is_driver and level:
            self.engine.resume_memory_occupation(tags=SLEEP_TAGS[level])
            self.engine.flush_cache()
        self._sleep_level = 0

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
