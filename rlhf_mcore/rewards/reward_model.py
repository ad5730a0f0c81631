"""Discriminative reward models in the RL loop (`reward_model.enable`): scoring rollouts and combining the score
with the rule reward.

The model is a Hugging Face `*ForSequenceClassification` directory with one label (Qwen2, Llama, Qwen3; e.g.
written by `launch/train_rm.py`), built on the train engine with the actor's TP / PP layout
(:class:`rlhf_mcore.engine.reward_engine.RewardEngine`, frozen, no optimizer) and read at each sequence's last
token, as transformers' sequence classifiers do.

What the reward model reads (:func:`rm_token_ids`):

- `reward_model.model.input_tokenizer` unset: the policy's own token ids, prompt (chat template with the
  generation prompt) followed by the response as generated (its end-of-turn token included). The reward model's
  tokenizer must then be the policy's: a different vocabulary is refused when the scorer is built.
- set (the policy's tokenizer path): the response is decoded with that tokenizer (special tokens skipped) and the
  conversation — the row's prompt messages plus `{"role": "assistant", "content": response}` — is rendered with
  the reward model's chat template (`apply_chat_template(messages)`, as veRL does), then tokenized by the reward
  model's tokenizer.

Inputs longer than `reward_model.max_length` keep their first `max_length` tokens (counted:
`reward_model/num_truncated`).

How the score becomes the reward (:func:`combine`): a row whose `data_source` is in `reward_model.data_sources`
(every row when the list is empty) gets `reward_weight * rm_score + rule_weight * rule_score`; other rows keep
the rule score. `rule_score` is what the rule reward (by data_source, or `reward.custom_reward_function`)
returned; it stays in the row's `reward_extra["acc"]`, so dynamic sampling's `acc` metric is unchanged by the
reward model, and each step logs its mean over the rows the model scored, `reward_model/rule_score_mean`, beside
the model's `reward_model/score_mean` (a model score that climbs while the rule score does not is reward hacking).

Every rank holds all rows of a step; each data-parallel replica scores a contiguous share and the scores are
all-gathered, so every rank ends with the same rewards. In the asynchronous trainers the reward model lives on the
training pool, and each data-parallel replica scores the rows it pulled from the data bus
(`score_rows(..., local=True)`). With `reward_model.megatron.param_offload` the weights live on the host and come
to the device only while scoring.

Scoring while the rollout generates (:class:`StreamingBatches`, the synchronous trainer on a streaming engine): the
finished samples of a rollout replica gather, and every `micro_batch_size_per_gpu` of them are scored at once,
between two engine steps, by the reward-model replica made of the same ranks; the rest (less than one batch) right
after the last sample. The rollout is awake meanwhile, as it is for scoring after generation: the reward model's
weights are on the device all along (it is not in the rollout's offload plan), so the peak memory is the one of
scoring after generation. This needs every rank of the reward model's model-parallel group to see the same finished
samples in the same order, which holds exactly when that group is a rollout replica (TP x PP of the reward model =
`rollout.tensor_model_parallel_size`, the same consecutive ranks). Otherwise, and with `param_offload` (streamed
batches would copy the weights to the device once per batch instead of once per step), the reward model scores
after generation and the reason is logged once (:attr:`RewardModelScorer.streaming_blocker`). Metrics:
`reward_model/num_streamed_batches` (forward calls during generation) and `reward_model/num_scored_after` (rows
scored after generation); the seconds scoring took after the last sample are in `timing_s/reward_tail`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch.distributed as dist

from rlhf_mcore.rewards.errors import RewardError

__all__ = ["RewardModelError", "RewardModelScorer", "StreamingBatches", "combine", "rm_token_ids",
           "check_reward_model_dir", "score_sequences", "streaming_blocker"]


class RewardModelError(RewardError):
    """The reward model cannot be used as configured (missing directory, wrong head, tokenizer mismatch)."""


def check_reward_model_dir(path: str, key: str = "reward_model.model.path") -> None:
    """`path` must be a local `*ForSequenceClassification` directory with num_labels=1 and a `score.weight`."""
    import json

    from rlhf_mcore.models.hf_config import SEQUENCE_CLASSIFICATION_ARCHITECTURE
    from rlhf_mcore.models.hf_loader import SafetensorsCheckpoint

    p = Path(path)
    if not (p / "config.json").is_file():
        raise RewardModelError(
            f"{key}={path!r} is not a Hugging Face model directory (no config.json there): point it at a "
            f"*ForSequenceClassification directory, e.g. one written by `launch/train_rm.py --out DIR`.")
    cfg = json.loads((p / "config.json").read_text())
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in SEQUENCE_CLASSIFICATION_ARCHITECTURE.values():
        raise RewardModelError(
            f"{key}={path!r} is a {arch}, not a reward model: give a directory whose config.json names one of "
            f"{sorted(SEQUENCE_CLASSIFICATION_ARCHITECTURE.values())} (train one with launch/train_rm.py).")
    labels = cfg.get("num_labels", len(cfg.get("id2label") or {0: 0}))
    if labels != 1:
        raise RewardModelError(f"{key}={path!r} has num_labels={labels}; a reward model has one label (one score).")
    if "score.weight" not in SafetensorsCheckpoint(p):
        raise RewardModelError(f"{key}={path!r} has no `score.weight` tensor: its score head is missing.")


def rm_token_ids(prompt_ids: Sequence[int], response_ids: Sequence[int], messages: Any = None, *,
                 input_tokenizer=None, rm_tokenizer=None) -> list[int]:
    """The reward model's input for one row (module docstring): the policy's ids, or, with `input_tokenizer`,
    the conversation re-templated with `rm_tokenizer`'s chat template."""
    if input_tokenizer is None:
        return [*prompt_ids, *response_ids]
    if not isinstance(messages, list):
        raise RewardModelError("re-templating for the reward model (reward_model.model.input_tokenizer) needs the "
                               "row's prompt as a list of chat messages")
    text = input_tokenizer.decode(list(response_ids), skip_special_tokens=True)
    ids = rm_tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": text}], tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def combine(rule_scores: Sequence[float], rm_scores: Sequence[float | None], reward_weight: float,
            rule_weight: float) -> list[float]:
    """Each row's reward: `reward_weight * rm + rule_weight * rule` where the reward model scored it (not None),
    else the rule score."""
    return [rule if rm is None else reward_weight * rm + rule_weight * rule
            for rule, rm in zip(rule_scores, rm_scores, strict=True)]


class RewardModelScorer:
    """A frozen reward model on the train engine and the rules above. Built by
    :func:`rlhf_mcore.trainer.roles.build_rm_scorer`.
    `streaming_blocker`: why it cannot score during generation (:func:`streaming_blocker`), None when it can."""

    def __init__(self, engine, state, rm_cfg, rm_tokenizer, input_tokenizer=None, streaming_blocker: str | None = None):
        self.engine, self.state, self.cfg = engine, state, rm_cfg
        self.rm_tokenizer, self.input_tokenizer = rm_tokenizer, input_tokenizer
        self.offload = bool(rm_cfg.megatron.param_offload)
        self.streaming_blocker = streaming_blocker
        if self.offload:
            self.engine.offload(params=True)

    def covers(self, data_source: str) -> bool:
        return not self.cfg.data_sources or data_source in self.cfg.data_sources

    def inputs(self, rows, items) -> tuple[list[list[int]], list[bool]]:
        """Token ids for each row (`rows[i].prompt_ids/.response_ids`, `items[rows[i].prompt_pos]["raw_prompt"]`),
        cut to max_length; and whether each was cut."""
        out, cut = [], []
        for r in rows:
            ids = rm_token_ids(r.prompt_ids, r.response_ids, items[r.prompt_pos].get("raw_prompt"),
                               input_tokenizer=self.input_tokenizer, rm_tokenizer=self.rm_tokenizer)
            cut.append(self.cfg.max_length is not None and len(ids) > self.cfg.max_length)
            out.append(ids[:self.cfg.max_length] if cut[-1] else ids)
        return out, cut

    @property
    def pad_token_id(self) -> int:
        return self.rm_tokenizer.pad_token_id if self.rm_tokenizer.pad_token_id is not None else 0

    def score_ids(self, sequences: list[list[int]]) -> list[float]:
        """Scores of token sequences, all ranks together (see :func:`score_sequences`)."""
        return score_sequences(self.engine, self.state, sequences, self.pad_token_id, offload=self.offload)

    def record(self, rows, items) -> None:
        """Score `rows` (all covered) on this rank's model replica alone, every rank of it with the same rows, and
        keep each score in the row's `reward_extra["rm_score"]` (`rm_truncated` when its input was cut)."""
        seqs, cut = self.inputs(rows, items)
        for r, s, c in zip(rows, forward_scores(self.engine, seqs, self.pad_token_id, offload=self.offload), cut,
                           strict=True):
            r.reward_extra["rm_score"] = s
            if c:
                r.reward_extra["rm_truncated"] = True

    def score_rows(self, rows, items, *, local: bool = False) -> dict[str, float]:
        """Score the rows this reward model covers and set each row's `score` by :func:`combine` (the rule score
        stays in `reward_extra["acc"]`); rows scored while they were generated (`rm_score` already set, the same on
        every rank) are only combined. All ranks call this together. Returns `reward_model/*` metrics.

        `local=False`: every rank holds the step's rows (the synchronous trainer); data-parallel replicas share the
        work. `local=True`: each data-parallel replica holds its own rows (the asynchronous trainers' training
        pool), scored on this rank's replica alone; the metrics are then gathered over the replicas, so they
        describe the whole step's rows and are the same on every rank."""
        covered = [r for r in rows if self.covers(items[r.prompt_pos]["data_source"])]
        for r in rows:
            r.reward_extra.setdefault("acc", r.score)
        todo = [r for r in covered if "rm_score" not in r.reward_extra]
        n_todo = len(todo)
        if todo:
            seqs, cut = self.inputs(todo, items)
            scored = (forward_scores(self.engine, seqs, self.pad_token_id, offload=self.offload) if local
                      else self.score_ids(seqs))
            for r, s, c in zip(todo, scored, cut, strict=True):
                r.reward_extra["rm_score"] = s
                if c:
                    r.reward_extra["rm_truncated"] = True
        scores = [r.reward_extra["rm_score"] for r in covered]
        for r, s in zip(covered, scores):
            r.score = combine([r.reward_extra["acc"]], [s], self.cfg.reward_weight, self.cfg.rule_weight)[0]
        truncated = sum("rm_truncated" in r.reward_extra for r in covered)
        pairs = [(s, r.reward_extra["acc"]) for s, r in zip(scores, covered)]  # (reward model's, rule's)
        if local:
            pairs, n_todo, truncated = self.gather_replicas(pairs, n_todo, truncated)
        metrics = {"reward_model/num_scored": float(len(pairs)), "reward_model/num_scored_after": float(n_todo)}
        if pairs:
            scores, rules = (np.array(x) for x in zip(*pairs))
            # the rule score of the same rows beside the model's: a model score that rises while the rule score
            # does not is reward hacking, visible while training
            metrics.update({"reward_model/score_mean": float(scores.mean()),
                            "reward_model/score_std": float(scores.std()),
                            "reward_model/rule_score_mean": float(rules.mean()),
                            "reward_model/num_truncated": float(truncated)})
        return metrics

    def gather_replicas(self, scores: list, n_todo: int, truncated: int) -> tuple[list, int, int]:
        """Each data-parallel replica's (scores, rows scored now, rows truncated), gathered over all ranks (one
        rank per replica counted) and summed; `scores` are per-row entries of any picklable kind."""
        if not dist.is_initialized() or dist.get_world_size(self.state.cpu_group) == 1:
            return scores, n_todo, truncated
        parts: list = [None] * dist.get_world_size(self.state.cpu_group)
        dist.all_gather_object(parts, (self.state.dp_rank, scores, n_todo, truncated), group=self.state.cpu_group)
        by_dp = {p[0]: p[1:] for p in parts}
        return ([s for d in sorted(by_dp) for s in by_dp[d][0]], sum(p[1] for p in by_dp.values()),
                sum(p[2] for p in by_dp.values()))


class StreamingBatches:
    """A rollout replica's finished samples, scored by the reward model a micro-batch at a time while the rest are
    generated (module docstring). Every rank of the replica hands in the same rows in the same order."""

    def __init__(self, scorer: RewardModelScorer, items: Sequence[dict]):
        self.scorer, self.items = scorer, items
        self.size = scorer.cfg.micro_batch_size_per_gpu or 1
        self.pending: list = []
        self.num_batches = 0  # forward calls made

    def add(self, rows) -> None:
        """Rows that just finished: the covered ones wait; every full batch is scored now."""
        self.pending += [r for r in rows if self.scorer.covers(self.items[r.prompt_pos]["data_source"])]
        while len(self.pending) >= self.size:
            batch, self.pending = self.pending[:self.size], self.pending[self.size:]
            self._score(batch)

    def flush(self) -> None:
        """After the last sample: score what is left (less than one batch)."""
        if self.pending:
            batch, self.pending = self.pending, []
            self._score(batch)

    def _score(self, rows) -> None:
        self.scorer.record(rows, self.items)
        self.num_batches += 1


def streaming_blocker(state, rollout_tp: int, offload: bool) -> str | None:
    """Why a reward model on `state`'s layout cannot score batches between the rollout's engine steps, or None when
    it can: with `offload` (its weights on the host), or when its model-parallel group (TP x PP) is not one rollout
    replica (`rollout_tp` consecutive ranks). All ranks call this together (one gather over the CPU group), so all
    give the same answer."""
    if offload:
        return ("reward_model.megatron.param_offload=true keeps the reward model's weights on the host during "
                "generation: it scores once after generation (one copy of the weights to the device, not one per "
                "micro-batch)")
    if state is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    group = sorted(dist.get_process_group_ranks(state.mp_group))
    replica = state.rank // rollout_tp
    mine = group == list(range(replica * rollout_tp, (replica + 1) * rollout_tp))
    everyone: list = [None] * dist.get_world_size(state.cpu_group)
    dist.all_gather_object(everyone, mine, group=state.cpu_group)
    if all(everyone):
        return None
    return (f"the reward model's model-parallel group (TP {state.dims.tp} x PP {state.dims.pp}) is not a rollout "
            f"replica (actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp} consecutive ranks), so its "
            f"ranks do not see the same finished samples at the same time: it scores after generation")


def forward_scores(engine, sequences: list[list[int]], pad_token_id: int, *, offload: bool = False) -> list[float]:
    """Scores of `sequences` by one model replica (its ranks all call this with the same list), padded to whole
    micro-batches (the extra rows dropped). `offload`: the parameters come to the device for this call only."""
    from rlhf_mcore.data.batch import sequence_batch

    if not sequences:
        return []
    local = list(sequences)
    multiple = engine.cfg.fwd_micro_batch_size * (engine.state.dims.pp if len(engine.modules) > 1 else 1)
    local += [local[-1]] * (-len(local) % multiple)
    if offload:
        engine.onload(params=True)
    try:
        return [float(x) for x in engine.compute_scores(sequence_batch(local, pad_token_id))[:len(sequences)].tolist()]
    finally:
        if offload:
            engine.offload(params=True)


def score_sequences(engine, state, sequences: list[list[int]], pad_token_id: int, *,
                    offload: bool = False) -> list[float]:
    """Scores of token sequences by a reward engine, all ranks together (every rank passes the same list; each
    data-parallel replica scores a contiguous share, :func:`forward_scores`); every rank returns all scores.
    `offload`: the engine's parameters are on the host, brought to the device for this call only."""
    dims = state.dims
    share = np.array_split(np.arange(len(sequences)), dims.dp)[state.dp_rank].tolist()
    mine = forward_scores(engine, [sequences[i] for i in share], pad_token_id, offload=offload)
    if dims.dp == 1:
        return mine
    parts: list = [None] * dist.get_world_size(state.cpu_group)
    dist.all_gather_object(parts, (state.dp_rank, mine), group=state.cpu_group)
    by_dp = dict(parts)
    return [s for d in range(dims.dp) for s in by_dp[d]]
