"""The one exception a bad config ends in. Imports nothing heavy (``launch/train.py`` reports it in one line)."""
from __future__ import annotations

from rlhf_mcore.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration a run cannot start with; the message says what to change."""

    kind = "config error"
