"""The one base class for problems with what the user gave (config, files, data, reward functions).

Entry points report a :class:`UserError` as one line naming the input, the problem and the fix (exit code 2,
rank 0 only, no traceback); every other exception is a bug and keeps its traceback. This module imports
nothing, so the error path costs nothing before any model is built.
"""


class UserError(Exception):
    """A problem with the user's input; `kind` prefixes the one-line report."""

    kind = "input error"
