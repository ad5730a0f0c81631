"""Tool calls in Hermes format, as Qwen2.5 emits them::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 2"}}
    </tool_call>

`parse_tool_calls(text)` returns every call of a turn in order: a :class:`ToolCall`, or a :class:`CallError`
(malformed JSON, missing name, arguments not an object, an unclosed tag) that becomes an error message to the
model.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Union

__all__ = ["ToolCall", "CallError", "parse_tool_calls", "has_tool_call", "FORMATS"]

FORMATS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class CallError:
    error: str  # what is wrong, said to the model
    raw: str


def has_tool_call(text: str) -> bool:
    return OPEN in text


def _parse_one(body: str) -> Union[ToolCall, CallError]:
    raw = body.strip()
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return CallError(f"the tool call is not valid JSON ({e.msg} at character {e.pos})", raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return CallError('a tool call must be a JSON object {"name": ..., "arguments": {...}}', raw)
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models send the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return CallError(f"the tool call's arguments are not valid JSON ({e.msg})", raw)
    if not isinstance(args, dict):
        return CallError(f"the arguments of tool {obj['name']!r} must be a JSON object", raw)
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str) -> list[Union[ToolCall, CallError]]:
    """Every `<tool_call>...</tool_call>` block of `text`, parsed; an unclosed last block is an error."""
    calls: list[Union[ToolCall, CallError]] = [_parse_one(m.group(1)) for m in _BLOCK.finditer(text)]
    tail = text[text.rfind(CLOSE) + len(CLOSE):] if CLOSE in text else text
    if OPEN in tail:
        calls.append(CallError(f"the tool call is not closed with {CLOSE}", tail[tail.find(OPEN):]))
    return calls
