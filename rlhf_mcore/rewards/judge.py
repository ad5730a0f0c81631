"""Generative reward models (LLM-as-judge, `reward.judge.*`): a judge model reads each response and writes a verdict,
from which a registered parser reads the score.

The judge is a second native rollout engine (:class:`rlhf_mcore.rollout.native.engine.NativeRolloutEngine`) on
every rank, with its own weights (`reward.judge.model_path`, any supported causal LM), colocated with the
policy's: asleep (KV cache released) except while it scores. Each rank judges a contiguous share of the step's rows
(one replica per rank, no tensor parallelism) and the scores are all-gathered, so every rank ends with the same
rewards.

The judge's prompt is `reward.judge.prompt_template` with `{prompt}` (the row's last user message), `{response}`
(the policy's response, special tokens removed) and `{ground_truth}` filled in, sent as one user turn through the
judge's chat template; it answers greedily (`temperature` 0 by default) in at most `max_new_tokens` tokens.

Parsers (:func:`register_judge_parser`; `reward.judge.parser` picks one) map the verdict text to a float or None:

- `score_tag`: the number in the last `<score>...</score>`;
- `rating`: the number after the last "score:" or "rating:" (any case);
- `yes_no`: 1.0 when the verdict's first word is "yes", 0.0 when it is "no".

A verdict the parser cannot read (None, or not a finite number) scores 0 and is counted
(`judge/num_unparseable`, `judge/unparseable_fraction`; the first such verdict is logged once per step). The
judge's score is combined with the rule score as a reward model's is
(:func:`rlhf_mcore.rewards.reward_model.combine`, with `reward.judge.data_sources`, `reward_weight`,
`rule_weight`).
"""
from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

from rlhf_mcore.registry import Registry
from rlhf_mcore.rewards.judge_template import TEMPLATE_FIELDS, check_template
from rlhf_mcore.rewards.reward_model import combine

__all__ = ["register_judge_parser", "get_judge_parser", "list_judge_parsers", "JudgeScorer",
           "render_judge_prompt", "check_template", "TEMPLATE_FIELDS"]

logger = logging.getLogger(__name__)

_PARSERS: Registry[Callable[[str], Optional[float]]] = Registry(
    "judge parser", "Register one with @rlhf_mcore.rewards.judge.register_judge_parser(...) in a trainer.plugins file")


def register_judge_parser(name: str, override: bool = False):
    """Decorator: `fn(verdict_text) -> float | None` under `name` (None: unparseable)."""
    def decorator(fn):
        _PARSERS.add(name, fn, override=override)
        return fn
    return decorator


def get_judge_parser(name: str):
    return _PARSERS.get(name, key="reward.judge.parser")


def list_judge_parsers() -> list[str]:
    return _PARSERS.names()


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"


@register_judge_parser("score_tag")
def _score_tag(text: str) -> Optional[float]:
    found = re.findall(rf"<score>\s*({_NUMBER})\s*</score>", text)
    return float(found[-1]) if found else None


@register_judge_parser("rating")
def _rating(text: str) -> Optional[float]:
    found = re.findall(rf"(?:score|rating)\s*[:=]\s*({_NUMBER})", text, flags=re.IGNORECASE)
    return float(found[-1]) if found else None


@register_judge_parser("yes_no")
def _yes_no(text: str) -> Optional[float]:
    words = re.findall(r"[a-z]+", text.lower())
    return {"yes": 1.0, "no": 0.0}.get(words[0]) if words else None


def render_judge_prompt(template: str, messages: Any, response: str, ground_truth: Any) -> str:
    """The template filled for one row; `{prompt}` is the last user message's content."""
    users = [m["content"] for m in (messages or []) if isinstance(m, dict) and m.get("role") == "user"]
    return template.format(prompt=users[-1] if users else "", response=response,
                           ground_truth="" if ground_truth is None else ground_truth)


class JudgeScorer:
    """A judge engine, its tokenizer, the template and the parser; see the module docstring."""

    def __init__(self, engine, judge_tokenizer, policy_tokenizer, cfg, state=None):
        from rlhf_mcore.rollout.base import SamplingParams

        check_template(cfg.prompt_template)
        self.engine, self.tok, self.policy_tok, self.cfg, self.state = engine, judge_tokenizer, policy_tokenizer, \
            cfg, state
        self.parser = get_judge_parser(cfg.parser)
        self.params = SamplingParams(n=1, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
        self.engine.sleep(1)

    def covers(self, data_source: str) -> bool:
        return not self.cfg.data_sources or data_source in self.cfg.data_sources

    def verdicts(self, prompts: list[str]) -> list[str]:
        """The judge's answers to `prompts` (each one user turn), generated with the engine awake."""
        ids = []
        for p in prompts:
            t = self.tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True)
            ids.append(list(t["input_ids"] if hasattr(t, "keys") else t))
        self.engine.wake()
        try:
            outs = self.engine.generate(ids, self.params)
        finally:
            self.engine.sleep(1)
        return [self.tok.decode(o.samples[0].token_ids, skip_special_tokens=True) for o in outs]

    def parse(self, verdicts: list[str]) -> tuple[list[float], list[int]]:
        """(scores, positions of the unparseable verdicts, which score 0)."""
        scores, bad = [], []
        for i, v in enumerate(verdicts):
            try:
                s = self.parser(v)
            except Exception:  # a user parser's bug on one verdict: counted like an unreadable verdict
                s = None
            if s is None or not isinstance(s, (int, float)) or not math.isfinite(float(s)):
                bad.append(i)
                s = 0.0
            scores.append(float(s))
        return scores, bad

    def score_rows(self, rows, items) -> dict[str, float]:
        """Judge the covered rows and set each row's `score` (the rule score stays in `reward_extra["acc"]`)."""
        import torch.distributed as dist

        for r in rows:
            r.reward_extra.setdefault("acc", r.score)
        covered = [r for r in rows if self.covers(items[r.prompt_pos]["data_source"])]
        prompts = [render_judge_prompt(self.cfg.prompt_template, items[r.prompt_pos].get("raw_prompt"),
                                       self.policy_tok.decode(r.response_ids, skip_special_tokens=True),
                                       items[r.prompt_pos].get("ground_truth")) for r in covered]
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        share = np.array_split(np.arange(len(prompts)), world)[rank].tolist()
        verdicts = self.verdicts([prompts[i] for i in share]) if share else []
        if world > 1:
            parts: list = [None] * world
            dist.all_gather_object(parts, verdicts, group=getattr(self.state, "cpu_group", None))
            verdicts = [v for part in parts for v in part]
        scores, bad = self.parse(verdicts)
        if bad and rank == 0:
            logger.warning("judge: %d of %d verdicts could not be read by parser %r (scored 0); e.g. %r",
                           len(bad), len(verdicts), self.cfg.parser, verdicts[bad[0]][:200])
        for r, s in zip(covered, scores, strict=True):
            r.reward_extra["judge_score"] = s
            r.score = combine([r.reward_extra["acc"]], [s], self.cfg.reward_weight, self.cfg.rule_weight)[0]
        n = max(len(covered), 1)
        return {"judge/num_scored": float(len(covered)), "judge/num_unparseable": float(len(bad)),
                "judge/unparseable_fraction": len(bad) / n,
                "judge/score_mean": float(np.mean(scores)) if scores else 0.0}
