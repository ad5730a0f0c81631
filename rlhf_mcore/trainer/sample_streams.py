"""What the fully asynchronous rollout streams, behind one interface its worker drives
(:meth:`rlhf_mcore.trainer.rollout_worker.RolloutWorker.run_fully_async`): single-turn samples on the native
engine's stream (:class:`SampleStream`), or agent-loop trajectories (:class:`TrajectoryStream`, multi_turn.enable).

Both hand back finished samples as rows (`Row`, score not set yet) whose `versions` give, per response token, the
policy version that sampled it, and both pause at a weight sync (partial rollout):

- single-turn: every sample in the engine is aborted with its tokens so far and continued under the new weights
  from those tokens (the engine's continuation: the same random stream, each new token sampled and scored by the
  new weights);
- trajectories: the model turns in the engine are paused and continued exactly so (a turn's tokens may span two
  versions); tool calls in flight are not interrupted: they finish, and the trajectory's next turn runs under the
  weights of its time. So a trajectory's tokens may span several versions, each model token's rollout log-prob
  is the one of the policy that sampled it (what the off-policy correction needs), and its staleness counts from
  its oldest model token (message tokens carry the version of the model token before them).

Without partial rollout (`async_training.partial_rollout=false`) the worker stops starting work at a sync and
waits for the engine to drain (`drained`): single-turn samples finish, and for trajectories the turns in the engine
finish under the old weights while no new turn starts (`step(submit=False)`), the next turns then run under the new
ones.
"""
from __future__ import annotations

from typing import Optional

from rlhf_mcore.data.rows import Row
from rlhf_mcore.rollout.base import FINISH_ABORT, Finished, Request, Sample, SamplingParams


def continuation(f: Finished) -> Request:
    """A paused sample (an aborted `Finished`) resumes from the tokens it has, their log-probs kept."""
    r = f.request
    return Request(request_id=r.request_id, prompt_ids=r.prompt_ids, sample=r.sample, tag=r.tag,
                   max_new_tokens=r.max_new_tokens,
                   prefix=Sample(list(f.sample.token_ids), list(f.sample.logprobs), FINISH_ABORT, f.sample.routes))


class Stream:
    """The interface the rollout worker drives; `engine` is the rollout engine the stream submits to."""

    engine = None

    @property
    def load(self) -> int:
        """How much work is unfinished (what a new group waits to have room for)."""
        raise NotImplementedError

    def drained(self) -> bool:
        """Nothing left in the engine (the wait without partial rollout)."""
        return self.engine.num_pending == 0

    def add(self, uid: int, item: dict, budget: Optional[int]) -> None:
        """Start the `n` samples of a granted prompt (`budget`: the row's own response cap, or None)."""
        raise NotImplementedError

    def step(self, submit: bool = True) -> list[tuple[int, Row]]:
        """Advance; the rows finished since the last call (`submit=False`: start no new engine work)."""
        raise NotImplementedError

    def pause(self) -> None:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SampleStream(Stream):
    """Single-turn samples: each granted prompt is `params.n` requests (request id: the group's uid)."""

    def __init__(self, engine, params: SamplingParams):
        self.engine, self.n = engine, params.n
        self.version = -1  # the policy version of the engine's weights
        self.prompts: dict[int, list[int]] = {}  # uid -> prompt ids, while some sample of it is unfinished
        self.versions: dict[int, list[list[int]]] = {}  # uid -> per sample, the version of each token so far
        self.left: dict[int, int] = {}  # uid -> samples unfinished
        self.paused: list[Finished] = []

    @property
    def load(self) -> int:
        """Samples in the engine (what a new group waits to have room for)."""
        return self.engine.num_pending

    def add(self, uid: int, item: dict, budget: Optional[int]) -> None:
        self.prompts[uid] = list(item["input_ids"])
        self.versions[uid] = [[] for _ in range(self.n)]
        self.left[uid] = self.n
        self.engine.submit([Request(request_id=uid, prompt_ids=self.prompts[uid], sample=j, tag=uid,
                                    max_new_tokens=budget) for j in range(self.n)])

    def step(self, submit: bool = True) -> list[tuple[int, Row]]:
        """One engine step; the samples that finished, as (uid, row)."""
        if not self.engine.num_pending:
            return []
        finished = self.engine.step()
        self._record(finished)
        out = []
        for f in finished:
            uid, j, s = f.request.tag, f.request.sample, f.sample
            out.append((uid, Row(0, j, self.prompts[uid], list(s.token_ids), list(s.logprobs), s.finish_reason,
                                 versions=list(self.versions[uid][j]), routes=s.routes)))
            self.left[uid] -= 1
            if not self.left[uid]:
                del self.prompts[uid], self.versions[uid], self.left[uid]
        return out

    def pause(self) -> None:
        """Everything out of the engine, its tokens so far recorded under `version`, kept for `resume`."""
        paused = self.engine.abort()
        self._record(paused)
        self.paused += paused

    def resume(self) -> None:
        """The paused samples back into the engine, continued from their tokens."""
        self.engine.submit([continuation(f) for f in self.paused])
        self.paused = []

    def close(self) -> None:
        pass

    def _record(self, finished: list[Finished]) -> None:
        """The tokens each sample gained since its last record were sampled by `version`."""
        for f in finished:
            versions = self.versions[f.request.tag][f.request.sample]
            versions.extend([self.version] * (len(f.sample.token_ids) - len(versions)))


class TrajectoryStream(Stream):
    """Agent-loop trajectories (:class:`rlhf_mcore.agents.AgentStream`): `params.n` per granted prompt, keyed
    `uid * n + j`; rows carry their response masks (0 on tool / environment tokens) and `agent` stats."""

    def __init__(self, runner, params: SamplingParams):
        from rlhf_mcore.agents.runner import AgentStream

        self.n = params.n
        self.agents = AgentStream(runner, params, self._finished)
        self.engine = runner.engine
        self.done: list[tuple[int, Row]] = []

    @property
    def version(self) -> int:
        return self.agents.version

    @version.setter
    def version(self, v: int) -> None:
        self.agents.version = v

    @property
    def load(self) -> int:
        """Trajectories unfinished (in a model turn, waiting for one, or in their tool calls)."""
        return self.agents.unfinished

    def add(self, uid: int, item: dict, budget: Optional[int]) -> None:
        """`budget` (a row's own response cap) is not used: a trajectory's budget is data.max_response_length, as
        in the synchronous trainer's agent loops."""
        self.agents.add(list(item["input_ids"]), item, uid)

    def step(self, submit: bool = True) -> list[tuple[int, Row]]:
        """One round of the scheduler (`submit=False`: no new model turn starts); the trajectories that finished,
        as (uid, row)."""
        self.agents.pump(submit=submit)
        out, self.done = self.done, []
        return out

    def pause(self) -> None:
        self.agents.pause()

    def resume(self) -> None:
        pass  # paused turns wait first in line: the next step submits them

    def close(self) -> None:
        self.agents.close()

    def _finished(self, key: int, t) -> None:
        from rlhf_mcore.agents.rollout import trajectory_info

        uid, j = divmod(key, self.n)
        self.done.append((uid, Row(0, j, list(t.prompt_ids), list(t.response_ids), list(t.logprobs), t.finish_reason,
                                   versions=list(t.versions), response_mask=list(t.response_mask),
                                   agent=trajectory_info(t))))
