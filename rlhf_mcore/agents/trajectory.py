"""Token-exact multi-turn trajectories.

A trajectory is the prompt's token ids followed by response tokens in the order the model saw them: the
model's own tokens (exactly as sampled, with their rollout log-probs; `response_mask` 1) and the tokens of every
tool / environment / user message added between its turns (`response_mask` 0). Each turn extends the ids of
the previous turns; the history is never re-tokenized.

A new message's tokens come from the chat template: the text the template adds when the message is appended to
the conversation, `render(history + new, add_generation_prompt=True)` minus `render(history)`, checked to be a
prefix extension (else the same difference over a short stand-in history, counted in `template_fallbacks`),
preceded by what the template writes after an assistant turn's end token (Qwen's newline after `<|im_end|>`)
and tokenized on its own. Template-rendered history that differs from what the model saw (Qwen3 dropping
earlier `<think>` blocks, a detokenize/retokenize round trip that changes ids) is never written back: the
trajectory keeps the model's tokens, and :meth:`TrajectoryBuilder.finish` counts such a difference in
`template_drift` (one check of the whole conversation, after the fact).

Policy versions (the asynchronous trainers): each response token carries the version of the policy that sampled it
(`versions`; the runner records them per model token, a turn paused at a weight sync and continued spans two);
message tokens, which no policy sampled, carry the version of the model token before them (the trajectory's first
version when none is), so a trajectory's oldest and newest versions are those of its model tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["Trajectory", "TrajectoryBuilder", "TemplateError", "message_tokens"]

FINISH_STOP, FINISH_LENGTH = "stop", "length"
_STAND_IN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}]


class TemplateError(ValueError):
    """The chat template cannot render a message as an extension of the conversation."""


@dataclass
class Trajectory:
    """One finished rollout of an agent loop (see the module docstring)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]          # 1: the model's token; 0: a tool / environment / user message token
    logprobs: list[float]             # per response token: the rollout log-prob of model tokens, 0.0 elsewhere
    messages: list[dict]              # the conversation (prompt messages, then every turn), decoded
    turns: list[dict]                 # per turn: role, start, end (in response_ids), and what happened
    finish_reason: str                # "stop" | "length" (the response budget) | "turns" (the turn limit)
    reward: Optional[float] = None    # set by loops that score themselves (environments); None: the reward fn
    turn_rewards: list[float] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)  # tool_calls, tool_errors, tool_timeouts, ...
    tool_calls: list[dict] = field(default_factory=list)  # per call: turn, name, arguments (or error), outcome, seconds
    versions: list[int] = field(default_factory=list)  # per response token: the policy version (module docstring)

    @property
    def model_logprobs(self) -> list[float]:
        """One log-prob per model token, in order."""
        return [lp for lp, m in zip(self.logprobs, self.response_mask) if m]


def _render(tokenizer, messages: list[dict], tools: Optional[list[dict]], add_generation_prompt: bool) -> str:
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)


def message_tokens(tokenizer, history: list[dict], new: list[dict], tools: Optional[list[dict]] = None,
                   end_text: Optional[str] = None, open_text: Optional[str] = None) -> tuple[list[int], bool]:
    """Token ids to append after a conversation `history` for the messages `new`, up to the next assistant turn's
    header. The model ended its last turn with the text `end_text` (e.g. "<|im_end|>"), or was cut off by the
    per-turn budget after writing `open_text`: then the ids begin with what the template writes to close that
    turn. Returns (ids, whether the stand-in history was needed)."""
    fallback = False
    base = _render(tokenizer, history, tools, False)
    full = _render(tokenizer, history + new, tools, True)
    if not full.startswith(base):
        fallback = True
        stand_in = _STAND_IN if history and history[-1]["role"] == "assistant" else _STAND_IN[:1]
        base = _render(tokenizer, stand_in, tools, False)
        full = _render(tokenizer, stand_in + new, tools, True)
        if not full.startswith(base):
            raise TemplateError(f"the chat template renders {[m['role'] for m in new]} messages by changing the "
                                f"conversation before them, even after a plain user/assistant exchange; it cannot be "
                                f"used for multi-turn rollouts (template starts {tokenizer.chat_template[:80]!r})")
    glue = ""
    if end_text and history and history[-1]["role"] == "assistant":
        at = base.rfind(end_text)
        if at >= 0 and not base[at + len(end_text):].strip():  # only whitespace after the end token
            glue = base[at + len(end_text):]
    elif open_text is not None and history and history[-1]["role"] == "assistant" and not fallback:
        at = base.rfind(open_text) if open_text else len(base)
        if at >= 0:
            glue = base[at + len(open_text):]  # the template's end of the assistant turn
    ids = tokenizer(glue + full[len(base):], add_special_tokens=False)["input_ids"]
    return list(ids), fallback


class TrajectoryBuilder:
    """Grows one trajectory turn by turn. `max_response_tokens` bounds the whole response (model and message
    tokens); `remaining` is what is left of it."""

    def __init__(self, tokenizer, prompt_messages: list[dict], prompt_ids: list[int], *,
                 max_response_tokens: int, tools: Optional[list[dict]] = None,
                 stop_token_ids: tuple[int, ...] = ()):
        self.tokenizer, self.tools = tokenizer, tools
        self.prompt_ids = list(prompt_ids)
        self.messages: list[dict] = [dict(m) for m in prompt_messages]
        self.max_response_tokens = int(max_response_tokens)
        self.stop_token_ids = set(stop_token_ids)
        self.response_ids: list[int] = []
        self.response_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[dict] = []
        self.turn_rewards: list[float] = []
        self.reward: Optional[float] = None
        self.finish_reason: Optional[str] = None  # set when the trajectory cannot continue
        self.stats: dict[str, float] = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_timeouts": 0.0,
                                        "tool_seconds": 0.0, "template_fallbacks": 0.0}
        self.tool_calls: list[dict] = []  # filled by the runner, one record per call the model made
        self._end_text: Optional[str] = None
        self._open_text: Optional[str] = None  # the last turn's text when the per-turn budget cut it off
        self.key = 0  # keys the trajectory's random streams (set by the runner)
        self.versions: list[int] = []  # per response token (module docstring)
        self.start_version = 0  # the policy version when the trajectory started (set by the runner)

    # ---------------------------------------------------------------------------------------------- state
    @property
    def context_ids(self) -> list[int]:
        """What the model sees next: the prompt and the response so far."""
        return self.prompt_ids + self.response_ids

    @property
    def remaining(self) -> int:
        return self.max_response_tokens - len(self.response_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def assistant_turns(self) -> int:
        return sum(t["role"] == "assistant" for t in self.turns)

    @property
    def user_turns(self) -> int:
        return sum(t["role"] == "user" for t in self.turns)

    # ---------------------------------------------------------------------------------------------- turns
    def set_prompt(self, messages: list[dict]) -> None:
        """Replace the prompt (before the first turn), rendered with the generation prompt (an environment's
        first message belongs to the prompt)."""
        if self.response_ids:
            raise RuntimeError("set_prompt after the first turn: the prompt is what the model has already seen")
        text = _render(self.tokenizer, messages, self.tools, True)
        self.prompt_ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        self.messages = [dict(m) for m in messages]

    def add_model_turn(self, token_ids: list[int], logprobs: list[float], finish_reason: str,
                       cut_by_turn_budget: bool = False, versions: Optional[list[int]] = None) -> str:
        """Append the model's tokens as sampled; returns the turn's text (without its end token). A turn that
        did not end on a stop token ends the trajectory ("length"), unless the per-turn budget cut it
        (`cut_by_turn_budget`) with room left: the next message then closes the turn as the template does.
        `versions`: the policy version of each token (None: `start_version` for all)."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} log-probs")
        versions = [self.start_version] * len(token_ids) if versions is None else [int(v) for v in versions]
        if len(versions) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens but {len(versions)} policy versions")
        self.versions += versions
        start = len(self.response_ids)
        self.response_ids += list(token_ids)
        self.response_mask += [1] * len(token_ids)
        self.logprobs += [float(x) for x in logprobs]
        ends = bool(token_ids) and token_ids[-1] in self.stop_token_ids and finish_reason == FINISH_STOP
        body = token_ids[:-1] if ends else token_ids
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        self._end_text = self.tokenizer.decode(token_ids[-1:], skip_special_tokens=False) if ends else None
        self._open_text = None if ends else text
        self.messages.append({"role": "assistant", "content": text})
        self.turns.append({"role": "assistant", "start": start, "end": len(self.response_ids),
                           "finish_reason": finish_reason})
        if not ends and not (cut_by_turn_budget and finish_reason == FINISH_LENGTH):
            self.finish_reason = FINISH_LENGTH
        elif self.remaining <= 0:
            self.finish_reason = FINISH_LENGTH
        return text

    def add_messages(self, messages: list[dict], role: Optional[str] = None) -> bool:
        """Append tool / environment / user messages (all of one turn at once: templates group consecutive tool
        results) up to the next assistant header. False, and the trajectory ends with "length", when they do not
        fit in the response budget with at least one token left for the model."""
        if self.done:
            raise RuntimeError(f"the trajectory has finished ({self.finish_reason}); nothing can be added")
        ids, fallback = message_tokens(self.tokenizer, self.messages, messages, self.tools, self._end_text,
                                       self._open_text)
        self.stats["template_fallbacks"] += float(fallback)
        if len(ids) >= self.remaining:
            self.finish_reason = FINISH_LENGTH
            return False
        start = len(self.response_ids)
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else self.start_version] * len(ids)
        first = len(self.messages)
        self.messages += [dict(m) for m in messages]
        self.turns.append({"role": role or messages[0]["role"], "start": start, "end": len(self.response_ids),
                           "messages": [first, len(self.messages)]})
        self._end_text = self._open_text = None
        return True

    def stop(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason

    # ---------------------------------------------------------------------------------------------- result
    def template_drift(self) -> bool:
        """Whether templating the whole conversation gives other ids than the trajectory (a check only)."""
        if not self.turns or self.turns[-1]["role"] != "assistant" or self._end_text is None:
            return False  # the template can only close a conversation that ends on a finished assistant turn
        rendered = _render(self.tokenizer, self.messages, self.tools, False)
        at = rendered.rfind(self._end_text)
        if at < 0:
            return True
        ids = self.tokenizer(rendered[:at + len(self._end_text)], add_special_tokens=False)["input_ids"]
        return list(ids) != self.context_ids

    def finish(self, check_drift: bool = True) -> Trajectory:
        self.stop(FINISH_STOP if self._open_text is None else FINISH_LENGTH)  # a cut last turn: "length"
        stats = dict(self.stats)
        stats["turns"] = float(self.assistant_turns)
        stats["template_drift"] = float(check_drift and self.template_drift())
        return Trajectory(self.prompt_ids, self.response_ids, self.response_mask, self.logprobs, self.messages,
                          self.turns, self.finish_reason, self.reward, self.turn_rewards, stats,
                          [dict(c) for c in self.tool_calls], list(self.versions))
