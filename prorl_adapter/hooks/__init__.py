"""The hooks: their specifications (`specs`), loading plugins (`manager`), and calling them (`PluginSet`).

What a plugin author imports is here: `hookimpl`, `PluginConfigError`, `PluginSet` to load plugins in a process
of one's own (a trainer, a test), and `Backend`, what a training backend's object is."""

from .manager import PluginConfigError, PluginLoadError
from .plugin_set import PluginSet
from .specs import Backend, hookimpl

__all__ = ["Backend", "PluginConfigError", "PluginLoadError", "PluginSet", "hookimpl"]
