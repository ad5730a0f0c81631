"""User reward functions loaded from a Python file (`reward.custom_reward_function.path` and `.name`).

The function must accept veRL's keywords::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

(a dict must carry a "score"; `**kwargs` is fine). Loading checks the file, the name and the signature up
front; every problem is one :class:`RewardFileError` whose message names the file (and the line, for syntax
errors and failing imports) and says what to fix. The loaded object pickles as its (path, name), so reward
worker processes re-import the file themselves instead of needing it on `sys.path`.
"""
from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import os
import sys
import traceback
from typing import Any

from rlhf_mcore.rewards.errors import RewardFileError

__all__ = ["CustomRewardFunction", "load_custom_reward_fn"]

_EXPECTED = "def {name}(data_source, solution_str, ground_truth, extra_info=None) -> float | dict"


def _import_file(path: str):
    """Import `path` as a module named after its absolute path (one module per file per process)."""
    module_name = "rlhf_mcore_custom_reward_" + hashlib.sha1(path.encode()).hexdigest()[:16]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardFileError(f"reward.custom_reward_function.path={path!r} is not a Python file: point it at the "
                              ".py file that defines the reward function")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        del sys.modules[module_name]
        raise
    except BaseException as exc:  # noqa: B036 - a sys.exit() at import is a broken reward file too
        del sys.modules[module_name]
        raise RewardFileError(_import_failure(path, exc)) from None
    return module


def _import_failure(path: str, exc: BaseException) -> str:
    """One line: where importing the reward file failed (file:line) and why."""
    if isinstance(exc, SyntaxError):  # IndentationError included; may be in a module the file imports
        where = f"{exc.filename or path}, line {exc.lineno}"
        code = f": {exc.text.strip()!r}" if exc.text and exc.text.strip() else ""
        return (f"reward.custom_reward_function.path={path!r} cannot be imported: {type(exc).__name__} at {where}: "
                f"{exc.msg}{code}. Fix the file.")
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if os.path.abspath(f.filename) == path]
    frame = (mine or frames or [None])[-1]
    where = f" at {frame.filename}, line {frame.lineno}" if frame is not None else ""
    message = " ".join(str(exc).split())
    return (f"reward.custom_reward_function.path={path!r} cannot be imported: {type(exc).__name__}{where}: "
            f"{message}. Fix the file (or install what it imports).")


def _resolve(path: str, name: str):
    if not os.path.isfile(path):
        raise RewardFileError(
            f"reward.custom_reward_function.path={path!r} does not exist (relative paths are resolved from "
            f"{os.getcwd()!r}); point it at the .py file that defines {name!r}"
        )
    module = _import_file(path)
    if not hasattr(module, name):
        callables = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        close = difflib.get_close_matches(name, callables, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise RewardFileError(
            f"reward.custom_reward_function.path={path!r} has no function {name!r} "
            f"(reward.custom_reward_function.name); functions in the file: {callables}.{hint}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardFileError(f"reward.custom_reward_function.name={name!r} in {path!r} is a {type(fn).__name__}, "
                              f"not a function; define it as: {_EXPECTED.format(name=name)}")
    try:
        inspect.signature(fn).bind(data_source="", solution_str="", ground_truth="", extra_info=None)
    except TypeError as exc:
        raise RewardFileError(
            f"{path}:{name}{inspect.signature(fn)} cannot be called with veRL's reward keywords ({exc}); define "
            f"it as: {_EXPECTED.format(name=name)}"
        ) from None
    except ValueError:  # builtins without a signature: accept, calls will tell
        pass
    return fn


class CustomRewardFunction:
    """A validated user reward function; call it like the function itself. Picklable by (path, name)."""

    def __init__(self, path: str, name: str = "compute_score"):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.name = name
        self._fn = _resolve(self.path, name)

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        return self._fn(
            data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
        )

    def __getstate__(self) -> dict[str, str]:
        return {"path": self.path, "name": self.name}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.path, self.name = state["path"], state["name"]
        self._fn = _resolve(self.path, self.name)

    def __repr__(self) -> str:
        return f"CustomRewardFunction({self.path!r}, {self.name!r})"


def load_custom_reward_fn(path: str, name: str = "compute_score") -> CustomRewardFunction:
    """Load and validate `name` from the Python file at `path` (see the module docstring)."""
    return CustomRewardFunction(path, name)
