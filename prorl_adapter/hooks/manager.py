"""The plugin manager: plugins come from the entry-point group `prorl_adapter`, from import paths given in
config, and from objects. A plugin that fails to load is an error that names it, never a silent skip."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import Any

import pluggy

from ..tasks import TaskHandler
from . import specs as hookspecs
from .specs import PluginConfigError

ENTRY_POINT_GROUP = "prorl_adapter"


class PluginLoadError(RuntimeError):
    pass


def import_object(path: str) -> Any:
    """`package.module` or `package.module:attribute` (also `pkg://package.module`, as verl writes it)."""
    module_name, _, attribute = path.removeprefix("pkg://").partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attribute) if attribute else module
    except Exception as exc:  # whatever a broken plugin raises on import, report it with the plugin's name
        raise PluginLoadError(f"cannot load plugin {path!r}: {type(exc).__name__}: {exc}") from exc


def make_plugin_manager(
    import_paths: Iterable[str] = (),
    objects: Iterable[object] = (),
    blocked: Iterable[str] = (),
    load_entry_points: bool = True,
) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in blocked:
        pm.set_blocked(name)
    if load_entry_points:
        for entry_point in _entry_points():
            if pm.is_blocked(entry_point.name) or pm.has_plugin(entry_point.name):
                continue
            try:
                plugin = entry_point.load()
            except Exception as exc:  # a broken third-party plugin must be reported, not swallowed
                raise PluginLoadError(
                    f"plugin {entry_point.name!r} ({entry_point.value}) failed to load: {type(exc).__name__}: {exc}"
                ) from exc
            pm.register(plugin, name=entry_point.name)
    for path in import_paths:
        if not pm.is_blocked(path):
            pm.register(import_object(path), name=path)
    for plugin in objects:
        name = f"{type(plugin).__module__}.{type(plugin).__qualname__}"
        if not pm.is_blocked(name):
            pm.register(plugin, name=name if not pm.has_plugin(name) else None)
    try:
        pm.check_pending()  # an implementation of a hook that does not exist (a typo) is an error
    except pluggy.PluginValidationError as exc:
        raise PluginLoadError(f"a plugin implements a hook that does not exist: {exc}") from exc
    return pm


def _entry_points() -> list:
    """The group's entry points; two distributions claiming one name is an error naming both."""
    found: dict[str, object] = {}
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        other = found.setdefault(entry_point.name, entry_point)
        if other is not entry_point and other.value != entry_point.value:
            raise PluginLoadError(
                f"two plugins are named {entry_point.name!r}: {other.value} and {entry_point.value}; "
                "uninstall one, or block the name"
            )
    return list(found.values())


def configure_plugins(pm: pluggy.PluginManager, config: dict[str, Any]) -> None:
    """Hand every plugin the configuration; a section that no plugin reads is an error (a typo, or a plugin
    that is not installed), as is whatever a plugin finds wrong in its own section."""
    claimed = {name for sections in pm.hook.prorl_configure(config=config) for name in sections or []}
    unknown = sorted(set(config) - claimed)
    if unknown:
        raise PluginConfigError(
            f"plugin configuration has unknown section(s) {', '.join(map(repr, unknown))}; "
            f"the loaded plugins read: {', '.join(sorted(claimed)) or 'none'}"
        )


def collect_tasks(pm: pluggy.PluginManager) -> dict[str, TaskHandler]:
    tasks: dict[str, TaskHandler] = {}
    owners: dict[str, str] = {}
    for impl in pm.hook.prorl_register_tasks.get_hookimpls():
        for handler in impl.function() or []:
            if not isinstance(handler, TaskHandler):
                raise PluginLoadError(f"plugin {impl.plugin_name!r} registered {handler!r}, not a TaskHandler")
            if handler.name in tasks:
                raise PluginLoadError(
                    f"task {handler.name!r} is registered twice: by {owners[handler.name]!r} and {impl.plugin_name!r}"
                )
            tasks[handler.name] = handler
            owners[handler.name] = impl.plugin_name
    return tasks
