"""The judge's prompt template: its fields and their check (`reward.judge.prompt_template`).

Apart from :mod:`rlhf_mcore.rewards.judge` (which builds the judge engine) so that the config can check a template
without importing an engine or torch.
"""
from __future__ import annotations

import string

TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")


def check_template(template: str) -> None:
    """Raise ValueError unless `template` uses only {prompt}, {response}, {ground_truth} (and {{ }} escapes)."""
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"reward.judge.prompt_template is not a valid format string ({e}); write literal braces "
                         "as {{ and }}") from None
    unknown = sorted(names - set(TEMPLATE_FIELDS))
    if unknown:
        raise ValueError(f"reward.judge.prompt_template uses {unknown}; the fields are {list(TEMPLATE_FIELDS)} "
                         "(write literal braces as {{ and }})")
    if "response" not in names:
        raise ValueError("reward.judge.prompt_template has no {response}: the judge would not see what it scores")
