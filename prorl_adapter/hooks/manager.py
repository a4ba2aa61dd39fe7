"""Loading plugins: from the entry-point group `prorl_adapter`, from import paths given in config, and from
objects. A plugin that fails to load, or that finds its configuration section wrong, is an error that names
it, never a silent skip.

What is loaded: a module is registered as it is (its hooks are functions); a class is instantiated, with its
section of the plugin configuration when it names one (`config_section`), so that each plugin set (the
service's, a trainer's, a test's) has its own configured instances; any other object is registered as it is.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Iterable, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pluggy

from server_kit.errors import ProrlError

from ..tasks import TaskHandler
from . import specs

ENTRY_POINT_GROUP = "prorl_adapter"


class PluginLoadError(ProrlError, RuntimeError):
    pass


class PluginConfigError(ProrlError, ValueError):
    """A plugin's configuration is wrong; the message names the plugin, the key and what is expected."""


def import_object(path: str) -> Any:
    """`package.module` or `package.module:attribute` (also `pkg://package.module`, as verl writes it)."""
    module_name, _, attribute = path.removeprefix("pkg://").partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attribute) if attribute else module
    except Exception as exc:  # whatever a broken plugin raises on import, report it with the plugin's name
        raise PluginLoadError(f"cannot load plugin {path!r}: {type(exc).__name__}: {exc}") from exc


def read_plugin_config(path: Path | None) -> dict[str, Any]:
    """The plugin configuration from a JSON file of sections (`--plugin-config`); None: no configuration."""
    if path is None:
        return {}
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the plugin configuration {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"the plugin configuration {path} must be a JSON object of sections")
    return config


def instantiate(plugin: Any, config: Mapping[str, Any], name: str) -> Any:
    """A class becomes an instance, given its `config_section` of `config` (None when absent); anything else
    is returned as it is."""
    if not inspect.isclass(plugin):
        return plugin
    section = getattr(plugin, "config_section", None)
    try:
        return plugin(config.get(section)) if section else plugin()
    except PluginConfigError:
        raise
    except Exception as exc:  # a plugin's constructor is user code: report it with the plugin's name
        raise PluginLoadError(f"plugin {name!r} could not be created: {type(exc).__name__}: {exc}") from exc


def make_plugin_manager(
    config: Mapping[str, Any] | None = None,
    import_paths: Iterable[str] = (),
    objects: Iterable[object] = (),
    blocked: Iterable[str] = (),
    load_entry_points: bool = True,
) -> pluggy.PluginManager:
    """The configured plugins. A configuration section that no plugin created here reads is an error (a typo, a
    plugin that is not installed or is blocked, or one given as an object, which is configured already), and so
    is one plugin class loaded twice (its verdicts would count twice)."""
    config = dict(config or {})
    pm = pluggy.PluginManager(specs.PROJECT)
    pm.add_hookspecs(specs)
    for name in blocked:
        pm.set_blocked(name)
    read: set[str] = set()  # the sections given to the plugins created here
    owners: dict[type, str] = {}  # a class created here -> the name it was loaded under

    def add(plugin: Any, name: str) -> None:
        created = inspect.isclass(plugin)
        if created and getattr(plugin, "config_section", None):
            read.add(plugin.config_section)
        instance = instantiate(plugin, config, name)
        cls = type(instance)
        if cls in owners:  # objects of one class may be several configured instances; a created class may not
            raise PluginLoadError(
                f"plugin {cls.__module__}.{cls.__qualname__} is loaded twice: as {owners[cls]!r} and as {name!r}; "
                "block one of them"
            )
        if created:
            owners[cls] = name
        pm.register(instance, name=name if not pm.has_plugin(name) else None)

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
            add(plugin, entry_point.name)
    for path in import_paths:
        if not pm.is_blocked(path):
            add(import_object(path), path)
    for plugin in objects:
        name = f"{type(plugin).__module__}.{type(plugin).__qualname__}"
        if not pm.is_blocked(name):
            add(plugin, name)
    try:
        pm.check_pending()  # an implementation of a hook that does not exist (a typo) is an error
    except pluggy.PluginValidationError as exc:
        raise PluginLoadError(f"a plugin implements a hook that does not exist: {exc}") from exc
    check_one_backend(pm)
    unknown = sorted(set(config) - read)
    if unknown:
        raise PluginConfigError(
            f"plugin configuration has unknown section(s) {', '.join(map(repr, unknown))}; "
            f"the loaded plugins read: {', '.join(sorted(read)) or 'none'}"
        )
    return pm


def check_one_backend(pm: pluggy.PluginManager) -> None:
    """At most one plugin implements the backend hooks (specs.Backend): they are firstresult, so with two, one
    would silently answer for the other."""
    backends = {impl.plugin_name for hook in specs.BACKEND_HOOKS for impl in getattr(pm.hook, hook).get_hookimpls()}
    if len(backends) > 1:
        raise PluginLoadError(
            f"more than one training backend is loaded ({', '.join(sorted(backends))}): a plugin set drives one "
            "trainer; load one, or block the others"
        )


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
