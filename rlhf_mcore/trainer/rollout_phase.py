"""Generation and scoring across rollout replicas.

The world is split into rollout replicas of ``rollout.tensor_model_parallel_size`` consecutive ranks. Every rank
knows the whole step's prompt list (the coordinator's plan); each replica generates its contiguous share,
its first rank scores the responses, and one all-gather of token lists over the CPU group gives every rank the
rows it trains on. Nothing passes through rank 0.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch.distributed as dist

from rlhf_mcore.data.rows import Row
from rlhf_mcore.models.tokenizer import decode_texts
from rlhf_mcore.rewards.pipeline import set_rule_scores
from rlhf_mcore.rewards.scorer import failure_error
from rlhf_mcore.rollout.base import SamplingParams


def response_budgets(items: Sequence[dict[str, Any]], limit: int) -> Optional[list[int]]:
    """Per-prompt response budgets from `extra_info.max_response_length` (a row's own cap, e.g. a benchmark's
    long-tailed lengths), each at most `limit` (data.max_response_length); None when no row sets one."""
    caps = [(it.get("extra_info") or {}).get("max_response_length") for it in items]
    if all(c is None for c in caps):
        return None
    return [limit if c is None else max(1, min(int(c), limit)) for c in caps]


# the native engine's counters of one generation (`last_stats`) reported as step metrics: counts as
# `rollout_engine/*`, seconds as `timing_s/rollout_engine/*` (wall-clock metrics share the `timing_s/` prefix)
ENGINE_COUNTS = ("decode_steps", "prefills", "graph_captures")
ENGINE_SECONDS = {"prefill_s": "prefill", "decode_s": "decode"}
ENGINE_METRIC_PREFIXES = ("rollout_engine/", "timing_s/rollout_engine/")


def engine_counters(engine) -> dict[str, float]:
    """The rollout engine's counters of its last generation as step metrics (summed over rollout replicas by the
    caller): decode steps, prefills, decode CUDA graphs captured (above 0 at every step means they are captured
    again each step, e.g. after the engine's sleep drops them) and prefill / decode seconds. {} for an engine
    without counters (the HF and SGLang backends)."""
    st = getattr(engine, "last_stats", None) or {}
    out = {f"rollout_engine/{k}": float(st[k]) for k in ENGINE_COUNTS if isinstance(st.get(k), (int, float))}
    out.update({f"timing_s/rollout_engine/{name}": float(st[k]) for k, name in ENGINE_SECONDS.items()
                if isinstance(st.get(k), (int, float))})
    return out


def _replica_layout(world: int, rank: int, rollout_tp: int) -> tuple[int, int, int]:
    """(number of replicas, this rank's replica, rank within the replica)."""
    return world // rollout_tp, rank // rollout_tp, rank % rollout_tp


def generate_and_score(engine, scorer, prompts: Sequence[list[int]], meta: Sequence[dict[str, Any]],
                       params: SamplingParams, tokenizer, *, rollout_tp: int, group=None,
                       greedy_baseline: bool = False, agent_runner=None,
                       reward_model=None) -> tuple[list[Row], dict[str, float]]:
    """Generate ``params.n`` samples for every prompt (all ranks call this together) and score them.

    ``meta[i]`` holds ``data_source``, ``ground_truth`` and ``extra_info`` of prompt ``i``. Returns all rows of
    all prompts, ordered by (prompt, sample), on every rank, plus the scorer's counters. Each row's score is the
    reward pipeline's first stage (:func:`rlhf_mcore.rewards.pipeline.set_rule_scores`); the caller composes the
    rest (:func:`rlhf_mcore.rewards.pipeline.compose`).
    ``agent_runner`` (multi-turn, :mod:`rlhf_mcore.agents`): rows are agent-loop trajectories with their response
    masks; a trajectory that scored itself (an environment) keeps its reward as its rule score.
    ``reward_model`` (a :class:`rlhf_mcore.rewards.reward_model.RewardModelScorer` that can stream, i.e. whose
    `streaming_blocker` is None): on the streaming path its micro-batches are scored as samples finish, each
    score kept in the row's `reward_extra["rm_score"]` for its `score_rows` to combine; stats then count the
    forward calls (`reward_model/num_streamed_batches`, summed over rollout replicas). Elsewhere it is unused.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    replicas, replica, sub_rank = _replica_layout(world, rank, rollout_tp)
    share = np.array_split(np.arange(len(prompts)), replicas)[replica].tolist()
    local: list[Row] = []
    stats: dict[str, float] = {}
    scored = False  # the streaming path scores samples as they finish
    if share and agent_runner is not None:
        from rlhf_mcore.agents.rollout import run_scoring_as_they_finish, trajectory_info
        from rlhf_mcore.rewards.stream import ScoringStream

        if greedy_baseline:
            raise ValueError("a greedy baseline (ReMax) is not available with multi-turn rollouts")
        stream = ScoringStream(scorer) if sub_rank == 0 else None  # each trajectory scored as it finishes
        trajs = run_scoring_as_they_finish(agent_runner, [list(prompts[i]) for i in share], [meta[i] for i in share],
                                           params, share, stream, tokenizer)
        for i, per in zip(share, trajs):
            for j, t in enumerate(per):
                local.append(Row(i, j, list(prompts[i]), t.response_ids, t.logprobs, t.finish_reason,
                                 response_mask=t.response_mask, agent=trajectory_info(t)))
        if stream is not None:
            scores, stats = stream.finish()
            set_rule_scores(local, [scores[(r.prompt_pos, r.sample)] for r in local])
            stats = {**stats, **{f"agent_runner/{k}": v for k, v in agent_runner.last_stats.items()}}
        scored = True
    elif share and getattr(engine, "supports_streaming", False) and not greedy_baseline:
        caps = response_budgets([meta[i] for i in share], params.max_new_tokens)
        local, stats = _generate_scoring_as_they_finish(engine, scorer if sub_rank == 0 else None, prompts, share,
                                                        meta, params, tokenizer, caps, reward_model)
        if sub_rank == 0:
            stats = {**stats, **engine_counters(engine)}
        scored = True
    elif share:
        caps = response_budgets([meta[i] for i in share], params.max_new_tokens)
        if caps is not None and not getattr(engine, "supports_streaming", False):
            raise ValueError("rows set extra_info.max_response_length (a per-prompt response budget), which only the "
                             "native rollout engine takes: set actor_rollout_ref.rollout.name=native or drop the key.")
        kw = {"max_new_tokens": caps} if caps is not None else {}
        outs = engine.generate([list(prompts[i]) for i in share], params, request_ids=share, **kw)
        stats = engine_counters(engine) if sub_rank == 0 else {}  # before the greedy baseline's generation
        baselines = None
        if greedy_baseline:
            greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=params.max_new_tokens,
                                    stop_token_ids=params.stop_token_ids)
            baselines = engine.generate([list(prompts[i]) for i in share], greedy, request_ids=share)
        for k, (i, out) in enumerate(zip(share, outs)):
            for j, s in enumerate(out.samples):
                local.append(Row(i, j, list(prompts[i]), list(s.token_ids), list(s.logprobs), s.finish_reason,
                                 routes=s.routes))
            if baselines is not None:
                for row in local[-len(out.samples):]:
                    row.baseline_ids = list(baselines[k].samples[0].token_ids)  # scored below
    if sub_rank == 0 and local and not scored:
        texts = decode_texts(tokenizer, [r.response_ids for r in local])
        m = [meta[r.prompt_pos] for r in local]
        runner_stats = stats
        scores, stats = scorer.score([x["data_source"] for x in m], texts, [x["ground_truth"] for x in m],
                                     [x.get("extra_info") for x in m], check=False)  # checked below, on all ranks
        stats = {**(stats or {}), **runner_stats}
        set_rule_scores(local, scores)
        if greedy_baseline:
            base_texts = decode_texts(tokenizer, [r.baseline_ids for r in local])
            base_scores, base_stats = scorer.score([x["data_source"] for x in m], base_texts,
                                                   [x["ground_truth"] for x in m], [x.get("extra_info") for x in m],
                                                   check=False)
            stats = _merge([stats, base_stats])
            for r, s in zip(local, base_scores):
                r.baseline_score = float(s)
    if world == 1:
        rows, total = local, _merge([stats])
    else:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (local if sub_rank == 0 else [], _portable(stats)), group=group)
        rows = sorted((r for part, _ in gathered for r in part), key=lambda r: (r.prompt_pos, r.sample))
        total = _merge([st for _, st in gathered])
    error = failure_error(total, scorer.max_failure_ratio) if total.get("num_items") else None
    if error is not None:  # the same counts on every rank: every rank stops, with the same message
        raise error
    if agent_runner is not None:  # over all rows (the same on every rank); busy time summed over replicas
        from rlhf_mcore.agents.rollout import agent_metrics

        busy = {k.split("/", 1)[1]: total.pop(k) for k in list(total) if k.startswith("agent_runner/")}
        total.update(agent_metrics([r.agent for r in rows], busy))
    return rows, {k: v for k, v in total.items() if isinstance(v, float)}


def _generate_scoring_as_they_finish(engine, scorer, prompts, share: list[int], meta, params: SamplingParams,
                                     tokenizer, caps, reward_model=None) -> tuple[list[Row], dict]:
    """RewardLoop on a streaming engine: every sample is handed to the reward scorer as it finishes, while the
    engine keeps generating the rest (:class:`rlhf_mcore.rewards.stream.ScoringStream`); `scorer=None` on ranks
    that do not score (a rollout replica's other TP ranks). `reward_model`: its batches are scored between engine
    steps as they fill up, on every rank of the replica (:class:`rlhf_mcore.rewards.reward_model.StreamingBatches`).
    Stats carry `tail_s`, the scoring (rule and reward model) left after the last sample finished."""
    from rlhf_mcore.rewards.stream import ScoringStream
    from rlhf_mcore.rollout.base import Request

    stream = ScoringStream(scorer) if scorer is not None else None
    batches = None
    if reward_model is not None:
        from rlhf_mcore.rewards.reward_model import StreamingBatches

        batches = StreamingBatches(reward_model, meta)
    rows: dict[tuple[int, int], Row] = {}
    engine.open_stream(params)
    try:
        engine.submit([Request(int(i), list(prompts[i]), sample=j, tag=i, max_new_tokens=None if caps is None
                               else caps[k]) for k, i in enumerate(share) for j in range(params.n)])
        while engine.num_pending:
            new = []
            for f in engine.step():
                i, j = f.request.tag, f.request.sample
                rows[(i, j)] = row = Row(i, j, list(prompts[i]), list(f.sample.token_ids), list(f.sample.logprobs),
                                         f.sample.finish_reason, routes=f.sample.routes)
                new.append(row)
            if stream is not None and new:
                m = [meta[r.prompt_pos] for r in new]
                stream.submit([(r.prompt_pos, r.sample) for r in new], [x["data_source"] for x in m],
                              decode_texts(tokenizer, [r.response_ids for r in new]),
                              [x["ground_truth"] for x in m], [x.get("extra_info") for x in m])
            if batches is not None and new:  # between engine steps: the rollout waits for full batches only
                batches.add(new)
    finally:
        engine.close_stream()
    if batches is not None:
        batches.flush()
    local = [rows[k] for k in sorted(rows)]
    if stream is None:
        return local, {}
    scores, stats = stream.finish()
    set_rule_scores(local, [scores[(r.prompt_pos, r.sample)] for r in local])
    if batches is not None:
        stats["reward_model/num_streamed_batches"] = float(batches.num_batches)
    return local, stats


def _portable(stats: dict) -> dict:
    """The counters (floats) and the first failure's description: what other ranks need of a scorer's stats."""
    out: dict = {k: float(v) for k, v in (stats or {}).items() if isinstance(v, (int, float))}
    for key in ("first_failure", "reward_fn"):
        if (stats or {}).get(key) is not None:
            out[key] = stats[key]
    return out


def _merge(parts: Sequence[dict]) -> dict:
    """Counters summed; the first `first_failure` / `reward_fn` kept."""
    total: dict = {}
    for st in parts:
        for k, v in _portable(st).items():
            if isinstance(v, float):
                total[k] = total.get(k, 0.0) + v
            else:
                total.setdefault(k, v)
    return total
