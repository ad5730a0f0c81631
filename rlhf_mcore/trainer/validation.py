"""Validation: greedy generation over the validation set, scored with each row's reward; accuracy per source."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from rlhf_mcore.rollout.base import SamplingParams
from rlhf_mcore.trainer.rollout_phase import generate_and_score


def validate(trainer, dataset) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """All ranks call this; returns ``val/<data_source>/acc`` (+ ``val/acc``) and sample generations."""
    cfg = trainer.cfg
    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    items = [dataset[i] for i in range(len(dataset))]
    if vk.do_sample:
        params = SamplingParams(n=vk.n, temperature=vk.temperature, top_p=vk.top_p, top_k=vk.top_k,
                                max_new_tokens=cfg.data.max_response_length, seed=cfg.trainer.seed)
    else:
        params = SamplingParams.for_validation(cfg.data.max_response_length)
    rows, _ = generate_and_score(
        trainer.rollout, trainer.scorer, [it["input_ids"] for it in items], items, params, trainer.tokenizer,
        rollout_tp=cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, group=trainer.state.cpu_group)
    per_source: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        per_source[items[r.prompt_pos]["data_source"]].append(r.score)
    metrics = {f"val/{src}/acc": sum(v) / len(v) for src, v in per_source.items()}
    metrics["val/acc"] = sum(r.score for r in rows) / max(len(rows), 1)
    samples = [{"prompt": trainer.tokenizer.decode(r.prompt_ids), "score": r.score,
                "response": trainer.tokenizer.decode(r.response_ids, skip_special_tokens=True)} for r in rows]
    return metrics, samples
