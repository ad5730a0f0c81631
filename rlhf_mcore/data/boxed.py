"""The last `\\boxed{...}` of a text: how MATH solutions give their answer. Preprocessing reads the ground truth
with it, the MATH rule reward (:mod:`rlhf_mcore.rewards.math_reward`) the model's answer."""
from __future__ import annotations

__all__ = ["last_boxed_only_string", "last_boxed_content"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) of `text` including the command, or None.

    Braces are matched, so nested groups such as `\\boxed{\\frac{1}{2}}` come out whole; an unclosed box
    gives None.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + len(cmd) :]
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):  # "\boxed 5$" form
        return cmd + " " + rest.lstrip().split("$")[0].strip()
    open_at = start + len(cmd) + (len(rest) - len(rest.lstrip()))
    if open_at >= len(text) or text[open_at] != "{":
        return None
    depth = 0
    for pos in range(open_at, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return text[start : pos + 1]
    return None


def last_boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}` of `text` (without the command and braces), or None."""
    boxed = last_boxed_only_string(text)
    if boxed is None:
        return None
    cmd = next(c for c in _BOX_COMMANDS if boxed.startswith(c))
    body = boxed[len(cmd) :].strip()
    return body[1:-1] if body.startswith("{") else body
