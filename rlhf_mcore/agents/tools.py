"""Tools the model can call: a registry of named tools with OpenAI function schemas, and the YAML tool config.

A tool is a callable taking the call's JSON arguments as keywords and returning the text the model sees::

    @register_tool(name="weather", description="Today's weather in a city.",
                   parameters={"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]})
    def weather(city: str) -> str:
        return f"sunny in {city}"

Its schema (`{"type": "function", "function": {"name", "description", "parameters"}}`) is what the chat template's
`tools` argument receives. A class works too: subclass :class:`Tool`, give `name`, `description`, `parameters`
and `__call__`, decorate the class with `@register_tool()` (constructed with the config's keyword arguments).

This module knows no concrete tool: the built-ins (:mod:`.calculator`, :mod:`.sandbox`) register themselves when
the package `rlhf_mcore.agents` is imported, which every import of this module does first.

`actor_rollout_ref.rollout.multi_turn.tool_config_path` points at a YAML file choosing the tools of a run::

    tools:
      - name: calculator                    # a registered tool
      - name: python
        config: {timeout_s: 5, memory_mb: 512}   # keyword arguments of its constructor (class tools)
      - class_name: my_pkg.tools.Search     # an importable Tool subclass or function (registered on import)
        tool_schema: {...}                  # optional: replaces the tool's own schema (veRL's key)
"""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any, Callable, Optional

from rlhf_mcore.registry import Registry

__all__ = ["Tool", "FunctionTool", "register_tool", "get_tool", "list_tools", "build_tools", "load_tool_config",
           "ToolConfigError"]


class ToolConfigError(ValueError):
    """A tool config that cannot be used; the message names the file, the entry and the fix."""


class Tool:
    """A named function the model can call. Subclasses set `name`, `description`, `parameters` (JSON schema of
    the arguments object) and implement `__call__(**arguments) -> str`. Raising is fine: the caller turns the
    exception into an error message for the model."""

    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}}
    #: seconds one call may take before the model gets a timeout message (None: multi_turn.tool_timeout_s)
    timeout_s: Optional[float] = None

    def schema(self) -> dict:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def __call__(self, **arguments: Any) -> str:  # pragma: no cover - the interface
        raise NotImplementedError(f"tool {self.name!r} does not implement __call__")


class FunctionTool(Tool):
    """A plain function with its schema."""

    def __init__(self, fn: Callable[..., Any], name: str, description: str, parameters: dict):
        self.fn, self.name, self.description, self.parameters = fn, name, description, parameters

    def __call__(self, **arguments: Any) -> str:
        return str(self.fn(**arguments))


_TOOLS: Registry[Callable[..., Tool]] = Registry(
    "tool", "Register one with @rlhf_mcore.agents.register_tool(...) in a trainer.plugins file, or name an "
    "importable class with class_name in the tool config.")


def register_tool(name: Optional[str] = None, description: Optional[str] = None,
                  parameters: Optional[dict] = None, *, override: bool = False):
    """Decorator for a function (`name`, `description`, `parameters` required: the OpenAI function schema) or a
    :class:`Tool` subclass (its class attributes; `name` may be given here instead)."""

    def decorator(obj):
        if inspect.isclass(obj):
            if not issubclass(obj, Tool):
                raise TypeError(f"@register_tool on class {obj.__qualname__}: it must subclass rlhf_mcore.agents.Tool")
            if name:
                obj.name = name
            if not obj.name:
                raise ValueError(f"@register_tool on class {obj.__qualname__}: give it a `name`")
            _TOOLS.add(obj.name, obj, override=override)
            return obj
        if not (name and description is not None and parameters is not None):
            raise ValueError(f"@register_tool on function {getattr(obj, '__qualname__', obj)!r}: pass name=, "
                             "description= and parameters= (the JSON schema of its arguments)")

        def factory(**config):
            if config:
                raise ToolConfigError(f"tool {name!r} is a function and takes no config (got {sorted(config)})")
            return FunctionTool(obj, name, description, parameters)

        factory.__module__, factory.__qualname__ = obj.__module__, obj.__qualname__
        _TOOLS.add(name, factory, override=override)
        return obj

    return decorator


def get_tool(name: str, **config: Any) -> Tool:
    """A new instance of the registered tool `name`."""
    return _TOOLS.get(name, key="tool name")(**config)


def list_tools() -> list[str]:
    return _TOOLS.names()


def _import_object(path: str, where: str):
    module, _, attr = path.replace(":", ".").rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ToolConfigError(f"{where}: class_name {path!r} cannot be imported ({type(e).__name__}: {e}); give "
                              f"'package.module.Name' of a Tool subclass or a @register_tool function") from None


def build_tools(entries: list[dict], where: str = "tool config") -> dict[str, Tool]:
    """Tools by name from config entries (`name` or `class_name`, optional `config` and `tool_schema`)."""
    tools: dict[str, Tool] = {}
    for k, entry in enumerate(entries):
        here = f"{where}: tools[{k}]"
        if not isinstance(entry, dict) or not (entry.get("name") or entry.get("class_name")):
            raise ToolConfigError(f"{here} = {entry!r}: each entry needs `name` (a registered tool: "
                                  f"{list_tools()}) or `class_name`")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ToolConfigError(f"{here}.config must be a mapping of constructor arguments, got {config!r}")
        if entry.get("class_name"):
            obj = _import_object(entry["class_name"], here)
            tool = obj(**config) if inspect.isclass(obj) else None
            if tool is None:  # a decorated function: registered under its own name on import
                matches = [n for n in _TOOLS.names() if getattr(_TOOLS.get(n, key="tool"), "__qualname__", None)
                           == getattr(obj, "__qualname__", None)]
                if not matches:
                    raise ToolConfigError(f"{here}: {entry['class_name']!r} is neither a Tool subclass nor a "
                                          "@register_tool function")
                tool = get_tool(matches[0], **config)
            if not isinstance(tool, Tool):
                raise ToolConfigError(f"{here}: {entry['class_name']!r} did not give a rlhf_mcore.agents.Tool")
        else:
            try:
                tool = get_tool(entry["name"], **config)
            except ValueError as e:
                raise ToolConfigError(f"{here}: {e}") from None
            except TypeError as e:
                raise ToolConfigError(f"{here}: bad config for tool {entry['name']!r}: {e}") from None
        schema = entry.get("tool_schema")
        if schema is not None:
            fn = schema.get("function") if isinstance(schema, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ToolConfigError(f"{here}.tool_schema must be {{type: function, function: {{name, "
                                      f"description, parameters}}}}, got {schema!r:.120}")
            tool.name = fn["name"]
            tool.description = fn.get("description", tool.description)
            tool.parameters = fn.get("parameters", tool.parameters)
        if tool.name in tools:
            raise ToolConfigError(f"{here}: a second tool named {tool.name!r}; tool names must be unique")
        tools[tool.name] = tool
    return tools


def load_tool_config(path: str | Path) -> dict[str, Tool]:
    """The tools of a YAML tool config (module docstring)."""
    import yaml

    p = Path(path)
    key = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
    if not p.is_file():
        raise ToolConfigError(f"{key}={str(path)!r}: no such file (e.g. configs/tools/calculator.yaml)")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ToolConfigError(f"{key}={str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("tools"), list):
        raise ToolConfigError(f"{key}={str(path)!r}: expected a mapping with a `tools:` list")
    return build_tools(raw["tools"], where=str(path))
