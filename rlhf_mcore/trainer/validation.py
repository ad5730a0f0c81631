"""Validation: generation over the validation set, scored with each row's reward; accuracy per source."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

from rlhf_mcore.rollout.base import SamplingParams
from rlhf_mcore.trainer.rollout_phase import generate_and_score


def validate(rollout, scorer, tokenizer, dataset, params: SamplingParams, *, rollout_tp: int, group=None,
             batch_size: Optional[int] = None, agent_runner=None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """All ranks call this with a woken `rollout`; returns ``val/<data_source>/acc`` (+ ``val/acc``) and the
    decoded samples (prompt, response, score). `batch_size` (`data.val_batch_size`) prompts go to the rollout
    at a time; None: all of them. `agent_runner`: multi-turn rows run their agent loops (rlhf_mcore.agents), and
    their ``val/agent/*`` metrics (turns, tool calls and errors, tokens; `agent_metrics`) come with the accuracy."""
    items = [dataset[i] for i in range(len(dataset))]
    step = batch_size or max(len(items), 1)
    rows = []
    for start in range(0, len(items), step):
        chunk = items[start:start + step]
        part, _ = generate_and_score(rollout, scorer, [it["input_ids"] for it in chunk], chunk, params, tokenizer,
                                     rollout_tp=rollout_tp, group=group, agent_runner=agent_runner)
        for r in part:
            r.prompt_pos += start
        rows += part
    per_source: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        per_source[items[r.prompt_pos]["data_source"]].append(r.score)
    metrics = {f"val/{src}/acc": sum(v) / len(v) for src, v in per_source.items()}
    metrics["val/acc"] = sum(r.score for r in rows) / max(len(rows), 1)
    if agent_runner is not None:
        from rlhf_mcore.agents.rollout import agent_metrics

        metrics.update({f"val/{k}": v for k, v in agent_metrics([r.agent for r in rows]).items()})
    samples = [{"prompt": tokenizer.decode(r.prompt_ids), "score": r.score,
                "response": tokenizer.decode(r.response_ids, skip_special_tokens=True)} for r in rows]
    return metrics, samples
