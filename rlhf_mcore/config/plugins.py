"""`trainer.plugins`: user files or modules imported on every rank before anything is built (they register
rewards, advantage estimators, policy losses)."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from rlhf_mcore.config.errors import ConfigError


def load_plugins(plugins: list[str]) -> None:
    """Import each ``trainer.plugins`` entry (a .py file or a module name) once; registrations happen on import."""
    for entry in plugins:
        name = f"rlhf_mcore_plugin_{Path(entry).stem}" if entry.endswith(".py") else entry
        if name in sys.modules:
            continue
        try:
            if entry.endswith(".py"):
                if not Path(entry).is_file():
                    raise ConfigError(f"trainer.plugins: file {entry!r} does not exist.")
                spec = importlib.util.spec_from_file_location(name, entry)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
            else:
                importlib.import_module(entry)
        except ConfigError:
            raise
        except Exception as e:  # a plugin's own error: say which plugin
            sys.modules.pop(name, None)
            raise ConfigError(f"trainer.plugins: importing {entry!r} failed: {type(e).__name__}: {e}") from e
