"""The hooks: their specifications (`specs`), loading plugins (`manager`), and calling them (`PluginSet`).

What a plugin author imports is here: `hookimpl`, `PluginConfigError`, and `PluginSet` to load plugins in
a process of one's own (a trainer, a test)."""

from .manager import PluginConfigError, PluginLoadError
from .plugin_set import PluginSet
from .specs import hookimpl

__all__ = ["PluginConfigError", "PluginLoadError", "PluginSet", "hookimpl"]
